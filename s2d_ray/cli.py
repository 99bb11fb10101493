"""`s2d` command line: subcommands live in their own modules and register themselves here.

Errors a user can cause print one line (`s2d: error: ...`) and exit 2; no tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from .errors import S2DError

# Each module defines `register(subparsers)`; its parser sets `func(args) -> int`.
COMMAND_MODULES = [
    "s2d_ray.commands.generate",
    "s2d_ray.train.cli",
    "s2d_ray.bench.cli",
    "s2d_ray.fleet.cli",
]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"s2d: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="s2d", description="Sorted Speculative Decoding (S2D) on Ray")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (S2DError, ValueError) as exc:  # pydantic ValidationError is a ValueError
        msg = str(exc).strip().replace("\n", "; ")
        sys.stderr.write(f"s2d: error: {msg}\n")
        return 2
    except FileNotFoundError as exc:
        sys.stderr.write(f"s2d: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
