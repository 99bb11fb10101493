"""The benchmark harness: Spec-Bench end to end on a tiny model, the speedup/MAT definitions, the equality check,
per-step costs, and the streaming load client (against a tiny SSE server until the real app is wired in)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import save_tiny_llama
from s2d_ray.bench.methods import HFGenerate, MethodStats
from s2d_ray.bench.report import summarize
from s2d_ray.bench.spec import SpecRun, first_mismatch, run_target
from s2d_ray.cli import main
from s2d_ray.core.types import SamplingParams
from s2d_ray.models import load_model
from s2d_ray.prompts import Question, read_questions, select_questions

ROWS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem about the sea.", "Now make it shorter."]},
    {"question_id": 82, "category": "coding", "turns": ["def add(a, b):", "Add type hints."]},
    {"question_id": 201, "category": "translation", "turns": ["Translate to German: good morning"]},
    {"question_id": 301, "category": "summarization", "turns": ["Summarize: the quick brown fox jumps."]},
    {"question_id": 401, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 501, "category": "math_reasoning", "turns": ["Natalia sold 48 clips. Half as many in May?"]},
    {"question_id": 601, "category": "rag", "turns": ["Context: Paris is in France. Question: where is Paris?"]},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("bench") / "tiny", num_layers=4, dtype=torch.float64)


@pytest.fixture(scope="module")
def questions_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


def test_spec_bench_end_to_end_on_a_tiny_model(tiny_dir, questions_file, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "spec", "--target", str(tiny_dir), "--draft", f"cut:{tiny_dir}:3", "--questions",
               str(questions_file), "--per-category", "1", "--max-new-tokens", "10", "--dtype", "float64",
               "--threads", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    methods = data["meta"]["methods"][str(tiny_dir)]
    assert methods == ["hf-generate", "ar", "hf-assisted", "hf-assisted:heuristic", "hf-early-exit:3",
                       "hf-prompt-lookup", "exit:1", "exit:2", "exit:3", "s2d"]
    # one MT-Bench question (two turns) + one of each other task = 7 generations per method
    assert len(data["records"]) == 7 * len(methods)
    summary = data["summary"][str(tiny_dir)]
    assert list(summary) == ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "overall"]
    overall = summary["overall"]
    assert overall["hf-generate"]["speedup"] == pytest.approx(1.0) and overall["hf-generate"]["mat"] == 1.0
    for name, row in overall.items():
        if name != "hf-generate":  # every lossless method equals plain decoding in float64
            assert row["checked"] == 7 and row["equal"] == 7 and row["mismatches"] == 0, name
    assert overall["s2d"]["exit_usage"] and abs(sum(overall["s2d"]["exit_usage"].values()) - 1) < 1e-9
    assert overall["exit:2"]["exit_usage"] == {"2": 1.0}
    assert overall["s2d"]["time_split"] is not None
    turn2 = [r for r in data["records"] if r["turn"] == 2]
    assert len({r["prompt_tokens"] for r in turn2}) == 1  # every method saw the same second-turn conversation
    assert (out / "speedup.png").stat().st_size > 1000 and (out / "exit_usage.png").stat().st_size > 1000
    assert "### " in (out / "tables.md").read_text() and "| s2d |" in capsys.readouterr().out


def test_shaped_rows_fix_an_exit_under_the_same_tree_and_stay_exact(tiny_dir, questions_file, tmp_path):
    """`exit:<L>:<shape>` is `s2d:<shape>` at one fixed exit: the adaptive draft against each single exit on the same
    tree and lookup settings. Every row equals plain decoding in float64; the fixed rows draft only at their exit."""
    out = tmp_path / "out"
    shape = "tree3+lookup+fixed+k2"
    names = ["hf-generate", f"exit:1:{shape}", f"exit:3:{shape}", f"s2d:{shape}"]
    base = ["bench", "spec", "--target", str(tiny_dir), "--draft", f"cut:{tiny_dir}:3", "--questions",
            str(questions_file), "--per-category", "1", "--max-new-tokens", "10", "--dtype", "float64",
            "--threads", "1", "--no-progress", "--out", str(out)]
    assert main(base + ["--methods", ",".join(names)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["methods"][str(tiny_dir)] == names
    overall = data["summary"][str(tiny_dir)]["overall"]
    for name in names[1:]:  # against hf-generate, the baseline
        assert overall[name]["checked"] == 7 and overall[name]["equal"] == 7, name
    drafted_at = {name: set(overall[name]["exit_usage"]) - {"0"} for name in names[1:]}  # "0": lookup nodes
    assert drafted_at == {f"exit:1:{shape}": {"1"}, f"exit:3:{shape}": {"3"}, f"s2d:{shape}": {"3"}}
    # (the random draft is never confident, so the adaptive row leaves at its last exit: thresholds 0.5 / 0.5 / 0)
    assert main(base + ["--methods", "exit:2:tree3+sideways"]) == 2  # a bad shape part is a one-line error


def test_spec_bench_skips_turns_longer_than_the_context(tiny_dir, tmp_path, caplog):
    """A question that does not fit the target's 512-token context is skipped with a warning (its later turns too),
    for every method; the others run. Before, the whole run stopped at it with an error."""
    long = {"question_id": 302, "category": "summarization", "turns": ["Summarize: " + "the fox jumps. " * 200]}
    second = {"question_id": 83, "category": "writing", "turns": ["Write a haiku.", "Again, " + "longer " * 600]}
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [ROWS[0], long, second, ROWS[4]]) + "\n")
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        rc = main(["bench", "spec", "--target", str(tiny_dir), "--draft", f"cut:{tiny_dir}:3", "--questions",
                   str(path), "--methods", "hf-generate,ar,s2d", "--max-new-tokens", "8", "--dtype", "float64",
                   "--threads", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    records = json.loads((out / "results.json").read_text())["records"]
    done = sorted({(r["question_id"], r["turn"]) for r in records})
    assert done == [(81, 1), (81, 2), (83, 1), (401, 1)]  # q302 skipped, and q83's second turn
    assert len(records) == 4 * 3
    skipped = [m for m in caplog.messages if "skipped" in m]
    assert len(skipped) == 2 and "q302 turn 1" in skipped[0] and "q83 turn 2" in skipped[1]


def _rec(method, qid, tokens, seconds, forwards=None, drafted=None, accepted=None, exits=None, task="qa", turn=1):
    return {"target": "t", "method": method, "question_id": qid, "task": task, "turn": turn, "new_tokens": tokens,
            "seconds": seconds, "num_target_forwards": forwards, "num_draft_tokens": drafted,
            "num_accepted_draft_tokens": accepted, "exit_histogram": exits or {}, "draft_seconds": None,
            "target_seconds": None, "checked": method != "hf-generate", "mismatch": None}


def test_speedup_mat_and_acceptance_follow_the_definitions():
    records = [
        _rec("hf-generate", 1, 100, 10.0, 100), _rec("hf-generate", 2, 50, 10.0, 50),  # 10 and 5 tok/s
        _rec("ar", 1, 100, 5.0, 100), _rec("ar", 2, 50, 10.0, 50),  # faster than plain on q1 only
        # q1 in two turns: 60 + 60 tokens over 2 + 2 s = 30 tok/s; q2: 50 tokens in 2.5 s = 20 tok/s
        _rec("s2d", 1, 60, 2.0, 30, 40, 30, {"2": 30, "6": 10}, turn=1),
        _rec("s2d", 1, 60, 2.0, 20, 50, 40, {"2": 20, "6": 30}, turn=2),
        _rec("s2d", 2, 50, 2.5, 25, 30, 25, {"4": 30}),
    ]
    row = summarize(records)["t"]["overall"]["s2d"]
    # Spec-Bench speedup: the mean of per-question ratios (30/10 and 20/5), not the ratio of mean tokens/s
    assert row["speedup"] == pytest.approx((3.0 + 4.0) / 2) and row["speedup_median"] == pytest.approx(3.5)
    assert row["ratio_of_mean_tps"] == pytest.approx(25.0 / 7.5)
    assert row["speedup_vs_ar"] == pytest.approx((30 / 20 + 20 / 5) / 2)
    assert row["speedup_vs_best_baseline"] == pytest.approx(min(3.5, 2.75))
    assert row["tokens_per_second"] == pytest.approx(25.0)
    assert row["mat"] == pytest.approx(170 / 75)  # tokens per target forward, bonus included, pooled
    assert row["acceptance_rate"] == pytest.approx(95 / 120)
    assert row["exit_usage"] == pytest.approx({"2": 50 / 120, "4": 30 / 120, "6": 40 / 120})
    assert list(row["exit_usage"]) == ["2", "4", "6"]
    plain = summarize(records)["t"]["overall"]["hf-generate"]
    assert plain["speedup"] == 1.0 and plain["mat"] == 1.0 and plain["acceptance_rate"] is None


class OneWrongToken:
    """A deliberately broken 'lossless' method: plain decoding with its 4th token swapped for the least likely."""

    name = "broken"
    lossless = True

    def __init__(self, model) -> None:
        self.model, self.inner = model, HFGenerate(model, eos_token_id=None)

    def generate(self, prompt_ids, max_new_tokens, params):
        tokens, _ = self.inner.generate(prompt_ids, max_new_tokens, params)
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt_ids + tokens[:3]])).logits[0, -1]
        return tokens[:3] + [int(logits.argmin())] + tokens[4:], MethodStats(num_target_forwards=len(tokens))


def test_equality_check_flags_a_method_that_changes_one_token(tiny_dir):
    target = load_model(str(tiny_dir), dtype=torch.float64)
    plain = HFGenerate(target.model, eos_token_id=None)
    qs = [Question(1, "qa", "qa", ("What is the capital of France?",)),
          Question(2, "writing", "mt_bench", ("Write a poem.", "Shorter."))]
    records = run_target("tiny", target, [plain, OneWrongToken(target.model)], qs,
                         SpecRun(max_new_tokens=8, progress=False))
    broken = [r for r in records if r["method"] == "broken"]
    assert len(broken) == 3 and all(r["checked"] and r["matches_baseline"] is False for r in broken)
    for r in broken:
        mm = r["mismatch"]
        assert mm["index"] == 3 and not mm["near_tie"] and mm["pair_gap"] > 0.01 and mm["top2_gap"] >= 0
    row = summarize(records)["tiny"]["overall"]["broken"]
    assert row["mismatches"] == 3 and row["equal"] == 0


def test_a_method_on_the_fresh_forwards_argmax_is_not_flagged(tiny_dir):
    """Where the reference run left the target's argmax (bf16 kernels can order two tokens differently) and the method
    kept it, the difference is the reference's; the other way round it is flagged."""
    model = load_model(str(tiny_dir), dtype=torch.float64).model
    prompt = [5, 6, 7]
    greedy, _ = HFGenerate(model, eos_token_id=None).generate(prompt, 6, SamplingParams())
    with torch.no_grad():
        second = int(torch.topk(model(torch.tensor([prompt + greedy[:3]])).logits[0, -1], 2).indices[1])
    off = greedy[:3] + [second] + greedy[4:]
    kept = first_mismatch(model, prompt, off, greedy, 0.0)
    left = first_mismatch(model, prompt, greedy, off, 0.0)
    assert kept["method_is_argmax"] and kept["near_tie"] and kept["pair_gap"] < 0
    assert not left["method_is_argmax"] and not left["near_tie"] and left["pair_gap"] > 0


def test_question_selection_spreads_and_interleaves(questions_file):
    rows = read_questions(questions_file)
    assert {q.task for q in rows} == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    picked = select_questions(rows, 2)
    assert [q.question_id for q in picked][:6] == [81, 201, 301, 401, 501, 601] and picked[-1].question_id == 82


def test_held_out_path_files_read_as_one_turn_questions():
    rows = read_questions(Path(__file__).parents[2] / "data" / "draftq" / "heldout" / "smollm2-135m-instruct.jsonl")
    assert len(rows) == 47 and {q.task for q in rows} == {"heldout"}
    assert all(len(q.turns) == 1 and q.turns[0] for q in rows)
    assert len(select_questions(rows, 8)) == 8


def test_busy_neighbour_rows_are_measured_against_their_own_alone_runs():
    from s2d_ray.bench.report import is_plain

    def rec(method, qid, seconds):
        return {"target": "t", "method": method, "question_id": qid, "category": "qa", "task": "qa", "turn": 1,
                "prompt_tokens": 4, "new_tokens": 10, "seconds": seconds, "num_target_forwards": 10,
                "num_draft_tokens": 0, "num_accepted_draft_tokens": 0, "exits": {}, "draft_seconds": None,
                "target_seconds": None, "checked": False, "matches_baseline": None, "mismatch": None}
    records = [rec(m, q, s) for q in (1, 2) for m, s in (("hf-generate", 1.0), ("ar", 0.8), ("ar+busy", 1.6),
                                                          ("hf-generate+busy", 4.0))]
    overall = summarize(records)["t"]["overall"]
    assert overall["ar+busy"]["busy_vs_alone"] == pytest.approx(0.5)
    assert overall["hf-generate+busy"]["busy_vs_alone"] == pytest.approx(0.25)
    assert overall["ar"]["busy_vs_alone"] is None
    assert not is_plain("ar+busy") and not is_plain("hf-generate:float32+busy") and is_plain("hf-generate:float32")
    # the fastest plain decoding stays a run alone: ar's 12.5 tok/s, not a busy row
    assert overall["ar+busy"]["speedup_vs_best_baseline"] == pytest.approx(0.5)


def test_bad_bench_arguments_are_one_line_errors(tiny_dir, questions_file, tmp_path, capsys):
    base = ["bench", "spec", "--target", str(tiny_dir), "--draft", f"cut:{tiny_dir}:3", "--questions",
            str(questions_file), "--no-progress", "--out", str(tmp_path / "o"), "--threads", "1"]
    assert main(base + ["--per-category", "0"]) == 2
    assert main(base + ["--methods", "hf-generate,warp-drive", "--max-new-tokens", "4"]) == 2
    assert main(base + ["--categories", "poetry"]) == 2
    assert main(["bench", "spec", "--questions", str(tmp_path / "missing.jsonl")]) == 2
    capacity = ["bench", "draft-capacity", "--url", f"http://127.0.0.1:{_free_port()}", "--out", str(tmp_path / "c")]
    assert main(capacity + ["--targets", "a,b,a"]) == 2
    assert main(capacity + ["--targets", "a", "--requests", "0"]) == 2
    assert main(capacity + ["--targets", "a"]) == 2  # nothing listens there
    captured = capsys.readouterr().err
    err = [line for line in captured.splitlines() if line.startswith("s2d: error: ")]  # (loaders print progress)
    assert len(err) == 7 and "Traceback" not in captured
    assert "warp-drive" in err[1] and "poetry" in err[2]
    assert "repeats a target" in err[4] and "no /stats from" in err[6]


def test_steps_report_on_a_tiny_model(tiny_dir, questions_file, tmp_path, capsys):
    rc = main(["bench", "steps", "--target", str(tiny_dir), "--draft", f"cut:{tiny_dir}:3", "--questions",
               str(questions_file), "--context", "24", "--repeats", "2", "--max-k", "3", "--gen-tokens", "6",
               "--gen-prompts", "2", "--threads", "1", "--dtype", "float64", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "steps.json").read_text())
    assert list(r["target_steps"]) == ["decode", "verify_1", "verify_2", "verify_3"]
    assert list(r["draft_steps"]) == ["exit:1", "exit:2", "exit:3", "s2d (fixed context)"]
    assert r["draft_steps"]["exit:2"]["exits"] == {"2": 2}
    assert all(p["same_tokens"] for p in r["ar_vs_generate"]["prompts"])
    for o in r["overhead"]:
        assert 0 < o["outside_forwards_frac"] < 1 and o["rounds"] > 0
    assert list(r["verify_grid_ms"]) == ["1", "2", "4", "8", "16"] and len(r["verify_grid_ms"]["16"]) == 8
    out = capsys.readouterr().out
    assert "target verify k=3 (4 positions)" in out and "| 16 | " in out


# --- the load client ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sse_server():
    """A stand-in OpenAI streaming endpoint on 127.0.0.1 (the real router replaces it once it exists):
    5 chunks of 2 tokens (10 of 1 with `speculate: false`), usage last; prompt "FAIL" -> 400, prompt "HANG" -> never
    answers. /stats has the router's clocks for model "m": a round, a target call and a draft call per chunk (20 ms
    rounds, 15 ms target calls of which the replica spent 10, its model thread 8 of CPU; 7 ms draft calls, 6 in the
    draft, 4 of them its CPU)."""
    import asyncio

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    chunks_sent = [0]

    @app.get("/stats")
    async def health():
        n = chunks_sent[0]
        return {"targets": {"m": {"timing": {
            "round": {"rounds": n, "mean_round_ms": 20.0, "mean_gap_ms": 0.0},
            "target": {"calls": n, "mean_call_ms": 15.0, "mean_replica_ms": 10.0, "mean_overhead_ms": 5.0,
                       "mean_replica_cpu_ms": 8.0},
            "draft": {"calls": n, "mean_call_ms": 7.0, "mean_replica_ms": 6.0, "mean_overhead_ms": 1.0,
                      "mean_replica_cpu_ms": 4.0}}}}}

    @app.post("/v1/completions")
    async def completions(body: dict):
        if body["prompt"] == "FAIL":
            return JSONResponse({"error": {"message": "bad prompt", "type": "invalid_request_error"}}, 400)

        async def events():
            if body["prompt"] == "HANG":
                await asyncio.sleep(30)
            chunks = 10 if body.get("speculate") is False else 5  # "plain decoding": a token per chunk, slower
            for i in range(chunks):
                await asyncio.sleep(0.01)
                chunks_sent[0] += 1
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f'ab{i}'}]})}\n\n"
            if body.get("stream_options", {}).get("include_usage"):
                yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 10}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_load_client_measures_levels_and_counts_errors(sse_server, tmp_path):
    import asyncio

    from s2d_ray.bench.serve import LoadRun, run_load
    from s2d_ray.bench.serve_report import plot_load, serve_markdown

    run = LoadRun(sse_server, "m", [1, 4], requests=6, max_seconds=20, max_tokens=10, timeout=5)
    result = asyncio.run(run_load(run, ["hello", "FAIL", "world"]))
    one, four = result["summary"]
    assert (one["sent"], one["completed"], one["errors"]) == (6, 4, 2)
    assert four["sent"] == 6 and four["errors"] == 2 and "HTTP 400" in four["error_samples"][0]
    for lv in (one, four):
        assert lv["output_tokens"] == 10 * lv["completed"]  # from usage, not chunk counts
        assert 0 < lv["ttft_ms_p50"] <= lv["latency_ms_p50"] and lv["itl_ms_p50"] >= 5
        assert lv["itl_ms_p99"] >= lv["itl_ms_p50"] and lv["throughput_tokens_per_s"] > 0
    assert "| 4 | 4 | 2 |" in serve_markdown(result)
    assert plot_load(result, tmp_path / "serve.png").stat().st_size > 1000


def test_compare_plain_runs_each_level_both_ways_and_reports_the_ratio(sse_server, tmp_path):
    import asyncio

    from s2d_ray.bench.serve import LoadRun, run_load
    from s2d_ray.bench.serve_report import compared_levels, plot_load, serve_markdown

    run = LoadRun(sse_server, "m", [1, 2], requests=4, max_seconds=20, max_tokens=10, timeout=5, compare_plain=True)
    result = asyncio.run(run_load(run, ["hello"]))
    assert [(s["concurrency"], s["variant"]) for s in result["summary"]] == [
        (1, "speculative"), (1, "plain"), (2, "speculative"), (2, "plain")]
    pairs = compared_levels(result)
    assert [c for c, _, _ in pairs] == [1, 2]
    assert all(spec > 1.3 * plain for _, spec, plain in pairs)  # the stand-in's plain path streams twice the chunks
    text = serve_markdown(result)
    assert "| 1 plain |" in text and "speculative / plain" in text
    assert plot_load(result, tmp_path / "cmp.png").stat().st_size > 1000


class CountingTwin:
    """An in-process twin as `run_load` sees it (`run`), decoding nothing: 10 tokens per request in 0.1 s."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []

    def run(self, concurrency: int, requests: int, max_tokens: int, temperature: float, speculate: bool) -> dict:
        self.calls.append((concurrency, requests, speculate))
        return {"requests": requests, "output_tokens": 10 * requests, "throughput_tokens_per_s": 100.0,
                "rounds": 5 * requests, "prompt_rounds": requests, "prompt_round_s": 0.01 * requests,
                "decode_round_s": 0.09 * requests, "token_ids": [[0] * 10] * requests}


def test_twin_pairs_alternate_served_and_in_process_runs_of_the_same_requests(sse_server):
    """`--twin`: each variant is decoded once by the twin first (not counted), then `twin_pairs` pairs at
    concurrency 1 alternate which side goes first, and the twin decodes exactly the requests the served level sent."""
    import asyncio

    from s2d_ray.bench.serve import LoadRun, run_load
    from s2d_ray.bench.serve_report import serve_markdown

    twin = CountingTwin()
    run = LoadRun(sse_server, "m", [1], requests=2, max_seconds=20, max_tokens=10, timeout=5, compare_plain=True,
                  twin_pairs=2)
    result = asyncio.run(run_load(run, ["a", "b"], twin))
    pairs = result["twin"]["pairs"]
    assert [(x["pair"], x["variant"], x["first"]) for x in pairs] == [
        (0, "speculative", "served"), (0, "plain", "served"), (1, "speculative", "twin"), (1, "plain", "twin")]
    assert twin.calls == [(1, 2, True), (1, 2, False)] * 3  # the warm-up pass, then one run per pair and variant
    assert all(x["served"]["sent"] == x["twin"]["requests"] == 2 and x["equal_tokens"] for x in pairs)
    assert set(result["twin"]["median_ratio"]) == {"speculative", "plain"}
    assert "Median served / twin" in serve_markdown(result)


def test_twin_pairs_run_at_each_twin_concurrency_with_as_many_in_process_clients(sse_server):
    """`--twin-concurrency 1,3`: the pairs repeat per level, the twin decodes with that many clients (a negative
    control: a twin run at concurrency 1 for the level 3 pairs would show in its calls), medians per variant and level."""
    import asyncio

    from s2d_ray.bench.serve import LoadRun, run_load
    from s2d_ray.bench.serve_report import serve_markdown

    twin = CountingTwin()
    run = LoadRun(sse_server, "m", [1], requests=3, max_seconds=20, max_tokens=10, timeout=5, compare_plain=True,
                  twin_pairs=1, twin_concurrency=(1, 3))
    result = asyncio.run(run_load(run, ["a", "b"], twin))
    pairs = result["twin"]["pairs"]
    assert [(x["concurrency"], x["variant"]) for x in pairs] == [
        (1, "speculative"), (1, "plain"), (3, "speculative"), (3, "plain")]
    assert twin.calls[2:] == [(1, 3, True), (1, 3, False), (3, 3, True), (3, 3, False)]
    assert [x["served"]["concurrency"] for x in pairs] == [1, 1, 3, 3]
    assert list(result["twin"]["median_ratio"]) == ["plain@1", "speculative@1", "plain@3", "speculative@3"]
    assert "| 3 | 0 | speculative | served |" in serve_markdown(result)


def test_compare_plain_sends_the_plain_run_the_same_requests_as_the_speculative_one(sse_server):
    """Where `max_seconds` ends a level, the faster speculative run covers more prompts than the plain run would in the
    same time (here about 4 requests of 50 ms against 2 of 100 ms in 0.18 s): the plain run sends exactly the same
    requests, so both rates are over the same work."""
    import asyncio

    from s2d_ray.bench.serve import LoadRun, run_load

    run = LoadRun(sse_server, "m", [1], requests=100, max_seconds=0.18, max_tokens=10, timeout=5, compare_plain=True)
    result = asyncio.run(run_load(run, ["a", "b", "c", "d", "e", "f"]))
    spec, plain = result["summary"]
    assert 1 <= spec["sent"] < 100 and plain["sent"] == spec["sent"] == plain["completed"]
    assert plain["wall_seconds"] > 1.5 * spec["wall_seconds"] - 0.05  # it ran past the speculative run's deadline
    order = lambda key: sorted(r["prompt_index"] for r in result["requests"][key])  # noqa: E731
    assert order("1-plain") == order("1-speculative")


def test_load_client_stops_by_itself_on_a_hanging_server(sse_server, tmp_path):
    import asyncio

    from s2d_ray.bench.serve import LoadRun, run_load
    from s2d_ray.bench.serve_report import plot_load

    run = LoadRun(sse_server, "m", [2], requests=100, max_seconds=0.5, max_tokens=4, timeout=0.5)
    t0 = time.perf_counter()
    result = asyncio.run(run_load(run, ["HANG"]))
    assert time.perf_counter() - t0 < 5
    lv = result["summary"][0]
    assert lv["completed"] == 0 and lv["errors"] == lv["sent"] >= 2 and "Timeout" in lv["error_samples"][0]
    assert plot_load(result, tmp_path / "none.png").exists()  # no latencies at all still plots


def test_assistant_built_from_a_reduced_vocab_draft_proposes_what_the_drafter_does():
    """transformers' assisted generation must get the SAME draft: its own head rows, nothing outside its subset."""
    from core_fixtures import noisy_draft, random_prompts, tiny_target
    from s2d_ray.bench.methods import standalone_draft
    from s2d_ray.core.draft import SortedDrafter
    from s2d_ray.core.types import DraftRequest

    target = tiny_target()
    draft = noisy_draft(target, exits=[3], thresholds=[0.0]).with_vocab(torch.arange(10, 90))
    lm = standalone_draft(draft, target.config)
    for prompt in random_prompts(4, seed=3):
        with torch.no_grad():
            logits = lm(torch.tensor([prompt])).logits[0, -1]
        assert torch.isinf(logits[:10]).all() and torch.isinf(logits[90:]).all()
        proposal = SortedDrafter(draft).propose([DraftRequest("x", prompt, 1)])[0]
        assert int(logits.argmax()) == proposal.tokens[0]


def test_draft_capacity_figures_are_differences_over_the_level():
    from s2d_ray.bench.draft_capacity import draft_delta
    from s2d_ray.errors import ServiceUnavailableError

    before = {"replica": "r1", "num_calls": 10, "num_forwards": 8, "num_rows": 20, "num_merged_forwards": 1,
              "num_merged_rows": 4, "busy_s": 1.0, "queue_delay_s": 0.1, "uptime_s": 100.0}
    # 40 calls (2 targets: 20 rounds each in 10 s -> 500 ms a round), 20 forwards of 3 rows, 10 of them shared
    after = {**before, "num_calls": 50, "num_forwards": 28, "num_rows": 80, "num_merged_forwards": 11,
             "num_merged_rows": 44, "busy_s": 8.0, "queue_delay_s": 0.9, "uptime_s": 110.0}
    d = draft_delta(before, after, num_targets=2)
    assert (d["calls"], d["forwards"], d["rows"]) == (40, 20, 60)
    assert d["busy_fraction"] == pytest.approx(0.7) and d["replicas_needed"] == 1
    assert d["merged_forward_share"] == pytest.approx(0.5) and d["merged_row_share"] == pytest.approx(40 / 60)
    assert d["rows_per_forward"] == pytest.approx(3.0) and d["forward_ms"] == pytest.approx(350.0)
    assert d["queue_delay_ms"] == pytest.approx(20.0) and d["round_ms"] == pytest.approx(500.0)
    assert d["draft_share_of_round"] == pytest.approx((0.02 + 0.35) / 0.5)
    busier = draft_delta(before, {**after, "busy_s": 10.0}, 2)
    assert busier["busy_fraction"] == pytest.approx(0.9) and busier["replicas_needed"] == 2
    with pytest.raises(ServiceUnavailableError, match="draft replica changed"):
        draft_delta(before, {**after, "replica": "r2"}, 2)


def test_load_client_keeps_prompt_indices_and_leaves_ids_none_without_the_extension(sse_server):
    """`return_token_ids` against a server that ignores it: nothing to compare, so the greedy check counts those
    responses as unchecked instead of equal."""
    import asyncio

    from s2d_ray.bench.greedy_check import served_outputs
    from s2d_ray.bench.serve import LoadRun, run_load

    run = LoadRun(sse_server, "m", [2], requests=4, max_seconds=20, max_tokens=10, timeout=5, return_token_ids=True)
    result = asyncio.run(run_load(run, ["hello", "world"]))
    rows = result["requests"]["2"]
    assert all(r["ok"] and r["token_ids"] is None for r in rows)
    assert sorted(r["prompt_index"] for r in rows) == [0, 0, 1, 1]
    assert served_outputs(result) == []


def test_each_level_records_what_it_added_to_the_servers_clocks(sse_server):
    """`server` per level: rounds and call times from /stats before and after the level (the stand-in counts a
    round and a call per chunk: 5 per request, 10 with speculate false); the markdown tabulates them."""
    import asyncio

    from s2d_ray.bench.serve import LoadRun, run_load
    from s2d_ray.bench.serve_report import serve_markdown
    from s2d_ray.bench.server_clocks import timing_delta

    run = LoadRun(sse_server, "m", [1, 2], requests=4, max_seconds=20, max_tokens=10, timeout=5, compare_plain=True)
    result = asyncio.run(run_load(run, ["hello"]))
    for level in result["summary"]:
        server = level["server"]
        assert server["rounds"] == level["completed"] * (10 if level["variant"] == "plain" else 5)
        assert server["round_ms"] == pytest.approx(20.0)
        assert server["target"]["calls"] == server["draft"]["calls"] == server["rounds"]
        assert server["target"]["overhead_ms"] == pytest.approx(5.0)
        assert server["target"]["replica_cpu_ms"] == pytest.approx(8.0)
        assert server["draft"]["replica_cpu_ms"] == pytest.approx(4.0)
    assert "| 1 plain | 40 | 1.00 | 20.0 | 40 | 15.0 | 10.0 | 5.0 | 8.0 | 40 | 6.0 | 4.0 | 1.0 |" in \
        serve_markdown(result)
    assert timing_delta(None, {"round": {}}) is None  # a server without clocks: nothing recorded


def test_each_level_shows_where_its_rounds_went_by_kind():
    """The budget's `spent` account (cumulative rounds, seconds, tokens per kind of round) is diffed per level and
    tabulated with ms per token; kinds a level did not run stay out."""
    from s2d_ray.bench.serve_report import serve_markdown
    from s2d_ray.bench.server_clocks import timing_delta

    clocks = lambda rounds, spent: {"round": {"rounds": rounds, "mean_round_ms": 10.0},  # noqa: E731
                                    "speculation": {"spent": spent}}
    before = clocks(10, {"prompt": {"rounds": 2, "seconds": 0.5, "tokens": 2}})
    after = clocks(30, {"prompt": {"rounds": 4, "seconds": 1.0, "tokens": 4},
                        "catch-up": {"rounds": 3, "seconds": 0.6, "tokens": 12, "draft_seconds": 0.25},
                        "tree": {"rounds": 15, "seconds": 0.3, "tokens": 30}})
    d = timing_delta(before, after)
    assert d["spent"] == {"prompt": {"rounds": 2, "seconds": 0.5, "tokens": 2, "draft_seconds": 0},
                          "catch-up": {"rounds": 3, "seconds": pytest.approx(0.6), "tokens": 12, "draft_seconds": 0.25},
                          "tree": {"rounds": 15, "seconds": pytest.approx(0.3), "tokens": 30, "draft_seconds": 0}}
    level = {"concurrency": 8, "variant": "speculative", "completed": 1, "errors": 0, "throughput_tokens_per_s": 1.0,
             "requests_per_s": 1.0, "output_tokens": 46, "error_samples": [], "server": d,
             **{f"{m}_ms_{q}": None for m in ("ttft", "itl", "tpot") for q in ("p50", "p99")}}
    text = serve_markdown({"run": {"url": "u", "model": "m", "max_tokens": 1, "temperature": 0.0, "requests": 1,
                                   "max_seconds": 1.0, "concurrency": [8]}, "summary": [level]})
    assert "| 8 speculative | 2 / 0.50 s (0.00) / 250.0 | - | 3 / 0.60 s (0.25) / 50.0 | 15 / 0.30 s (0.00) / 10.0 | - |" \
        in text
