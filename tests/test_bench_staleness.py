"""heterorl bench staleness: figures, kept shares and table from known runs, its plots, a real tiny grid."""

from __future__ import annotations

import json

import pytest

from heterorl.bench import staleness


def _run(objective, delay, seed, final, curve=(0.2,) * 30, var=0.1):
    return {
        "objective": objective,
        "delay": delay,
        "seed": seed,
        "final_eval": final,
        "final_eval_greedy": min(1.0, final + 0.1),
        "eval_curve": [[0, 0.1, 0.2], [10, final, final + 0.1]],
        "reward_curve": list(curve),
        "is_var_curve": [var] * len(curve),
    }


def test_figures_take_the_held_out_eval_and_the_last_rollout_rewards():
    curve = [1.0] * 10 + [0.0] * 10 + [0.5] * 20  # the rollout reward: the last 20 updates only
    f = staleness.figures(_run("gepo", 0, 0, 0.8, curve, var=0.25))
    assert f["eval"] == 0.8 and f["greedy"] == pytest.approx(0.9)
    assert f["rollout"] == pytest.approx(0.5) and f["is_var"] == pytest.approx(0.25)


def test_kept_is_the_mean_over_seeds_against_the_same_objectives_delay_0():
    runs = [
        _run("gepo", 0, 0, 0.8),
        _run("gepo", 0, 1, 0.6),
        _run("gepo", 256, 0, 0.7),
        _run("gepo", 256, 1, 0.63),
        _run("grpo", 0, 0, 0.5),
        _run("grpo", 256, 0, 0.25),
        _run("cispo", 256, 0, 0.4),  # no delay-0 baseline: no share
    ]
    k = staleness.kept(runs)
    assert k[("gepo", 256)] == pytest.approx(0.665 / 0.7)
    assert k[("grpo", 256)] == pytest.approx(0.5) and k[("gepo", 0)] == pytest.approx(1.0)
    assert ("cispo", 256) not in k
    assert staleness.verdict(runs) == "held-out eval kept at delay 256: default gepo 95.0%, best gepo 95.0%"


def test_table_orders_by_delay_then_objective_and_labels_the_lagging_reward():
    runs = [
        _run("grpo", 8, 0, 0.2),
        _run("gepo", 8, 0, 0.4),
        _run("gepo", 8, 1, 0.6),
        _run("gepo", 0, 0, 0.5),
    ]
    md = staleness.table(runs)
    assert "lags by the delay" in md.splitlines()[0]
    rows = md.splitlines()[2:]
    assert [r.split(" | ")[0:2] for r in rows] == [["| gepo", "0"], ["| gepo", "8"], ["| grpo", "8"]]
    assert "| 50.0 ± 10.0 | 100.0% |" in rows[1] and rows[1].endswith("| 2 |")  # mean ± spread of 2 seeds
    assert "| grpo | 8 | 20.0 ± 0.0 | - |" in rows[2]  # grpo has no delay-0 run here


def test_plots_are_written(tmp_path):
    runs = [_run(o, d, 0, 0.5 - d / 1000) for o in ("gepo", "grpo", "m2po") for d in (0, 8, 256)]
    for p in staleness.plots(runs, tmp_path):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_every_objective_of_the_zoo_is_on_the_grid():
    from heterorl.peer import objectives

    assert set(objectives.names()) <= {loss for loss, _ in staleness.VARIANTS.values()}
    assert staleness.DEFAULT_OBJECTIVE == objectives.DEFAULT_OBJECTIVE
    from heterorl.peer.train import one_process

    assert staleness.FINAL_EVALS == one_process.FINAL_EVALS  # final_eval means the same in both
    assert set(staleness.QUICK_VARIANTS) <= set(staleness.VARIANTS) and 256 in staleness.QUICK["delays"]


def test_a_tiny_real_grid_writes_results_and_resumes(tmp_path, tiny_model_dir, capsys):
    argv = ["--delays", "0", "4", "--seeds", "0", "--steps", "6", "--prompts", "2", "--eval-every", "3"]
    argv += [
        "--objectives",
        "gepo",
        "gspo",
        "--workers",
        "2",
        "--model",
        str(tiny_model_dir),
        "--out",
        str(tmp_path),
    ]
    assert staleness.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    runs = data["runs"]
    assert data["default_objective"] == "gepo"
    assert {(r["objective"], r["delay"]) for r in runs} == {
        ("gepo", 0),
        ("gepo", 4),
        ("gspo", 0),
        ("gspo", 4),
    }
    for r in runs:
        assert len(r["reward_curve"]) == 6 and [e[0] for e in r["eval_curve"]] == [0, 3, 6]
        assert 0.0 < r["final_eval"] < 1.0  # the exact expected reward of a real policy
        assert r["final_eval"] == pytest.approx(sum(e[1] for e in r["eval_curve"]) / 3)
    first = (tmp_path / "runs" / "gepo-d4-s0" / "summary.json").stat().st_mtime
    assert staleness.main(argv) == 0  # a second call reuses the finished runs
    assert (tmp_path / "runs" / "gepo-d4-s0" / "summary.json").stat().st_mtime == first
    table = (tmp_path / "table.md").read_text()
    assert "| gepo | 4 |" in table and "held-out eval kept at delay 4: default gepo" in table


@pytest.mark.parametrize(
    "argv",
    [["--variant", "no-equals-sign"], ["--variant", "x=gepo:{not json"], ["--objectives", "nope"]],
)
def test_bad_variants_and_objectives_are_refused_before_any_run(argv, tmp_path, capsys):
    assert staleness.main([*argv, "--out", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().out and not (tmp_path / "runs").exists()
