"""`s2d generate` end to end on a tiny model directory, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from s2d_ray.cli import main


def run_cli(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "s2d_ray.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_generate_json_same_tokens_in_every_mode(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is the capital of France?"}\n{"prompt": "Write a poem"}\n')
    outs, lps = {}, {}
    for mode in ("ar", "s2d", "exit:1"):
        # fp32: token for token (bf16, `auto` here, only up to near-ties)
        code = main(["generate", "--target", str(tiny_llama_dir), "--draft", f"cut:{tiny_llama_dir}:2", "--mode", mode,
                     "--prompt-file", str(prompts), "--chat", "--max-new-tokens", "12", "--json", "--batch-size", "2",
                     "--logprobs", "2", "--dtype", "float32"])
        assert code == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(rows) == 2 and all(len(r["token_ids"]) <= 12 for r in rows)
        assert {"mean_acceptance_length", "acceptance_histogram", "exit_histogram"} <= set(rows[0]["metrics"])
        outs[mode] = [r["token_ids"] for r in rows]
        assert all([e["token_id"] for e in r["logprobs"]] == r["token_ids"] for r in rows)
        assert all(len(e["top"]) == 2 and e["logprob"] <= 0 for r in rows for e in r["logprobs"])
        # each token's own bytes: together they are the output's UTF-8 (no token decoded alone)
        assert all(r["text"] in bytes(b for e in r["logprobs"] for b in e["bytes"]).decode("utf-8", "replace")
                   for r in rows)
        lps[mode] = [e["logprob"] for r in rows for e in r["logprobs"]]
    assert outs["ar"] == outs["s2d"] == outs["exit:1"]
    assert lps["s2d"] == pytest.approx(lps["ar"], abs=1e-4) and lps["exit:1"] == pytest.approx(lps["ar"], abs=1e-4)


@pytest.mark.parametrize("args,needle", [
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    (["generate", "--prompt", "hi", "--mode", "turbo"], "mode"),
    (["generate"], "required"),
    (["generate", "--prompt", "hi", "--target", "/nonexistent/model"], "does not exist"),
    (["generate", "--prompt-file", "/nonexistent.txt"], "does not exist"),
    (["generate", "--prompt", "hi", "--exits", "a,b"], "integers"),
    (["generate", "--prompt", "hi", "--logprobs", "3"], "--logprobs needs --json"),
])
def test_bad_arguments_print_one_line_and_exit_2(args, needle):
    proc = run_cli(args)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("s2d: error:") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, flag", [
    (["bench", "spec"], "--questions"),
    (["train-draft", "--out", "{tmp}/run"], "--data"),
    (["self-distill", "--out", "{tmp}/sd.jsonl"], "--data"),
    (["eval-gsm8k"], "--test"),
])
def test_commands_that_need_data_name_s2d_data_dir_when_it_is_unset(args, flag, tmp_path):
    """No machine's path is a default: without S2D_DATA_DIR a command that needs data says what to set or pass, in
    one line, before it loads anything."""
    env = {k: v for k, v in os.environ.items() if k != "S2D_DATA_DIR"}
    proc = run_cli([a.format(tmp=tmp_path) for a in args], env)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "S2D_DATA_DIR" in lines[0] and flag in lines[0], lines[0]


def test_default_data_paths_lie_under_s2d_data_dir(tmp_path):
    env = {**os.environ, "S2D_DATA_DIR": str(tmp_path)}
    proc = run_cli(["bench", "spec"], env)
    assert proc.returncode == 2 and str(tmp_path / "spec_bench" / "question.jsonl") in proc.stderr, proc.stderr
