"""`s2d bench exits`: a deeper exit wins exactly when its agreement is worth its layers against the verification, the
agreement it needs to tie is the inverse of the speed model, and the committed profiles give one table per machine."""

from __future__ import annotations

import json

import pytest

from s2d_ray.cli import main
from s2d_ray.bench.exits import agreement_to_reach, best_k, cpu_tables, exit_rows
from s2d_ray.fleet.model import mat


def flat(n: int) -> float:
    """A target whose verification of n positions costs what one step costs (memory-bound)."""
    return 10.0


def test_speed_is_mat_over_round_cost():
    k, speed = best_k(0.6, 1.0, flat)
    assert speed == pytest.approx(max(mat(0.6, j) * 10 / (j * 1.0 + 10) for j in range(1, 13)))
    assert mat(0.6, k) * 10 / (k + 10) == pytest.approx(speed)


def test_deeper_exit_pays_only_where_its_layers_are_cheap():
    agree = [0.50, 0.56]
    cheap = exit_rows(agree, [0.2, 0.4], flat)  # draft tokens 2-4% of a target step (a 70B target)
    dear = exit_rows(agree, [1.0, 3.0], flat)  # 10-30% (a small target on a CPU)
    assert [r["best"] for r in cheap] == [False, True]
    assert [r["best"] for r in dear] == [True, False]
    # negative control: with no agreement gain the deeper exit never pays, however cheap
    assert [r["best"] for r in exit_rows([0.5, 0.5], [0.2, 0.21], flat)] == [True, False]


def test_agreement_to_tie_is_where_the_deeper_exit_reaches_the_best():
    rows = exit_rows([0.50, 0.56], [1.0, 3.0], flat)
    need = rows[1]["agree_to_tie"]
    assert need > 0.56  # it does not pay at its agreement
    assert best_k(need, 3.0, flat)[1] == pytest.approx(rows[0]["speedup"], rel=1e-3)
    assert best_k(need - 0.01, 3.0, flat)[1] < rows[0]["speedup"]
    assert agreement_to_reach(100.0, 3.0, flat) is None  # no agreement below 1 gets there


def test_committed_profiles_give_one_best_exit_per_machine():
    tables = cpu_tables()
    assert len({t["machine"] for t in tables}) >= 2  # the profiles carry several machines' costs
    for t in tables:
        assert [e["layer"] for e in t["exits"]] == [2, 4, 6]
        assert sum(e["best"] for e in t["exits"]) == 1
        assert all(0 < e["draft_to_verify"] < 1 for e in t["exits"])


def test_cli_writes_cpu_and_gpu_rows(tmp_path, capsys):
    assert main(["bench", "exits", "--devices", "h100", "--out", str(tmp_path)]) == 0
    tables = json.loads((tmp_path / "exits.json").read_text())["tables"]
    gpu = [t for t in tables if "fleet model" in t["machine"]]
    assert {t["target"] for t in gpu} == {"vicuna-7b-v1.5", "vicuna-13b-v1.5", "llama-2-70b-chat"}
    assert "| exit |" in capsys.readouterr().out
    assert main(["bench", "exits", "--profiles", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--profiles" in err  # one line naming the flag

