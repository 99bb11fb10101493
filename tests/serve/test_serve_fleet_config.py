"""deployments/gpu.yaml as an operator runs it: it validates and binds, its autoscaling thresholds are reachable (a
threshold no load can reach is refused, naming the field), the draft scales on its busy fraction, each target's KV
fits its GPU at the configured memory_fraction, and Vicuna's chat template renders FastChat's conversation."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from helpers import make_tiny_tokenizer
from s2d_ray.models.capacity import GIB
from s2d_ray.prompts import encode_messages, override_chat_template
from s2d_ray.serve import AppConfig, build_app
from s2d_ray.serve.deployment_options import router_ceiling

GPU_YAML = Path(__file__).resolve().parents[2] / "deployments" / "gpu.yaml"
LLAMA2 = {"num_attention_heads": 32, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
          "vocab_size": 32000, "max_position_embeddings": 4096}
SHAPES = {  # Llama-2 7B (Vicuna-7B), 13B (Vicuna-13B) and 70B config.json fields that size KV and weights
    "vicuna-7b-v1.5": LLAMA2,
    "vicuna-13b-v1.5": {**LLAMA2, "num_attention_heads": 40, "hidden_size": 5120, "intermediate_size": 13824,
                        "num_hidden_layers": 40},
    "llama-2-70b-chat": {**LLAMA2, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192,
                         "intermediate_size": 28672, "num_hidden_layers": 80},
}


@pytest.fixture(scope="module")
def gpu_args() -> dict:
    return yaml.safe_load(GPU_YAML.read_text())["applications"][0]["args"]


def test_gpu_yaml_builds_with_reachable_thresholds_and_the_busy_policy(gpu_args):
    cfg = AppConfig.model_validate(gpu_args)
    build_app(gpu_args)
    routers = router_ceiling(cfg.router)
    for t in cfg.targets:
        assert t.device == "cuda" and t.autoscaling_config["target_ongoing_requests"] < routers
    assert cfg.draft.autoscaling_config["policy"]["policy_function"].endswith("DraftBusyPolicy")
    assert cfg.draft.autoscaling_config["max_replicas"] <= cfg.router.autoscaling_config["min_replicas"]
    assert cfg.draft.base_model == "/mnt/models/vicuna-7b-v1.5"


def test_a_threshold_no_load_reaches_is_refused_naming_the_field(gpu_args):
    args = copy.deepcopy(gpu_args)
    args["targets"][0]["autoscaling_config"]["target_ongoing_requests"] = 16  # more than 8 routers can send
    with pytest.raises(ValidationError, match=r"targets\[vicuna-7b-v1.5\]\.autoscaling_config\.target_ongoing_"
                                              r"requests: 16 is never exceeded.*at most 8"):
        AppConfig.model_validate(args)
    args = copy.deepcopy(gpu_args)
    del args["draft"]["autoscaling_config"]["policy"]
    args["draft"]["autoscaling_config"]["target_ongoing_requests"] = 48  # 8 routers x 3 targets = 24 calls at most
    with pytest.raises(ValidationError, match=r"draft\.autoscaling_config\.target_ongoing_requests: 48"):
        AppConfig.model_validate(args)
    args["draft"]["autoscaling_config"]["target_ongoing_requests"] = 4
    AppConfig.model_validate(args)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_target_fits_its_gpu_with_rows_to_spare(gpu_args, name):
    cfg = AppConfig.model_validate(gpu_args)
    spec = cfg.target(name)
    cap = spec.capacity(SHAPES[name], cfg.limits.max_total_tokens, spec.memory_bytes())
    assert spec.memory_bytes() == int(spec.device_memory_gib * GIB)
    assert 1 <= cap.rows <= spec.max_live_sequences, cap.describe()
    # the unsized default (32 rows of 4096 tokens) would not fit these GPUs: that is what the budget fixes
    assert cap.rows < 32 or name == "llama-2-70b-chat"


def test_vicuna_template_renders_fastchats_conversation(gpu_args):
    tok = make_tiny_tokenizer()
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    override_chat_template(tok, gpu_args["targets"][0]["chat_template"])
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == ("<s>A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                    "helpful, detailed, and polite answers to the user's questions. USER: Hi ASSISTANT:")
    assert encode_messages(tok, [{"role": "user", "content": "Hi"}])  # the router's path: ids, no 400


def test_cluster_mounts_the_models_loudly_and_ships_the_deployments():
    raw = yaml.safe_load((GPU_YAML.parents[1] / "cluster.yaml").read_text())
    setup = raw["setup_commands"]
    assert not any("|| true" in cmd for cmd in setup)  # a failed mount must stop the node's setup
    assert any("mount -t efs" in cmd and "$(cat ~/.s2d-efs-id)" in cmd for cmd in setup)  # read on the node
    assert any(cmd.startswith("mountpoint -q /mnt/models ||") and "exit 1" in cmd for cmd in setup)
    assert raw["file_mounts"]["~/deployments"] == "./deployments"  # gpu.yaml on the head node
    assert "${" not in "\n".join(setup)  # no variable of the launching machine expanded on a node
