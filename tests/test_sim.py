"""`heterorl simulate`: the discrete-event model keeps its books and reacts to the run's settings."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import subprocess
import sys

import pytest

from heterorl.protocol.settings import LineageSettings
from heterorl.protocol.wire.checkpoint import CHUNK_BYTES
from heterorl.sim.config import SimConfig
from heterorl.sim.engine import Simulation, spread_samplers
from heterorl.sim.fleet import DEFAULT_FLEET, HardwareClass, draw_peers, load_fleet
from heterorl.sim.wire import chunk_lengths, manifest_bytes, synthetic_manifest, trajectory_batch_bytes

FAST = HardwareClass("fast", 1.0, 4000, 1000, 1000, 20, math.inf, 1.0)
SLOW_LINK = HardwareClass("slowlink", 1.0, 4000, 20, 20, 40, math.inf, 1.0)
CHURNY = HardwareClass("churny", 1.0, 2000, 500, 100, 30, 0.05, 0.02)
CPU = HardwareClass("cpu", 1.0, 400, 100, 20, 50, math.inf, 1.0)  # learner peers short of data


def _sim(fleet=(FAST,), **kw) -> Simulation:
    cfg = SimConfig(
        **{"samplers": 10, "hours": 0.3, "warmup_h": 0.0, "ramp_s": 30, "model_bytes": 50_000_000, **kw}
    )
    chunks = chunk_lengths(synthetic_manifest(cfg.model_bytes))
    batch = trajectory_batch_bytes(cfg.prompts_per_batch, cfg.group_size, 20, 40)
    return Simulation(cfg, fleet, batch, chunks)


def _books_balance(sim: Simulation, r: dict) -> None:
    """Each generated batch is accepted, refused or still queued; each accepted one is trained or waits."""
    c = r["counts"]
    queued = sum(len(s.outbox) for s in sim.samplers)
    assert c["batches_generated"] == c.get("batches_accepted", 0) + c.get("batches_refused_stale", 0) + queued
    per_update = sim.cfg.prompts_per_update // sim.cfg.prompts_per_batch
    held = sum(len(ln.buffer) + len(ln.in_update) for ln in sim.learners)
    assert c.get("batches_accepted", 0) == sim.parts * per_update + held  # parts: updates, one per learner
    assert sum(sim.stale.values()) == sim.parts * per_update


@pytest.mark.fast
def test_wire_sizes_come_from_real_messages():
    small = trajectory_batch_bytes(1, 8, 50, 100)
    double = trajectory_batch_bytes(2, 8, 50, 100)
    longer = trajectory_batch_bytes(1, 8, 50, 200)
    assert 1.9 < double / small < 2.05 and longer > 1.6 * small
    m = synthetic_manifest(10 * CHUNK_BYTES + 123)
    sizes = chunk_lengths(m)
    assert len(sizes) == 11 and sum(sizes) == m["total_size"] and sizes[-1] == 123
    assert manifest_bytes(m) > 11 * 32


@pytest.mark.fast
def test_fleet_is_drawn_by_share_and_bad_files_are_refused(tmp_path):
    peers = draw_peers(DEFAULT_FLEET, 4000, random.Random(0))
    share = sum(p.cls.name == "rtx4090" for p in peers) / len(peers)
    assert abs(share - 0.35) < 0.03
    f = tmp_path / "fleet.json"
    f.write_text(
        json.dumps(
            [
                {
                    "name": "x",
                    "share": 1,
                    "tokens_per_s": 10,
                    "down_mbit": 1,
                    "up_mbit": 1,
                    "rtt_ms": 5,
                    "session_h": "inf",
                    "offline_h": 1,
                }
            ]
        )
    )
    assert load_fleet(f)[0].session_h == math.inf
    f.write_text(
        json.dumps(
            [
                {
                    "name": "x",
                    "share": 1,
                    "tokens_per_s": 0,
                    "down_mbit": 1,
                    "up_mbit": 1,
                    "rtt_ms": 5,
                    "session_h": 1,
                    "offline_h": 1,
                }
            ]
        )
    )
    with pytest.raises(ValueError, match="tokens_per_s"):
        load_fleet(f)
    f.write_text(json.dumps([{"name": "x", "speed": 3}]))
    with pytest.raises(ValueError, match="class 0"):
        load_fleet(f)


@pytest.mark.fast
def test_an_oversupplied_learner_trains_all_the_time_and_keeps_its_books():
    sim = _sim(samplers=30)
    r = sim.run()
    assert r["learner"]["training"] + r["learner"]["publishing"] > 0.95
    assert r["counts"]["busy_replies"] > 0 and r["counts"]["updates"] > 50
    _books_balance(sim, r)


@pytest.mark.fast
def test_an_undersupplied_learner_mostly_waits_and_sees_fresh_data():
    sim = _sim(fleet=(HardwareClass("cpu", 1.0, 40, 100, 20, 50, math.inf, 1.0),), samplers=2)
    r = sim.run()
    assert r["learner"]["waiting"] > 0.8
    assert r["staleness"]["buckets"]["0"] + r["staleness"]["buckets"]["1"] > 0.5
    _books_balance(sim, r)


@pytest.mark.fast
def test_max_staleness_refuses_old_batches():
    free = _sim(samplers=40).run()
    capped_sim = _sim(samplers=40, max_staleness=2)
    capped = capped_sim.run()
    assert capped["counts"]["batches_refused_stale"] > 0
    assert capped["staleness"]["mean"] < free["staleness"]["mean"]
    _books_balance(capped_sim, capped)


@pytest.mark.fast
def test_slow_links_block_on_checkpoints_unless_fetching_in_background():
    blocking = _sim(fleet=(SLOW_LINK,), samplers=4).run()
    background = _sim(fleet=(SLOW_LINK,), samplers=4, background_fetch=True).run()
    assert blocking["sampler_time"].get("fetching", 0) > 0.5
    assert background["counts"]["batches_generated"] > 2 * blocking["counts"]["batches_generated"]
    # a smaller delta (fewer changed chunks) means fewer bytes per sampler
    delta = _sim(fleet=(SLOW_LINK,), samplers=4, changed_frac=0.05).run()
    assert delta["sampler_GB_per_h"]["down_median"] < blocking["sampler_GB_per_h"]["down_median"]


@pytest.mark.fast
def test_churn_loses_generations_but_no_queued_batch():
    sim = _sim(fleet=(CHURNY,), samplers=20, hours=0.5)
    r = sim.run()
    assert r["counts"]["generations_lost_to_churn"] > 0
    assert r["sampler_time"]["offline"] > 0.05
    _books_balance(sim, r)


@pytest.mark.fast
def test_a_buffer_smaller_than_an_update_is_refused():
    with pytest.raises(ValueError, match="never fill an update"):
        SimConfig(prompts_per_update=64, prompts_per_batch=2, buffer_batches=16)


@pytest.mark.fast
def test_same_seed_same_run():
    a, b = _sim(seed=3).run(), _sim(seed=3).run()
    assert a["staleness"] == b["staleness"] and a["counts"] == b["counts"]


def test_cli_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "sim.json"
    cmd = [sys.executable, "-m", "heterorl.cli", "simulate", "--samplers", "5", "20", "--hours", "0.2"]
    cmd += ["--warmup-h", "0.05", "--model-bytes", "1e8", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 5 |" in done.stdout and "| 20 |" in done.stdout
    results = json.loads(out.read_text())
    assert [r["config"]["samplers"] for r in results] == [5, 20]
    bad = subprocess.run(
        cmd[:-2] + ["--fleet", str(tmp_path / "missing.json")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "error" in bad.stdout


@pytest.mark.fast
def test_one_learner_has_no_exchange_and_ignores_the_learner_link():
    r = _sim(samplers=30).run()
    same = _sim(samplers=30, learner_link_bytes_per_s=1.0, learner_rtt_s=9.0).run()
    assert r["counts"] == same["counts"] and r["staleness"] == same["staleness"]
    # nor the exchange's settings: no codec, no overlap
    for kw in ({"exchange": "dense"}, {"codec_s_per_gb": 100.0, "exchange_ratio": 1.0, "overlap": True}):
        other = _sim(samplers=30, **kw).run()
        assert other["counts"] == r["counts"] and other["staleness"] == r["staleness"]
        assert (
            other["learner"] == r["learner"]
            and other["learners"]["per_learner"] == r["learners"]["per_learner"]
        )
    lr = r["learners"]
    assert lr["count"] == 1 and lr["updates_per_version"] == 1.0
    assert lr["exchange_bytes_per_version"] == 0 and lr["rounds"]["exchanging"] == 0
    assert lr["per_learner"][0]["in_round_waiting"] == 0 and lr["per_learner"][0]["samplers"] == 30
    assert lr["per_learner"][0]["computing"] == pytest.approx(r["learner"]["training"])
    assert r["trajectories_per_s"] == pytest.approx(lr["per_learner"][0]["rows_per_s"])
    with pytest.raises(ValueError, match="learners must lie in"):
        SimConfig(learners=0)
    with pytest.raises(ValueError, match="learners must lie in"):
        SimConfig(learners=65)


@pytest.mark.fast
def test_samplers_spread_over_learners_by_rendezvous_hashing():
    from heterorl.protocol.net.trajectories import LearnerAddress, rendezvous_order

    spread = spread_samplers(1000, 4)
    assert spread == spread_samplers(1000, 4) and spread_samplers(7, 1) == [0] * 7
    assert all(200 <= spread.count(j) <= 300 for j in range(4))
    learners = [LearnerAddress(j.to_bytes(32, "big"), f"l{j}", ()) for j in range(4)]
    assert rendezvous_order((5).to_bytes(32, "big"), learners)[0].key[-1] == spread[5]
    # a sampler keeps its learner when another one joins, unless the new one comes first for it
    five = spread_samplers(1000, 5)
    assert all(b in (a, 4) for a, b in zip(spread, five, strict=True))


@pytest.mark.fast
def test_learner_peers_train_more_rows_when_the_learner_is_the_bottleneck():
    one_sim = _sim(samplers=30)
    one = one_sim.run()
    two_sim = _sim(samplers=30, learners=2, exchange="dense", overlap=False)
    two = two_sim.run()
    assert one["learner"]["training"] + one["learner"]["publishing"] > 0.95  # the learner is the limit
    # each version trains on both learners' updates; a round costs one update plus a 0.2 s exchange
    assert two["learners"]["updates_per_version"] > 1.9
    assert two["trajectories_per_s"] > 1.5 * one["trajectories_per_s"]
    assert two["updates_per_h"] < one["updates_per_h"]  # versions come slower: each waits for the exchange
    per = two["learners"]["per_learner"]
    assert all(x["samplers"] > 5 for x in per) and sum(x["samplers"] for x in per) == 30
    # each computes 40-45 % of the time, waits 5 % in a round (the slower one, the exchange), and pauses
    # while the writer publishes (3 s after every 2.6 s update): the rest
    for x in per:
        assert 0.4 < x["computing"] < 0.47 and 0.03 < x["in_round_waiting"] < 0.07
        assert x["computing"] + x["in_round_waiting"] + two["learner"]["publishing"] <= 1 + 1e-9
    assert sum(x["rows_per_s"] for x in per) == pytest.approx(two["trajectories_per_s"])
    _books_balance(one_sim, one)
    _books_balance(two_sim, two)
    # through a slow writer's link (a 100 MB gradient, three times, at 20 MB/s: 15 s a version) two learners
    # train fewer rows per second than one
    slow = _sim(samplers=30, learners=2, learner_link_bytes_per_s=2e7, exchange="dense", overlap=False).run()
    assert slow["trajectories_per_s"] < one["trajectories_per_s"]
    assert slow["learners"]["rounds"]["exchanging"] > 0.6


@pytest.mark.fast
def test_the_writer_moves_three_model_sized_frames_per_member_and_version():
    for n in (2, 3):
        sim = _sim(samplers=30, learners=n, warmup_h=0.05, exchange="dense")
        r = sim.run()
        lr, g = r["learners"], sim.cfg.gradient_bytes
        assert g == 2 * sim.cfg.model_bytes  # float32, 4 bytes a parameter of a bf16 checkpoint
        # every learner has an update in every round: (N - 1) gradients in, (N - 1) updates and combined
        # gradients out
        assert lr["updates_per_version"] == n
        assert lr["exchange_bytes_per_version"] == 3 * (n - 1) * g
        assert lr["exchange_s_per_version"] == pytest.approx(3 * (n - 1) * g / 1.25e9 + 0.05)
    # short of data, a member without an update sends nothing but still gets the commit
    sim = _sim(fleet=(CPU,), samplers=6, learners=3, exchange="dense")
    r = sim.run()
    lr, g, versions = r["learners"], sim.cfg.gradient_bytes, r["counts"]["updates"]
    members = sum(ln.parts for ln in sim.learners[1:])
    assert r["learner"]["waiting"] > 0.3 and lr["updates_per_version"] < 2.5
    assert lr["exchange_bytes_per_version"] * versions == (versions * 4 + members) * g
    assert 4 * g <= lr["exchange_bytes_per_version"] < 6 * g
    _books_balance(sim, r)


@pytest.mark.fast
def test_the_sparse_exchange_moves_compressed_parts_and_pays_the_codec():
    for n in (2, 3):
        sim = _sim(samplers=30, learners=n, warmup_h=0.05, overlap=False, exchange="sparse")
        r = sim.run()
        cfg, lr, g = sim.cfg, r["learners"], sim.cfg.gradient_bytes
        assert lr["exchange"] == "sparse" and lr["overlap"] is False
        p = cfg.part_bytes
        assert p == round(0.0039 * g)
        # every learner has an update in every round: N - 1 parts in, the commit (one part's size) out to
        # each of the N - 1 members
        assert lr["updates_per_version"] == n
        assert lr["exchange_bytes_per_version"] == 2 * (n - 1) * p
        assert lr["exchange_bytes_per_version"] == pytest.approx(2 * (n - 1) * 0.0039 * g, rel=1e-6)
        codec = 2 * 0.05 * g / 1e9  # two encode + decode pairs of the gradient
        assert lr["exchange_s_per_version"] == pytest.approx(codec + 2 * (n - 1) * p / 1.25e9 + 0.05)
    # short of data, a member without an update sends nothing but still gets the commit
    sim = _sim(fleet=(CPU,), samplers=6, learners=3, exchange="sparse")
    r = sim.run()
    lr, p, versions = r["learners"], sim.cfg.part_bytes, r["counts"]["updates"]
    members = sum(ln.parts for ln in sim.learners[1:])
    assert lr["updates_per_version"] < 2.5 and members < 2 * versions
    assert lr["exchange_bytes_per_version"] * versions == (versions * 2 + members) * p
    _books_balance(sim, r)
    # the formulas, member by member: (n + N - 1) parts sparse, (n + 2 (N - 1)) gradients dense
    sparse = SimConfig(
        learners=4, exchange="sparse", exchange_ratio=0.01, codec_s_per_gb=2.0, learner_link_bytes_per_s=1e8
    )
    dense = dataclasses.replace(sparse, exchange="dense")
    g, p = sparse.gradient_bytes, sparse.part_bytes
    assert p == round(0.01 * g) and sparse.codec_s == pytest.approx(4.0 * g / 1e9) and dense.codec_s == 0
    for n in range(4):
        assert sparse.exchange_bytes(n) == (n + 3) * p and dense.exchange_bytes(n) == (n + 6) * g
        assert sparse.exchange_s(n) == pytest.approx(4.0 * g / 1e9 + n * p / 1e8 + 3 * p / 1e8 + 0.05)
        assert dense.exchange_s(n) == pytest.approx((n + 6) * g / 1e8 + 0.05)
    one = dataclasses.replace(sparse, learners=1)
    assert one.exchange_bytes(0) == 0 and one.exchange_s(0) == 0


@pytest.mark.fast
def test_overlap_hides_the_exchange_behind_the_next_update():
    # an exchange about as long as an update: 2.4 s of codec (a 0.1 GB gradient at 12 s/GB, twice) and 2.6 s
    kw = dict(samplers=30, learners=2, codec_s_per_gb=12.0, publish_every=10, exchange="sparse")
    serial_sim, overlap_sim = _sim(overlap=False, **kw), _sim(overlap=True, **kw)
    serial, overlap = serial_sim.run(), overlap_sim.run()
    assert overlap["learners"]["overlap"] is True and serial["learners"]["overlap"] is False
    assert overlap["updates_per_h"] > 1.6 * serial["updates_per_h"]
    assert overlap["trajectories_per_s"] > 1.6 * serial["trajectories_per_s"]
    # the same exchange per version, no longer in the learners' way: they compute while it runs
    ls, lo = serial["learners"], overlap["learners"]
    assert lo["updates_per_version"] == pytest.approx(ls["updates_per_version"], abs=0.02)
    assert lo["exchange_s_per_version"] == pytest.approx(ls["exchange_s_per_version"], rel=1e-3)
    assert lo["rounds"]["computing"] + lo["rounds"]["exchanging"] > 1.5
    for s, o in zip(ls["per_learner"], lo["per_learner"], strict=True):
        assert o["computing"] > 1.6 * s["computing"] and o["in_round_waiting"] < 0.5 * s["in_round_waiting"]
    _books_balance(serial_sim, serial)
    _books_balance(overlap_sim, overlap)  # rows trained and rows waiting in a round or a buffer
    # an exchange longer than an update sets the pace: one in flight, a version per exchange at most
    slow = _sim(overlap=True, **{**kw, "codec_s_per_gb": 40.0}).run()
    bound = 3600 / slow["learners"]["exchange_s_per_version"]
    assert 0.85 * bound < slow["updates_per_h"] <= bound
    assert slow["learners"]["rounds"]["exchanging"] > 0.9


@pytest.mark.fast
def test_bad_exchange_settings_are_refused():
    with pytest.raises(ValueError, match='exchange must be "dense" or "sparse"'):
        SimConfig(exchange="topk")
    for r in (0.0, -0.1, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"exchange_ratio must lie in \(0, 1\]"):
            SimConfig(exchange_ratio=r)
    for c in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="codec_s_per_gb must be a number >= 0"):
            SimConfig(codec_s_per_gb=c)
    assert SimConfig(exchange_ratio=1.0, codec_s_per_gb=0.0).codec_s == 0
    # the command line: argparse knows the modes; the sparse exchange's settings are refused with dense
    from heterorl.sim.cli import _config, add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    argv = ["--exchange", "sparse", "--exchange-ratio", "0.01", "--codec-s-per-gb", "4.2", "--overlap"]
    cfg = _config(ap.parse_args(argv), 10, 2)
    assert (cfg.exchange, cfg.exchange_ratio, cfg.codec_s_per_gb, cfg.overlap) == ("sparse", 0.01, 4.2, True)
    assert _config(ap.parse_args([]), 10, 2).exchange == LineageSettings().exchange == "sparse"  # the run's
    assert _config(ap.parse_args([]), 10, 2).overlap is True  # the daemon's default
    assert _config(ap.parse_args(["--no-overlap"]), 10, 2).overlap is False
    with pytest.raises(ValueError, match=r"exchange_ratio must lie in \(0, 1\]"):
        _config(ap.parse_args(["--exchange", "sparse", "--exchange-ratio", "0"]), 10, 2)
    with pytest.raises(ValueError, match="not with dense"):
        _config(ap.parse_args(["--exchange", "dense", "--codec-s-per-gb", "1"]), 10, 2)
    with pytest.raises(SystemExit):
        ap.parse_args(["--exchange", "topk"])


def test_cli_learners_table(tmp_path):
    out = tmp_path / "sim.json"
    cmd = [sys.executable, "-m", "heterorl.cli", "simulate", "--samplers", "12", "--learners", "1", "2"]
    cmd += [
        "--hours",
        "0.1",
        "--warmup-h",
        "0.02",
        "--model-bytes",
        "1e8",
        "--exchange",
        "sparse",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| samplers | learners | versions/h | rows trained/s | exchange | overlap |" in done.stdout
    assert "| 12 | 2 |" in done.stdout and "12 samplers, 2 learners (" in done.stdout
    assert "| sparse | yes |" in done.stdout and "learner peers: sparse exchange" in done.stdout
    results = json.loads(out.read_text())
    assert [r["config"]["learners"] for r in results] == [1, 2]
    assert results[1]["learners"]["exchange"] == "sparse" and results[1]["learners"]["overlap"] is True
    bad = subprocess.run(cmd[:-2] + ["--learners", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "learners must lie in" in bad.stdout


def _bench_json(tmp_path, models: dict):
    f = tmp_path / "w.json"
    f.write_text(json.dumps({"models": models}))
    return f


@pytest.mark.fast
def test_delta_ratio_is_a_number_or_read_from_bench_weights_json(tmp_path):
    from heterorl.sim.cli import delta_ratio

    assert delta_ratio("0.005") == (0.005, "given")
    f = _bench_json(
        tmp_path,
        {
            "tiny": {"delta_ratio": 0.31, "bit_identical": True, "lr": 5e-4},
            "smollm2-135m": {"delta_ratio": 0.004, "bit_identical": True, "lr": 1e-6},
        },
    )
    r, src = delta_ratio(str(f))  # default: the model named *smol*
    assert r == 0.004 and "smollm2-135m" in src and "1e-06" in src
    assert delta_ratio(f"{f}:tiny")[0] == 0.31
    with pytest.raises(ValueError, match="no model 'big'; models: smollm2-135m, tiny"):
        delta_ratio(f"{f}:big")
    only_tiny = _bench_json(tmp_path, {"tiny": {"delta_ratio": 0.31}, "other": {"delta_ratio": 0.2}})
    with pytest.raises(ValueError, match=r"no model named \*smol\*.*other, tiny"):
        delta_ratio(str(only_tiny))
    with pytest.raises(ValueError, match="no numeric delta_ratio"):
        delta_ratio(f"{_bench_json(tmp_path, {'smol': {'delta_ratio': None}})}")
    with pytest.raises(ValueError, match="must lie in"):
        delta_ratio("1.5")
    with pytest.raises(ValueError, match="not a number"):
        delta_ratio(str(tmp_path / "missing.json"))
    bad = _bench_json(tmp_path, {"smol": {"delta_ratio": 0.01, "bit_identical": False}})
    assert "WARNING" in delta_ratio(str(bad))[1]


@pytest.mark.fast
def test_a_delta_chain_costs_its_deltas_until_the_full_checkpoint_is_cheaper():
    sim = _sim(delta_ratio=0.01)
    full = sum(sim.chunk_sizes)
    assert sim._fetch_bytes(None, 7) == full  # a newcomer holds nothing
    assert sim._fetch_bytes(6, 7) == int(0.01 * sim.cfg.model_bytes)  # the parent held: one delta
    assert sim._fetch_bytes(2, 7) == int(5 * 0.01 * sim.cfg.model_bytes)  # five versions behind: five deltas
    assert sim._fetch_bytes(7 - 150, 7) == full  # 150 deltas would cost more than the full checkpoint
    # a version published every 4 updates carries 4 updates' deltas
    assert _sim(delta_ratio=0.01, publish_every=4)._fetch_bytes(4, 8) == int(4 * 0.01 * sim.cfg.model_bytes)
    # a run offering deltas against only the 4 versions before: 5 behind fetches in full
    bases = _sim(delta_ratio=0.01, delta_bases=4)
    assert bases._fetch_bytes(3, 7) < full and bases._fetch_bytes(2, 7) == full
    with pytest.raises(ValueError, match="give one"):
        SimConfig(delta_ratio=0.01, changed_frac=0.5)
    # small deltas free a slow link: far fewer bytes and far less time fetching than full checkpoints
    slow_full = _sim(fleet=(SLOW_LINK,), samplers=4).run()
    slow_delta = _sim(fleet=(SLOW_LINK,), samplers=4, delta_ratio=0.005).run()
    assert slow_delta["sampler_GB_per_h"]["down_median"] < 0.2 * slow_full["sampler_GB_per_h"]["down_median"]
    assert slow_delta["sampler_time"]["fetching"] < 0.5 * slow_full["sampler_time"]["fetching"]
    assert slow_delta["counts"]["fetched_delta"] > 0


@pytest.mark.fast
def test_the_stop_rule_bounds_staleness_and_counts_paused_time():
    # slow links, no churn, one batch in flight: with background fetch and no stop rule samplers keep
    # generating with a version far behind; with --max-lag they pause until the fetch caught them up
    kw = dict(fleet=(SLOW_LINK,), samplers=6, hours=0.5, churn=False, background_fetch=True, max_pending=1)
    free_sim = _sim(max_lag=-1, busy_pause=False, **kw)
    free = free_sim.run()
    capped_sim = _sim(max_lag=3, **kw)
    capped = capped_sim.run()
    # no batch starts more than max_lag versions behind the newest published one
    assert capped["generation_lag"]["max"] <= 3 < free["generation_lag"]["max"]
    assert capped["generation_lag"]["mean"] < free["generation_lag"]["mean"]
    # the learner's view adds time in outboxes ("busy" backoff) and its buffer: lower, not capped
    assert capped["staleness"]["p99"] < free["staleness"]["p99"]
    assert capped["staleness"]["max"] < free["staleness"]["max"]
    assert capped["sampler_time"]["paused (behind)"] > 0.2
    assert "paused (behind)" not in free["sampler_time"]
    _books_balance(capped_sim, capped)
    _books_balance(free_sim, free)
    # an oversupplied learner says "busy": the stop rule waits for the retry time instead of generating
    busy = _sim(samplers=30, background_fetch=True).run()
    assert busy["sampler_time"]["paused (busy)"] > 0.1
    assert (
        busy["counts"]["batches_generated"]
        < _sim(samplers=30, background_fetch=True, busy_pause=False).run()["counts"]["batches_generated"]
    )


def test_cli_delta_ratio_from_json_and_exclusive_options(tmp_path):
    f = _bench_json(tmp_path, {"smollm2-135m": {"delta_ratio": 0.004, "bit_identical": True, "lr": 1e-6}})
    base = [sys.executable, "-m", "heterorl.cli", "simulate", "--samplers", "5", "--hours", "0.1"]
    base += ["--warmup-h", "0.02", "--model-bytes", "1e8"]
    done = subprocess.run(
        base + ["--delta-ratio", str(f), "--background-fetch"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0.004 of the checkpoint per update (smollm2-135m at lr 1e-06" in done.stdout
    assert "stop rule max_lag 4" in done.stdout and "| 5 |" in done.stdout
    both = subprocess.run(
        base + ["--delta-ratio", "0.01", "--changed-frac", "0.1"], capture_output=True, text=True
    )
    assert both.returncode == 2 and "not allowed with" in both.stderr
    missing = subprocess.run(base + ["--delta-ratio", f"{f}:big"], capture_output=True, text=True)
    assert missing.returncode == 2 and "no model 'big'; models: smollm2-135m" in missing.stdout
    lag = subprocess.run(base + ["--max-lag", "4"], capture_output=True, text=True)
    assert lag.returncode == 2 and "--background-fetch" in lag.stdout
