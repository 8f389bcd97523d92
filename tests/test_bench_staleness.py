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
    assert staleness.verdict(runs) == (
        "held-out eval kept at delay 256: default gepo 95.0%, best gepo 95.0%; its area under the held-out "
        "curve 95.6% of delay 0's, its mean score over the budget 38.2% (best gepo 38.2%)"
    )  # (0.40 + 0.365) / 2 over (0.45 + 0.35) / 2: trapezoids of 0.1 -> final; grpo's mean is 0.175


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
    for r in runs:  # every run takes the longest delay + --steps updates: 4 + 6
        assert r["steps"] == 10 and len(r["reward_curve"]) == 10
        assert [e[0] for e in r["eval_curve"]] == [0, 3, 6, 9, 10]
        assert 0.0 < r["final_eval"] < 1.0  # the exact expected reward of a real policy
        assert r["final_eval"] == pytest.approx(sum(e[1] for e in r["eval_curve"]) / 5)
    pairs = {(r["objective"], r["delay"]) for r in runs}
    assert {(g["objective"], g["delay"]) for g in data["groups"]} == pairs
    assert all(g["budget"] == 10 and g["area"] > 0 for g in data["groups"])
    first = (tmp_path / "runs" / "gepo-d4-s0" / "summary.json").stat().st_mtime
    assert staleness.main(argv) == 0  # a second call reuses the finished runs
    assert (tmp_path / "runs" / "gepo-d4-s0" / "summary.json").stat().st_mtime == first
    table = (tmp_path / "table.md").read_text()
    assert "| gepo | 4 |" in table and "held-out eval kept at delay 4: default gepo" in table


@pytest.mark.parametrize(
    "argv",
    [
        ["--variant", "no-equals-sign"],
        ["--variant", "x=gepo:{not json"],
        ["--objectives", "nope"],
        ["--delays", "0", "-1"],
        ["--steps", "0"],
    ],
)
def test_bad_variants_and_objectives_are_refused_before_any_run(argv, tmp_path, capsys):
    assert staleness.main([*argv, "--out", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().out and not (tmp_path / "runs").exists()


def test_curves_reduce_to_final_area_and_updates_to_a_target_within_a_budget():
    from heterorl.bench.staleness_curves import area, final_at, updates_to

    curve = [[0, 0.0, 0.0], [10, 0.5, 0.6], [20, 1.0, 1.0], [30, 1.0, 1.0]]
    assert final_at(curve, 30, n=2) == pytest.approx(1.0) and final_at(curve, 15, n=2) == pytest.approx(0.25)
    assert final_at(curve, -1) is None
    assert area(curve, 20) == pytest.approx((2.5 + 7.5) / 20)  # two trapezoids over 20 updates
    assert area(curve, 25) == pytest.approx((2.5 + 7.5 + 5.0) / 25)  # held at 1.0 past the last point
    assert area([[0, 0.3, 0.3]], 10) is None
    assert updates_to(curve, 0.5, 30) == 10 and updates_to(curve, 0.9, 15) is None


def test_a_delay_is_set_against_delay_0_over_its_own_budget():
    """Delay 0 ran 3 000 updates, delay 1 024 its 2 224: kept, area and updates to 90 % cut delay 0's curve
    at 2 224; a seed that never reaches 90 % shows as "> budget"."""
    assert [staleness.budget(d, [0, 512, 1024], 1200) for d in (0, 512, 1024)] == [2224, 1712, 2224]
    fresh = [[u, min(1.0, u / 1000), 0.0] for u in range(0, 3001, 100)]  # 1.0 from update 1 000
    late = [[u, min(0.95, max(0.0, (u - 1024) / 500)), 0.0] for u in range(0, 2225, 100)]
    never = [[u, 0.5, 0.0] for u in range(0, 2225, 100)]

    def run(delay, seed, curve, steps):
        return {"objective": "gepo", "delay": delay, "seed": seed, "steps": steps, "eval_curve": curve,
                "final_eval": final(curve), "reward_curve": [0.5], "is_var_curve": [0.1]}  # fmt: skip

    def final(curve):
        return sum(p[1] for p in curve[-5:]) / 5

    runs = [run(0, 0, fresh, 3000), run(1024, 0, late, 2224), run(1024, 1, late, 2224)]
    fast = staleness.speed(runs)[("gepo", 1024)]
    assert staleness.kept(runs)[("gepo", 1024)] == pytest.approx(0.95)
    assert fast["budget"] == 2224 and fast["reached"] == 2 and fast["to_90"] == 1500  # 0.9 at 1 474 -> 1 500
    from heterorl.bench.staleness_curves import area

    assert fast["area"] == pytest.approx(area(late, 2224) / area(fresh, 2224))
    assert fast["mean"] == pytest.approx(area(late, 2224))
    row = next(r for r in staleness.table(runs).splitlines() if r.startswith("| gepo | 1024 |"))
    assert f"| {100 * area(late, 2224):.1f} |" in row
    runs[2] = run(1024, 1, never, 2224)
    fast = staleness.speed(runs)[("gepo", 1024)]
    assert fast["to_90"] is None and fast["reached"] == 1
    row = next(r for r in staleness.table(runs).splitlines() if r.startswith("| gepo | 1024 |"))
    assert "> 2224 (1 seeds reached it)" in row
    groups = staleness.summary(runs)
    assert [(g["delay"], g["kept"] is not None) for g in groups] == [(0, True), (1024, True)]


def test_quick_with_delays_runs_the_default_objective_alone(tmp_path, monkeypatch):
    """--quick alone keeps its three objectives at [0, 256]; with --delays it runs the default at those."""
    import argparse

    seen = {}

    class Stop(Exception):
        pass

    def fake_pool(*a, **k):
        raise Stop

    monkeypatch.setattr(staleness, "ProcessPoolExecutor", fake_pool)
    monkeypatch.setattr("heterorl.peer.model.ensure_model", lambda path, seed: tmp_path)
    for argv, labels, delays in (
        (["--quick"], list(staleness.QUICK_VARIANTS), [0, 256]),
        (["--quick", "--delays", "1024", "0", "512"], [staleness.DEFAULT_OBJECTIVE], [0, 512, 1024]),
    ):
        ap = argparse.ArgumentParser()
        staleness.add_arguments(ap)
        args = ap.parse_args([*argv, "--out", str(tmp_path / "o")])
        with pytest.raises(Stop):
            staleness.run_from_args(args)
        seen[tuple(argv)] = (args.delays, args.seeds)
        assert args.delays == delays and args.seeds == [0, 1]
        assert sorted(args.objectives or labels) == sorted(labels)
