"""The coordinator dashboard: the view's eval curve, HTTP routes, Prometheus text, and the page in a real
headless Chromium."""

from __future__ import annotations

import concurrent.futures
import html.parser
import json
import logging
import math
import re
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
from chromium import find_chromium, headless, read_png
from prometheus_client.parser import text_string_to_metric_families

from heterorl.coordinator import view as view_module
from heterorl.coordinator.dashboard import DashboardServer, prometheus_text
from heterorl.coordinator.view import SwarmView
from heterorl.protocol.net.node import Record
from heterorl.protocol.wire.messages import pack_stats

# Every metric family /metrics has, as its TYPE line names it.
FAMILIES = {
    "heterorl_peers_alive": "gauge",
    "heterorl_learner_step": "gauge",
    "heterorl_learner_reward": "gauge",
    "heterorl_learner_eval_sampled": "gauge",
    "heterorl_learner_eval_greedy": "gauge",
    "heterorl_batches_accepted_total": "counter",
    "heterorl_batches_rejected_total": "counter",
    "heterorl_checkpoint_version": "gauge",
    "heterorl_peer_tokens_per_second": "gauge",
    "heterorl_staleness_rows": "gauge",
    "heterorl_learner_buffer_batches": "gauge",
    "heterorl_learner_wait_ratio": "gauge",
    "heterorl_learner_trust_held_batches": "gauge",
    "heterorl_learner_trust_banned_authors": "gauge",
    "heterorl_learner_duplicate_batches_total": "counter",
    "heterorl_learner_deferred_batches_total": "counter",
    "heterorl_learner_publish_failures_total": "counter",
    "heterorl_learner_trust_checked_batches_total": "counter",
}
# The learner's heartbeat stats in realistic_view, and the metric each one is exposed as.
LEARNER_STATS = {
    "buffer": ("heterorl_learner_buffer_batches", 5.0),
    "wait_frac": ("heterorl_learner_wait_ratio", 0.125),
    "trust/held": ("heterorl_learner_trust_held_batches", 2.0),
    "trust/banned": ("heterorl_learner_trust_banned_authors", 1.0),
    "duplicates": ("heterorl_learner_duplicate_batches_total", 7.0),
    "deferred": ("heterorl_learner_deferred_batches_total", 11.0),
    "publish_failures": ("heterorl_learner_publish_failures_total", 0.0),
    "trust/checked": ("heterorl_learner_trust_checked_batches_total", 30.0),
}
PLOTS = ("plot-reward", "plot-eval", "plot-staleness", "plot-is", "plot-throughput", "plot-checkpoints")
REWARD_RGB = (0x09, 0x69, 0xDA)  # PALETTE[0] in dashboard.html, the reward line


def realistic_view(now: float | None = None) -> dict:
    """A view shaped like ``SwarmView.snapshot``: a learner, samplers (one dead, one hostile), long curves."""
    now = time.time() if now is None else now

    def peer(key, role, state, version, tps, alive=True, rejected=0, seen=1.5, stats=None):
        return {
            "key": key,
            "role": role,
            "state": state,
            "policy_version": version,
            "tokens_per_s": tps,
            "hardware": "cpu x2, 24 GiB" if role == "sampler" else "H200 x1, 139 GiB",
            "backend": "vllm 0.32.0, float32, cpu" if role == "sampler" else "",
            "peer_id": "12D3KooW" + key,
            "last_seen_s": seen,
            "alive": alive,
            "rejected": rejected,
            "stats": stats or {"batches_sent": 12.0},
        }

    steps = range(1, 37)
    return {
        "run_id": "demo",
        "now": now,
        "coordinator": {
            "peer_id": "12D3KooWcoord",
            "maddrs": [f"/ip4/{ip}/tcp/4001/p2p/12D3KooWcoord" for ip in ("127.0.0.1", "10.0.0.5")],
            "started_at": now - 120,
        },
        "spec": {"model": "runs/tiny-model", "task": "arithmetic", "objective": "gepo"},
        "peers": [
            peer(
                "1ea4e7a0",
                "learner",
                "training",
                9,
                850.0,
                stats={"step": 36.0, "accepted": 140.0, **{k: v for k, (_, v) in LEARNER_STATS.items()}},
            ),
            peer("ab12cd34", "sampler", "generating", 9, 120.5),
            peer("cd34ef56", "sampler", "generating", 8, 64.25),
            peer("77aa88bb", "sampler", "generating", 3, 0.0, alive=False, seen=42.0),
            peer("ef56ab78", "sampler", "generating", 1, 300.0, rejected=3),
        ],
        "checkpoints": [
            {"version": v, "total_size": 560000, "chunks": 1, "seen_at": now - 90 + 10 * v} for v in range(10)
        ],
        "latest_version": 9,
        "learner": {
            "key": "1ea4e7a0" + "5" * 56,  # the full key; a peer's is its first 8 hex digits
            "step": 36,
            "wait_frac": 0.125,
            "version": 9,
            "accepted": 140,
            "rejected": 4,
            "reward_curve": [[s, 0.1 + 0.6 * (1 - math.exp(-s / 12)) + 0.03 * math.sin(s)] for s in steps],
            "ess_curve": [[s, 0.95 - 0.2 * math.exp(-s / 8)] for s in steps],
            "is_var_curve": [[s, 0.02 + 0.01 * math.cos(s / 3)] for s in steps],
            # a held-out evaluation every 6 updates: [step, sampled, greedy]
            "eval_curve": [
                [s, 0.15 + 0.6 * (1 - math.exp(-s / 10)), 0.2 + 0.65 * (1 - math.exp(-s / 9))]
                for s in range(0, 37, 6)
            ],
            "staleness_hist": {"0": 61, "1": 40, "2-3": 25, "4-7": 10, "8-15": 3, "16-63": 1, "1024+": 2},
            "rejected_by_author": {"ef56ab78": 3, "99ff00ee": 1},
        },
        "throughput": {
            "ab12cd34": [[now - 60 + 2 * i, 110 + 10 * math.sin(i / 4)] for i in range(30)],
            "cd34ef56": [[now - 60 + 2 * i, 60 + 5 * math.cos(i / 5)] for i in range(30)],
        },
        "checkpoint_versions": [[now - 90 + 10 * v, v] for v in range(10)],
    }


def edge_view(now: float) -> dict:
    """The start of a run: one checkpoint (version 0), one update, one evaluation, a sampler at 0 tokens/s."""
    return {
        "run_id": "edge",
        "now": now,
        "peers": [],
        "latest_version": 0,
        "learner": {
            "step": 1,
            "reward_curve": [[1, 0.0]],
            "eval_curve": [[0, 0.0, 0.0]],
            "staleness_hist": {"0": 1},
        },
        "throughput": {"ab12cd34": [[now - 4, 0.0], [now - 2, 0.0], [now, 0.0]]},
        "checkpoint_versions": [[now, 0]],
    }


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text -> {(name, labels): value}; asserts each sample's metric has HELP and TYPE first."""
    out, typed, helped = {}, set(), set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line:
            m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
            assert m, line
            name, labels, value = m.groups()
            assert name in typed and name in helped, line
            pairs = re.findall(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"', labels or "")
            unescaped = {k: re.sub(r"\\(.)", lambda c: "\n" if c[1] == "n" else c[1], v) for k, v in pairs}
            out[name, frozenset(unescaped.items())] = float(value)
    return out


def type_lines(text: str) -> dict[str, str]:
    """The metric families' ``# TYPE name type`` lines, as {name: type}; each family once."""
    types = [line.split()[2:] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len({name for name, _ in types}) == len(types), types
    return dict(types)


def sample(metrics: dict, name: str, **labels: str) -> float:
    return metrics[name, frozenset(labels.items())]


@pytest.fixture
def dashboard():
    view = realistic_view()
    state = {"fail": False, "view": view}

    def view_fn() -> dict:
        if state["fail"]:
            raise RuntimeError("view exploded")
        return state["view"]

    server = DashboardServer(view_fn, lambda: prometheus_text(view_fn())).start()
    yield server, state
    server.stop()


# ---- the swarm view's held-out evaluation curve ----

LEARNER_KEY = bytes(range(32))


class Learner:
    """Heartbeats of one learner, as verified DHT records, each newer than the last."""

    def __init__(self) -> None:
        self.t = 1000.0

    def heartbeat(self, step: int, reward: float | None = None, ev: tuple | None = None) -> Record:
        """A heartbeat at learner ``step``; ``ev`` is (eval/step, eval/sampled, eval/greedy), None to omit."""
        self.t += 1.0
        stats: dict[str, float | None] = {"step": step, "accepted": step}
        if reward is not None:
            stats["reward/mean"] = reward
        if ev is not None:
            stats.update(zip(("eval/step", "eval/sampled", "eval/greedy"), ev, strict=True))
        body = {
            "run_id": "demo",
            "role": "learner",
            "state": "training",
            "policy_version": step,
            "tokens_per_s": 100.0,
            "timestamp": self.t,
            "peer_id": "12D3KooWlearner",
            "maddrs": [],
            "hardware": "H200 x1",
            "stats": pack_stats(stats),
        }
        return Record(LEARNER_KEY, "Heartbeat", body, b"", self.t + 60)


def feed(view: SwarmView, *records: Record) -> None:
    for r in records:
        view.apply([r], [], now=r.body["timestamp"])


@pytest.mark.fast
def test_view_eval_points_are_appended_once_per_evaluation():
    view, lr = SwarmView("demo"), Learner()
    feed(view, lr.heartbeat(5, 0.1))  # no evaluation yet
    assert view.eval_curve == []
    feed(view, lr.heartbeat(10, 0.2, (10, 0.3, 0.4)))
    for step in (11, 12, 13):  # the same evaluation, repeated in every heartbeat until the next
        feed(view, lr.heartbeat(step, 0.25, (10, 0.3, 0.4)))
    feed(view, lr.heartbeat(13, None, (10, 0.3, 0.4)))  # a heartbeat that repeats the step and the evaluation
    assert view.eval_curve == [[10, 0.3, 0.4]]
    # an evaluation reported at the step of the last reward point (a heartbeat the reward curve skips) counts
    feed(view, lr.heartbeat(13, 0.25, (13, 0.5, 0.6)))
    feed(view, lr.heartbeat(20, 0.3, (20, 0.55, None)))  # no greedy figure: kept as None
    feed(view, lr.heartbeat(21, 0.3, (21, None, None)))  # no figure at all: no point
    assert view.eval_curve == [[10, 0.3, 0.4], [13, 0.5, 0.6], [20, 0.55, None]]
    assert [p[0] for p in view.reward_curve] == [5, 10, 11, 12, 13, 20, 21]
    snap = view.snapshot()
    assert snap["learner"]["eval_curve"] == view.eval_curve
    m = parse_metrics(prometheus_text(snap))
    assert sample(m, "heterorl_learner_eval_sampled") == 0.55
    assert ("heterorl_learner_eval_greedy", frozenset()) not in m  # the latest evaluation had none


@pytest.mark.fast
def test_view_eval_curve_is_truncated_when_the_learner_restarts_from_an_older_save():
    view, lr = SwarmView("demo"), Learner()
    for s in (10, 20, 30):
        feed(view, lr.heartbeat(s, 0.1 * s / 10, (s, s / 100, s / 50)))
    feed(view, lr.heartbeat(34, 0.35, (30, 0.3, 0.6)))
    # restarted from the step-20 save, no evaluation yet: the evaluations past 20 are of a policy now gone
    feed(view, lr.heartbeat(20, 0.2))
    assert view.eval_curve == [[10, 0.1, 0.2], [20, 0.2, 0.4]]
    assert [p[0] for p in view.reward_curve] == [10, 20]
    feed(view, lr.heartbeat(25, 0.25, (25, 0.27, 0.5)))
    assert view.eval_curve == [[10, 0.1, 0.2], [20, 0.2, 0.4], [25, 0.27, 0.5]]
    # a view that missed the restart (e.g. built fresh) still drops evaluations newer than the one reported
    other, lr2 = SwarmView("demo"), Learner()
    for s in (10, 20, 30):
        feed(other, lr2.heartbeat(s, 0.1, (s, 0.1, 0.1)))
    other.learner = {}
    feed(other, lr2.heartbeat(40, 0.4, (15, 0.15, 0.2)))
    assert other.eval_curve == [[10, 0.1, 0.1], [15, 0.15, 0.2]]


@pytest.mark.fast
def test_view_eval_curve_is_bounded_and_persisted(tmp_path, monkeypatch):
    monkeypatch.setattr(view_module, "MAX_POINTS", 3)
    path = tmp_path / "view.json"
    view, lr = SwarmView("demo", path=path), Learner()
    for s in range(1, 6):
        feed(view, lr.heartbeat(s, 0.1, (s, s / 10, s / 5)))
    assert view.eval_curve == [[3, 0.3, 0.6], [4, 0.4, 0.8], [5, 0.5, 1.0]]
    view.save()
    restored = SwarmView("demo", path=path)
    assert restored.eval_curve == view.eval_curve
    feed(restored, lr.heartbeat(6, 0.1, (5, 0.5, 1.0)))  # the restored view dedupes against its saved points
    assert restored.eval_curve == view.eval_curve
    # a view saved before evaluations existed has no eval_curve: it starts empty
    saved = json.loads(path.read_text())
    del saved["eval_curve"]
    path.write_text(json.dumps(saved))
    assert SwarmView("demo", path=path).eval_curve == []


# ---- HTTP routes ----


def test_routes(dashboard, capfd):
    server, state = dashboard
    assert server.url == f"http://127.0.0.1:{server.port}/" and server.port > 0

    code, headers, body = get(server.url + "api/view")
    assert code == 200 and headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store"
    assert json.loads(body) == state["view"]
    assert get(server.url + "api/view?t=123")[0] == 200

    code, headers, body = get(server.url + "healthz")
    assert code == 200 and body.strip() == b"ok"

    code, headers, body = get(server.url)
    page = body.decode()
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    assert all(f'id="{p}"' in page for p in PLOTS)
    # Offline: nothing loaded from elsewhere (no CDN script, stylesheet, font or image).
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?(https?:)?//""", page)

    for path in ("nope", "api", "api/view/extra", "metrics/x"):
        assert get(server.url + path)[0] == 404, path
    assert capfd.readouterr().err == ""  # the stdlib's per-request stderr lines are silenced


def test_metrics_match_view(dashboard):
    server, state = dashboard
    code, headers, body = get(server.url + "metrics")
    assert code == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    m, v = parse_metrics(body.decode()), state["view"]
    learner = v["learner"]
    assert sample(m, "heterorl_peers_alive", role="sampler") == 3
    assert sample(m, "heterorl_peers_alive", role="learner") == 1
    assert sample(m, "heterorl_learner_step") == 36
    assert sample(m, "heterorl_learner_reward") == pytest.approx(learner["reward_curve"][-1][1], rel=1e-12)
    _, sampled, greedy = learner["eval_curve"][-1]
    assert sample(m, "heterorl_learner_eval_sampled") == pytest.approx(sampled, rel=1e-12)
    assert sample(m, "heterorl_learner_eval_greedy") == pytest.approx(greedy, rel=1e-12)
    assert sample(m, "heterorl_batches_accepted_total") == 140
    assert sample(m, "heterorl_batches_rejected_total") == 4
    assert sample(m, "heterorl_checkpoint_version") == 9
    for p in v["peers"]:
        tps = sample(m, "heterorl_peer_tokens_per_second", peer=p["key"], role=p["role"])
        assert tps == p["tokens_per_s"]
    for bucket, n in learner["staleness_hist"].items():
        assert sample(m, "heterorl_staleness_rows", bucket=bucket) == n
    for name, value in LEARNER_STATS.values():
        assert sample(m, name) == value, name


def test_errors_in_view_give_500_and_server_survives(dashboard, caplog):
    server, state = dashboard
    state["fail"] = True
    with caplog.at_level(logging.ERROR, logger="heterorl.coordinator.dashboard"):
        for path in ("api/view", "metrics"):
            code, _, body = get(server.url + path)
            assert code == 500 and b"RuntimeError" in body and b"exploded" not in body
    assert sum(bool("failed" in r.getMessage() and r.exc_info) for r in caplog.records) == 2
    assert get(server.url + "healthz")[0] == 200
    state["fail"] = False
    assert get(server.url + "api/view")[0] == 200
    assert get(server.url + "metrics")[0] == 200


def test_non_finite_numbers_stay_valid_json(dashboard):
    server, state = dashboard
    state["view"] = {**state["view"], "learner": {"reward_curve": [[1, float("nan")], [2, float("inf")]]}}
    code, _, body = get(server.url + "api/view")

    def reject(name: str) -> None:
        raise AssertionError(f"non-JSON constant {name}")

    assert code == 200
    assert json.loads(body, parse_constant=reject)["learner"]["reward_curve"] == [[1, None], [2, None]]


def test_stop_is_idempotent_and_closes_the_port():
    server = DashboardServer(dict, str).start()
    url = server.url
    assert get(url + "api/view")[2] == b"{}"
    server.stop()
    server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "healthz", timeout=2)
    with pytest.raises(RuntimeError):
        server.start()


# ---- prometheus_text ----


def test_prometheus_label_escaping():
    nasty = 'a"b\\c\nd'
    text = prometheus_text({"peers": [{"key": nasty, "role": "sampler", "tokens_per_s": 1.5, "alive": True}]})
    assert 'heterorl_peer_tokens_per_second{peer="a\\"b\\\\c\\nd",role="sampler"} 1.5' in text.splitlines()
    assert "\nd" not in text.replace("\\n", "")  # no raw newline leaks into a sample line
    assert sample(parse_metrics(text), "heterorl_peer_tokens_per_second", peer=nasty, role="sampler") == 1.5


def test_prometheus_missing_and_odd_values():
    text = prometheus_text({})  # an empty view: HELP/TYPE lines, zero alive peers, no other samples
    m = parse_metrics(text)
    assert m == {
        ("heterorl_peers_alive", frozenset({("role", "learner")})): 0,
        ("heterorl_peers_alive", frozenset({("role", "sampler")})): 0,
    }
    assert type_lines(text) == FAMILIES and text.endswith("\n")

    view = {
        "latest_version": 4,
        "learner": {"step": None, "reward_curve": [[3, float("nan")]], "accepted": True, "rejected": "x"},
        "peers": [
            {"key": "k", "role": "sampler", "tokens_per_s": float("inf"), "alive": True},
            {"key": "j", "role": "sampler", "tokens_per_s": -float("inf"), "alive": False},
            {"key": "h", "role": "sampler", "tokens_per_s": 10**400, "alive": False},  # beyond a float
        ],
    }
    text = prometheus_text(view)
    lines = text.splitlines()
    assert "heterorl_learner_reward NaN" in lines  # NaN and infinities as Prometheus spells them
    assert 'heterorl_peer_tokens_per_second{peer="k",role="sampler"} +Inf' in lines
    assert 'heterorl_peer_tokens_per_second{peer="j",role="sampler"} -Inf' in lines
    assert 'heterorl_peer_tokens_per_second{peer="h",role="sampler"} +Inf' in lines
    m = parse_metrics(text)
    assert sample(m, "heterorl_checkpoint_version") == 4  # falls back to latest_version
    assert sample(m, "heterorl_batches_accepted_total") == 1  # a bool counts as 0/1
    assert sample(m, "heterorl_peers_alive", role="sampler") == 1
    skipped = ("heterorl_learner_step", "heterorl_batches_rejected_total")  # None and "x": no sample
    assert not [k for k in m if k[0] in skipped]
    assert not any(line.startswith(skipped) for line in lines)
    from_list = parse_metrics(prometheus_text({"checkpoints": [{"version": 7}, {"version": 2}, "x"]}))
    assert sample(from_list, "heterorl_checkpoint_version") == 7
    # an evaluation without a greedy figure, and malformed eval curves, give no sample rather than an error
    only_sampled = parse_metrics(prometheus_text({"learner": {"eval_curve": [[4, 0.5, None]]}}))
    assert sample(only_sampled, "heterorl_learner_eval_sampled") == 0.5
    assert ("heterorl_learner_eval_greedy", frozenset()) not in only_sampled
    for odd in ([], [[4]], "x", [None], [[4, "a", "b"]], [[4, 0.5, 0.6], "x"], {"a": 1}):
        m = parse_metrics(prometheus_text({"learner": {"eval_curve": odd}}))
        assert not [k for k in m if k[0].startswith("heterorl_learner_eval_")], odd
    # odd shapes elsewhere: no error, no sample
    odd_view = {"learner": "x", "peers": ["x", None, {"role": "sampler"}], "checkpoints": {"version": 3}}
    assert parse_metrics(prometheus_text(odd_view)) == {
        ("heterorl_peers_alive", frozenset({("role", "learner")})): 0,
        ("heterorl_peers_alive", frozenset({("role", "sampler")})): 0,
    }


def test_prometheus_learner_stats_come_from_the_learners_heartbeat():
    view = realistic_view()
    m = parse_metrics(prometheus_text(view))
    for name, value in LEARNER_STATS.values():
        assert sample(m, name) == value, name
    # another learner (an old identity) with other figures: the view's learner is matched by key prefix
    other = {"key": "0badf00d", "role": "learner", "alive": False, "stats": {"buffer": 99.0, "deferred": 1.0}}
    m = parse_metrics(prometheus_text({**view, "peers": [other, *view["peers"]]}))
    assert sample(m, "heterorl_learner_buffer_batches") == 5.0
    assert sample(m, "heterorl_learner_deferred_batches_total") == 11.0
    # a sampler with the learner's key prefix is no learner; a second learner with it makes it ambiguous
    learner_metrics = {name for name, _ in LEARNER_STATS.values()}
    twin = {**other, "key": "1ea4e7a0", "role": "sampler"}
    m = parse_metrics(prometheus_text({**view, "peers": [twin, *view["peers"]]}))
    assert sample(m, "heterorl_learner_buffer_batches") == 5.0
    m = parse_metrics(prometheus_text({**view, "peers": [{**twin, "role": "learner"}, *view["peers"]]}))
    assert {k[0] for k in m if k[0] in learner_metrics} == {"heterorl_learner_wait_ratio"}
    # the heartbeat is fresher than the view's learner dict (which the view skips updating on some heartbeats)
    learner = {**view["learner"], "wait_frac": 0.9}
    assert sample(
        parse_metrics(prometheus_text({**view, "learner": learner})), "heterorl_learner_wait_ratio"
    ) == (0.125)
    # no heartbeat entry for the learner: only what its dict holds (wait_frac), nothing else
    alone = parse_metrics(prometheus_text({**view, "peers": [other]}))
    assert {k[0] for k in alone if k[0] in learner_metrics} == {"heterorl_learner_wait_ratio"}
    assert sample(alone, "heterorl_learner_wait_ratio") == 0.125
    # a learner dict without a key matches no peer; stats that are not numbers, or not a dict, give no sample
    keyless = {k: v for k, v in view["learner"].items() if k not in ("key", "wait_frac")}
    assert not {
        k for k in parse_metrics(prometheus_text({**view, "learner": keyless})) if k[0] in learner_metrics
    }
    for stats in ({"buffer": "5", "duplicates": None, "trust/held": [1]}, "x", None):
        peers = [{**p, "stats": stats} if p["role"] == "learner" else p for p in view["peers"]]
        m = parse_metrics(prometheus_text({**view, "peers": peers}))
        assert {k[0] for k in m if k[0] in learner_metrics} == {"heterorl_learner_wait_ratio"}, stats


def test_prometheus_text_parses_with_the_client_parser():
    view = realistic_view()
    text = prometheus_text(view)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # the parser names a counter family without "_total"; its samples keep it
    names = {n.removesuffix("_total") if t == "counter" else n: t for n, t in FAMILIES.items()}
    assert {n: f.type for n, f in families.items()} == names  # ours only: no process_*, python_gc_*, ...
    assert all(f.documentation for f in families.values())
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families.values() for s in f.samples}
    assert samples == parse_metrics(text)
    learner = view["learner"]
    assert samples["heterorl_batches_accepted_total", frozenset()] == learner["accepted"]
    assert [(s.labels, s.value) for s in families["heterorl_staleness_rows"].samples] == [
        ({"bucket": b}, n) for b, n in learner["staleness_hist"].items()
    ]
    tps = {s.labels["peer"]: s.value for s in families["heterorl_peer_tokens_per_second"].samples}
    assert tps == {p["key"]: p["tokens_per_s"] for p in view["peers"]}
    assert samples["heterorl_learner_eval_greedy", frozenset()] == learner["eval_curve"][-1][2]
    for name, value in LEARNER_STATS.values():
        assert samples[name, frozenset()] == value, name
    # a nasty label value survives the round trip
    nasty = 'a"b\\c\nd}{,=é'
    text = prometheus_text({"peers": [{"key": nasty, "role": "sampler", "tokens_per_s": 2.5}]})
    (s,) = next(
        f for f in text_string_to_metric_families(text) if f.name == "heterorl_peer_tokens_per_second"
    ).samples
    assert s.labels == {"peer": nasty, "role": "sampler"} and s.value == 2.5


# ---- the page in a real browser ----


class DomProbe(html.parser.HTMLParser):
    """Collects canvas attributes, the #error banner and the rows of the peers table from a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.canvases: dict[str, dict[str, str | None]] = {}
        self.rows: list[dict] = []
        self.error: dict | None = None
        self._in_peers = self._in_error = False
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "canvas":
            self.canvases[a.get("id", "")] = a
        elif tag == "table" and a.get("id") == "peers":
            self._in_peers = True
        elif tag == "tr" and self._in_peers:
            self.rows.append({"class": (a.get("class") or "").split(), "key": a.get("data-key"), "cells": []})
        elif tag in ("td", "th") and self._in_peers:
            self._cell = []
        elif tag == "div" and a.get("id") == "error":
            self.error, self._in_error = {"attrs": a, "text": ""}, True

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_peers = False
        elif tag in ("td", "th") and self._cell is not None:
            self.rows[-1]["cells"].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "div":
            self._in_error = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._in_error and self.error is not None:
            self.error["text"] += data


def probe(dom: str) -> DomProbe:
    p = DomProbe()
    p.feed(dom)
    return p


@pytest.fixture(scope="module")
def browser() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium: no chromium or chrome on PATH (`make install` installs one where it can)")
    return path


@pytest.fixture(scope="module")
def rendered(browser, tmp_path_factory):
    """The page rendered by headless Chromium: the full view (DOM and screenshot), an empty view (DOM) and the
    start of a run, with one-point and all-zero series (DOM)."""
    view = realistic_view()
    edge = edge_view(time.time())
    full = DashboardServer(lambda: view, lambda: prometheus_text(view)).start()
    empty = DashboardServer(dict, str).start()
    start = DashboardServer(lambda: edge, lambda: prometheus_text(edge)).start()
    shot = tmp_path_factory.mktemp("shot") / "dashboard.png"
    t0 = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            jobs = [
                pool.submit(headless, browser, full.url, "--dump-dom"),
                pool.submit(headless, browser, full.url, f"--screenshot={shot}"),
                pool.submit(headless, browser, empty.url, "--dump-dom"),
                pool.submit(headless, browser, start.url, "--dump-dom"),
            ]
            dom, _, empty_dom, edge_dom = (j.result() for j in jobs)
    finally:
        full.stop()
        empty.stop()
        start.stop()
    logging.getLogger(__name__).info("chromium: %.1f s for four headless runs", time.monotonic() - t0)
    return {
        "view": view,
        "dom": probe(dom),
        "empty": probe(empty_dom),
        "edge_view": edge,
        "edge": probe(edge_dom),
        "shot": shot,
    }


def test_browser_draws_every_plot(rendered):
    dom, view = rendered["dom"], rendered["view"]
    assert dom.error is not None and "hidden" in dom.error["attrs"] and not dom.error["text"].strip()
    points = {p: int(dom.canvases[p].get("data-points") or 0) for p in PLOTS}
    learner = view["learner"]
    assert points == {
        "plot-reward": len(learner["reward_curve"]),
        "plot-eval": 2 * len(learner["eval_curve"]),  # sampled and greedy
        "plot-staleness": len(learner["staleness_hist"]),
        "plot-is": len(learner["ess_curve"]) + len(learner["is_var_curve"]),
        "plot-throughput": sum(len(s) for s in view["throughput"].values()),
        "plot-checkpoints": len(view["checkpoint_versions"]),
    }


def test_browser_peers_table(rendered):
    dom, view = rendered["dom"], rendered["view"]
    body = [r for r in dom.rows if r["key"] is not None]
    by_key = {r["key"]: r for r in body}
    assert [r["key"] for r in body[: len(view["peers"])]] == [p["key"] for p in view["peers"]]
    for p in view["peers"]:
        cells = by_key[p["key"]]["cells"]
        assert cells[:3] == [p["key"], p["role"], p["state"]]
        assert cells[6] == (p["backend"] or "–")  # the sampler's rollout engine (a learner has none)
        assert cells[8] == ("alive" if p["alive"] else "dead")
    assert "hostile" in by_key["ef56ab78"]["class"] and by_key["ef56ab78"]["cells"][9] == "3"
    assert "dead" in by_key["77aa88bb"]["class"] and "hostile" not in by_key["77aa88bb"]["class"]
    assert "hostile" not in by_key["ab12cd34"]["class"]
    # A rejected author that sends no heartbeat still gets a (red) row.
    assert "hostile" in by_key["99ff00ee"]["class"] and by_key["99ff00ee"]["cells"][2] == "no heartbeat"


def test_browser_screenshot_shows_the_reward_curve(rendered):
    left, top, width, height = map(int, rendered["dom"].canvases["plot-reward"]["data-box"].split(","))
    assert width > 200 and height > 100
    w, h, channels, rows = read_png(rendered["shot"], max_rows=top + height)
    assert (w, h) == (1400, 1800) and top + height <= h and left + width <= w
    pixels = Counter()
    for row in rows[top : top + height]:
        for x in range(left, left + width):
            pixels[row[x * channels : x * channels + 3]] += 1
    total = width * height
    background, n_background = pixels.most_common(1)[0]
    assert len(pixels) > 20, "the reward canvas is (nearly) one colour"
    assert total - n_background > 0.02 * total  # axes, grid, labels and the curve cover a visible share
    near_line = sum(
        n for rgb, n in pixels.items() if max(abs(a - b) for a, b in zip(rgb, REWARD_RGB, strict=True)) < 24
    )
    assert near_line > 300, "no reward-line pixels in the reward canvas"


def test_browser_empty_view_waits_for_data(rendered):
    dom = rendered["empty"]
    assert dom.error is not None and "hidden" in dom.error["attrs"], dom.error
    for p in PLOTS:
        assert "data-points" not in dom.canvases[p] and dom.canvases[p].get("data-state") == "waiting"
    assert [r["cells"] for r in dom.rows[1:]] == [["no peers yet"]]


def axis_of(canvas: dict, name: str) -> tuple[float, float, list[str]]:
    """A drawn plot's ``name`` ("x" or "y") axis as the page exposes it: (lo, hi, tick labels)."""
    lo, hi = map(float, canvas[f"data-{name}-range"].split(","))
    return lo, hi, canvas[f"data-{name}-ticks"].split("|")


def test_browser_eval_plot_beside_the_reward_plot(rendered):
    dom, learner = rendered["dom"], rendered["view"]["learner"]
    reward, ev = dom.canvases["plot-reward"], dom.canvases["plot-eval"]
    assert ev.get("data-state") == "drawn"
    # beside the training reward: same row, to its right
    rl, rt, rw, rh = map(int, reward["data-box"].split(","))
    el, et, ew, eh = map(int, ev["data-box"].split(","))
    assert et == rt and el >= rl + rw and (ew, eh) == (rw, rh)
    lo, hi, ticks = axis_of(ev, "x")
    steps = [p[0] for p in learner["eval_curve"]]
    assert lo <= min(steps) and hi >= max(steps) and len(ticks) >= 3 and all(t.isdigit() for t in ticks)
    lo, hi, _ = axis_of(ev, "y")
    values = [v for p in learner["eval_curve"] for v in p[1:]]
    assert lo <= min(values) and hi >= max(values) and hi - lo < 2


def test_browser_one_point_axes_have_a_sane_span(rendered):
    canvases, edge = rendered["edge"].canvases, rendered["edge_view"]
    assert rendered["edge"].error is not None and not rendered["edge"].error["text"].strip()
    # the checkpoint-version plot at the start of a run: one point on a time axis spans a minute, not hours
    checkpoints = canvases["plot-checkpoints"]
    assert checkpoints.get("data-points") == "1"
    lo, hi, ticks = axis_of(checkpoints, "x")
    ((t, _),) = edge["checkpoint_versions"]
    assert lo < t < hi and hi - lo == pytest.approx(60, abs=1e-3)
    assert len(ticks) >= 2 and all(re.fullmatch(r"\d\d:\d\d:\d\d", tick) for tick in ticks), ticks
    # one point on a step axis: one step either side; with a step axis that starts at 0, no negative step
    lo, hi, ticks = axis_of(canvases["plot-reward"], "x")
    assert (lo, hi) == (0, 2) and ticks == ["0", "1", "2"]
    lo, hi, ticks = axis_of(canvases["plot-eval"], "x")
    assert (lo, hi) == (0, 1) and ticks == ["0", "1"]


def test_browser_all_zero_series_get_a_non_negative_axis(rendered):
    canvases = rendered["edge"].canvases
    # version 0, reward 0, evaluation 0 and 0 tokens/s: each y axis runs from 0 to 1, not from -1 to 1
    for plot in ("plot-checkpoints", "plot-reward", "plot-eval", "plot-throughput"):
        lo, hi, ticks = axis_of(canvases[plot], "y")
        assert (lo, hi) == (0, 1), plot
        assert ticks[0] == "0" and ticks[-1] in ("1", "1.0"), plot
        assert not any(t.startswith("-") for t in ticks), plot
    # the checkpoint versions are whole numbers: their axis has no fractional ticks
    assert axis_of(canvases["plot-checkpoints"], "y")[2] == ["0", "1"]
