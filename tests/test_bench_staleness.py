"""heterorl bench staleness: its figures and table from known curves, its plots, and one real tiny run."""

from __future__ import annotations

import json

import pytest

from heterorl.bench import staleness


def _run(objective, defensive, delay, seed, curve, var=0.1):
    return {
        "objective": objective,
        "defensive_sampling": defensive,
        "delay": delay,
        "seed": seed,
        "reward_curve": curve,
        "is_var_curve": [var] * len(curve),
    }


def test_best_last_gap_use_full_smoothing_windows():
    curve = [1.0] + [0.0] * 9 + [0.5] * 20 + [0.2] * 10  # a lucky first sample must not be the best
    f = staleness.figures(_run("gepo", True, 0, 0, curve, var=0.25))
    assert f["best"] == pytest.approx(0.5) and f["last"] == pytest.approx(0.2)
    assert f["gap"] == pytest.approx(0.3) and f["is_var"] == pytest.approx(0.25)


def test_table_groups_seeds_and_orders_by_delay_then_objective():
    runs = [
        _run("grpo", False, 8, 0, [0.2] * 20),
        _run("gepo", True, 8, 0, [0.4] * 20),
        _run("gepo", True, 8, 1, [0.6] * 20),
        _run("gepo", False, 0, 0, [0.3] * 20),
    ]
    rows = staleness.table(runs).splitlines()[2:]
    assert [r.split(" | ")[0:2] for r in rows] == [["| gepo-nods", "0"], ["| gepo", "8"], ["| grpo", "8"]]
    assert "50.0 ± 10.0" in rows[1] and rows[1].endswith("| 2 |")  # mean ± spread over the two seeds


def test_plots_are_written(tmp_path):
    runs = [
        _run(o, d, delay, 0, [0.1 * (i % 7) for i in range(30)])
        for o, d in staleness.VARIANTS[:3]
        for delay in (0, 8)
    ]
    for p in staleness.plots(runs, tmp_path):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_a_tiny_real_grid_writes_results_and_resumes(tmp_path, tiny_model_dir, capsys):
    argv = [
        "--delays",
        "0",
        "4",
        "--seeds",
        "0",
        "--steps",
        "6",
        "--prompts",
        "2",
        "--objectives",
        "gepo",
        "gspo",
        "--model",
        str(tiny_model_dir),
        "--out",
        str(tmp_path),
    ]
    assert staleness.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {(r["objective"], r["delay"]) for r in results} == {
        ("gepo", 0),
        ("gepo", 4),
        ("gspo", 0),
        ("gspo", 4),
    }
    assert all(
        len(r["reward_curve"]) == 6 and r["defensive_sampling"] == (r["objective"] == "gepo") for r in results
    )
    first = (tmp_path / "runs" / "gepo-d4-s0" / "summary.json").stat().st_mtime
    assert staleness.main(argv) == 0  # a second call reuses the finished runs
    assert (tmp_path / "runs" / "gepo-d4-s0" / "summary.json").stat().st_mtime == first
    assert "| gepo | 4 |" in (tmp_path / "table.md").read_text()
