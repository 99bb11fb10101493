"""The repository describes the product as it is: no development history or machine paths in tracked text, raw
benchmark records only behind current figures, no checkpoints outside the package assets."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Words that describe how the project was made rather than what it is, and paths of one particular machine. Spelled
# in pieces so that this file does not match itself.
HISTORY = re.compile("|".join([
    r"\b[Ss]ession" + r"s? \d",          # numbered working sessions
    r"\b[Ii]ssue" + r"s? #?\d",          # tracker issue numbers
    r"quiet" + r"\.sh|pause" + r"\.sh",  # the development machine's scripts
    r"/wo" + r"rk/|/ro" + r"ot/|/ho" + r"me/[a-z]",  # absolute paths of a machine
]))
TEXT_SUFFIXES = {".py", ".md", ".json", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg", ".ini", ""}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def offending_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    return [f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}"
            for i, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


def test_no_development_history_or_machine_paths_in_tracked_text():
    files = [p for p in tracked_files() if p.suffix in TEXT_SUFFIXES and p.is_file()]
    found = [line for p in files for line in offending_lines(p)]
    assert not found, "development history or machine paths in tracked files:\n" + "\n".join(found[:40])


def test_the_rule_catches_what_it_names():
    # Negative control: each kind of line the rule exists for is caught, and product text is not.
    for bad in ["measured in sess" + "ion 12", "see iss" + "ue 41", "run under qui" + "et.sh",
                "DATA_DIR = '/wo" + "rk/shared/data'", "PYTHON=/ro" + "ot/.venv/bin/python"]:
        assert HISTORY.search(bad), bad
    for good in ["a Ray session's address", "the issues a client reports", "a round of speculation",
                 "paths come from S2D_DATA_DIR", "a homework problem"]:
        assert not HISTORY.search(good), good


def test_raw_benchmark_records_are_few_and_small():
    records = [p for p in tracked_files() if p.is_relative_to(ROOT / "bench_results") and p.is_file()]
    assert len(records) <= 300, f"bench_results/ holds {len(records)} files"
    assert sum(p.stat().st_size for p in records) <= 8 * 1024 * 1024, "bench_results/ is over 8 MB"
    scripts = [str(p.relative_to(ROOT)) for p in records if p.suffix in {".py", ".sh"}]
    assert not scripts, f"one-off scripts under bench_results/: {scripts}"


def test_no_checkpoint_outside_the_package_assets():
    weights = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt"}
    assets = ROOT / "s2d_ray" / "assets"
    stray = [str(p.relative_to(ROOT)) for p in tracked_files() if p.suffix in weights and not p.is_relative_to(assets)]
    assert not stray, f"checkpoints outside s2d_ray/assets/: {stray}"
