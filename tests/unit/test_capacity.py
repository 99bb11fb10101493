"""KV capacity from memory: rows = (budget - weights) // (slots x per-token KV), checked against the formula; a
budget without room for one full-length row is an error at validation (deploy) time, naming the fix; the routers
admit no more sequences than a replica holds rows (the rest queue)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from helpers import make_tiny_llama
from s2d_ray.errors import ConfigError
from s2d_ray.models.capacity import GIB, ModelShape, kv_capacity
from s2d_ray.serve import AppConfig
from s2d_ray.serve.app_config import TargetSpec
from s2d_ray.serve.replica import sized_rows

LLAMA_7B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096,
            "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False,
            "max_position_embeddings": 4096}


def test_llama_7b_shapes_match_the_known_sizes():
    shape = ModelShape.from_config(LLAMA_7B)
    assert shape.kv_bytes_per_token("bfloat16") == 2 * 32 * 32 * 128 * 2 == 512 * 1024  # 0.5 MiB per token
    assert shape.weight_bytes("bfloat16") == 6_738_415_616 * 2  # Llama-2-7B's parameter count
    assert shape.kv_bytes_per_token("bfloat16", tp_size=4) * 4 == shape.kv_bytes_per_token("bfloat16")


def test_capacity_is_the_formula():
    shape = ModelShape.from_config(LLAMA_7B)
    token, weights = shape.kv_bytes_per_token("bfloat16"), shape.weight_bytes("bfloat16")
    budget = int(0.9 * 48 * GIB)  # an L40S at memory_fraction 0.9
    cap = kv_capacity(budget, weights, token, max_slots=4096, max_rows=32)
    assert cap.rows == (budget - weights) // (4096 * token) == 15  # not the 32 rows (64 GiB) configured
    assert kv_capacity(budget, weights, token, max_slots=4096, max_rows=8).rows == 8  # capped by the config
    assert "15 rows x 4096 slots" in cap.describe()


def test_too_small_a_budget_is_an_error_naming_the_fix():
    """Negative control: a budget that holds the weights but not one full-length row."""
    shape = ModelShape.from_config(LLAMA_7B)
    token, weights = shape.kv_bytes_per_token("bfloat16"), shape.weight_bytes("bfloat16")
    with pytest.raises(ConfigError, match="no room for one row of 4096 tokens.*memory_fraction"):
        kv_capacity(weights + 4096 * token - 1, weights, token, max_slots=4096, max_rows=32)
    assert kv_capacity(weights + 4096 * token, weights, token, max_slots=4096, max_rows=32).rows == 1


def _args(source, **target) -> dict:
    return {"targets": [{"name": "t", "source": str(source), "dtype": "float32", **target}], "spec": {"mode": "ar"},
            "limits": {"max_total_tokens": 256, "max_concurrent_sequences": 16}}


def test_validation_sizes_from_the_model_and_refuses_a_budget_too_small(tiny_llama_dir):
    shape = ModelShape.from_config(make_tiny_llama().config.to_dict())
    row = 256 * shape.kv_bytes_per_token("float32")
    weights = shape.weight_bytes("float32")
    gib = (weights + 3.5 * row) / GIB  # room for 3 rows at memory_fraction 1
    cfg = AppConfig.model_validate(_args(tiny_llama_dir, memory_fraction=1.0, device_memory_gib=gib))
    assert cfg.target_capacity("t").rows == 3
    assert cfg.max_sequences("t") == 3  # admission: the 4th sequence queues at the router
    cfg = AppConfig.model_validate(_args(tiny_llama_dir, device_memory_gib=gib))
    assert cfg.target_capacity("t") is None and cfg.max_sequences("t") == 16  # no memory_fraction: as configured
    with pytest.raises(ValidationError, match="target t: memory budget .* no room for one row of 256 tokens"):
        AppConfig.model_validate(_args(tiny_llama_dir, memory_fraction=0.5, device_memory_gib=gib / 4))


def test_the_replica_sizes_from_its_measured_weights():
    model = make_tiny_llama()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    token = ModelShape.from_config(model.config.to_dict()).kv_bytes_per_token("float32")
    spec = TargetSpec(name="t", dtype="float32", memory_fraction=1e-9, max_live_sequences=4)
    with pytest.raises(ConfigError, match="target t"):
        sized_rows(spec, model, max_slots=64)  # a few bytes of host RAM: not even the weights fit
    assert sized_rows(TargetSpec(name="t", max_live_sequences=4), model, 64) == 4  # unset: the configured rows
    big = TargetSpec(name="t", dtype="float32", memory_fraction=1.0, max_live_sequences=10**9)
    rows = sized_rows(big, model, max_slots=64)
    assert rows == (big.memory_bytes() - weights) // (64 * token)


def test_gpu_through_ray_actor_options_counts_as_cuda():
    assert TargetSpec(name="t", ray_actor_options={"num_gpus": 1}).device == "cuda"
    assert TargetSpec(name="t", tp_size=2, tp_worker_gpus=1, dtype="float32").device == "cuda"
    assert TargetSpec(name="t").device == "cpu"
