"""The swarm's pure parts: run.toml, the learner's buffer, batch tensors, staleness buckets, saved state."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from heterorl.peer.learner.buffer import Buffered, TrajectoryBuffer
from heterorl.peer.learner.rows import rows_from_bodies
from heterorl.peer.learner.state import load_state, save_state
from heterorl.protocol.settings import EXAMPLE, RunSettings, load_run_config, parse_run_config
from heterorl.protocol.wire.staleness import staleness_bucket

pytestmark = pytest.mark.fast  # in `make test-fast`

KEY = "ab" * 32


def test_example_config_parses_and_round_trips_through_the_runspec(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(EXAMPLE.replace("<64 hex chars>", KEY))
    cfg = load_run_config(path)
    assert (cfg.run_id, cfg.objective.name, cfg.learner.group_size) == ("my-run", "gepo", 8)
    body = cfg.runspec_body(b"\x01" * 32, 40)
    settings = RunSettings.from_spec(body)
    assert settings.as_run() == cfg.as_run()
    assert settings.learner_keys == (bytes.fromhex(KEY),) and settings.task.params == {"digits": 1}
    assert settings.objective.lr == cfg.objective.lr and settings.sampling.max_new_tokens == 6


@pytest.mark.parametrize(
    "data, match",
    [
        ({"learner_keys": []}, "learner_keys is empty"),
        ({"learner_keys": ["abcd"]}, "not 64 hex"),
        ({"learner_keys": [KEY], "objective": {"name": "nope"}}, "nope"),
        ({"learner_keys": [KEY], "learner": {"batch": 3}}, "unknown setting"),
        ({"learner_keys": [KEY], "colour": "red"}, r"unknown setting\(s\) colour"),
        ({"learner_keys": [KEY], "learner": {"group_size": 0}}, "group_size"),
        # 8 batches of 2 groups can never hold a 32-group update: the learner would wait forever
        (
            {"learner_keys": [KEY], "learner": {"prompts_per_update": 32, "buffer_batches": 8}},
            "buffer_batches >= 16",
        ),
    ],
)
def test_bad_configs_say_what_is_wrong(data, match):
    with pytest.raises(ValueError, match=match):
        parse_run_config(data)


def test_a_run_id_is_made_when_none_is_given():
    a, b = parse_run_config({"learner_keys": [KEY]}), parse_run_config({"learner_keys": [KEY]})
    assert a.run_id.startswith("run-") and a.run_id != b.run_id


def _body(groups: int, version: int, rows_per_group: int = 2, tokens: int = 3) -> dict:
    rows = [
        {
            "group": g,
            "prompt_ids": [1, 2 + g],
            "completion_ids": list(range(5, 5 + tokens - (i % 2))),
            "logprobs": [-0.5] * (tokens - (i % 2)),
            "reward": float(i % 2),
        }
        for g in range(groups)
        for i in range(rows_per_group)
    ]
    return {"batch_id": bytes([version, groups]) * 8, "policy_version": version, "rows": rows}


def test_buffer_hands_out_whole_batches_by_groups_and_waits():
    buf = TrajectoryBuffer(capacity=3)
    assert buf.take_groups(2, timeout=0.01) is None
    for v in range(3):
        buf.put(Buffered(bytes([v]) * 16, b"a", _body(1, v), time.time()))
    assert not buf.has_room()
    got = buf.take_groups(2, timeout=0.01)
    assert [b.body["policy_version"] for b in got] == [0, 1] and len(buf) == 1
    threading.Timer(0.05, lambda: buf.put(Buffered(b"x" * 16, b"a", _body(2, 7), time.time()))).start()
    got = buf.take_groups(3, timeout=5)
    assert [b.body["policy_version"] for b in got] == [2, 7]


def test_rows_from_bodies_pads_and_keeps_groups_apart():
    rows = rows_from_bodies([_body(2, 4), _body(1, 6)], pad_id=0)
    assert rows.completions.shape == (6, 3) and rows.mask.sum().item() == 3 + 2 + 3 + 2 + 3 + 2
    assert rows.group_ids.tolist() == [0, 0, 1, 1, 2, 2]  # group 0 of the second batch is a new group
    assert rows.versions.tolist() == [4, 4, 4, 4, 6, 6]
    assert rows.logq[1, 2].item() == 0.0 and rows.completions[1, 2].item() == 0  # padding
    assert rows.rewards.tolist() == [0.0, 1.0] * 3


@pytest.mark.parametrize(
    "delta, bucket",
    [(-1, "0"), (0, "0"), (1, "1"), (2, "2-3"), (3, "2-3"), (7, "4-7"), (15, "8-15"), (16, "16-63"),
     (64, "64-255"), (255, "64-255"), (256, "256-1023"), (1023, "256-1023"), (1024, "1024+"),
     (10**6, "1024+")],
)  # fmt: skip
def test_staleness_buckets(delta, bucket):
    assert staleness_bucket(delta) == bucket


def test_saved_state_restores_model_optimizer_and_step(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save_state(tmp_path, model.state_dict(), opt.state_dict(), 7, {"run_id": "r"})
    save_state(tmp_path, model.state_dict(), opt.state_dict(), 8, {"run_id": "r"})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000008"]
    other = torch.nn.Linear(4, 3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    meta = load_state(tmp_path, other, other_opt)
    assert meta == {"run_id": "r", "step": 8}
    assert torch.equal(other.weight, model.weight)
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert load_state(tmp_path / "none", other, other_opt) is None


def test_stale_daemon_sockets_are_swept_live_and_young_ones_kept(tmp_path):
    import os
    import socket

    from heterorl.protocol.net.node import sweep_stale_sockets

    def bound(name: str, listen: bool) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(tmp_path / name))
        if listen:
            s.listen()
        return s

    live = bound("hivemind-p2pd-live.sock", listen=True)
    bound("hivemind-p2pd-dead.sock", listen=False).close()
    bound("hivemind-p2pclient-young.sock", listen=False).close()
    old = time.time() - 600
    for name in ("hivemind-p2pd-live.sock", "hivemind-p2pd-dead.sock"):
        os.utime(tmp_path / name, (old, old))
    assert sweep_stale_sockets(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hivemind-p2pclient-young.sock",
        "hivemind-p2pd-live.sock",
    ]
    live.close()


def test_a_runspec_signed_by_another_key_is_refused_when_one_is_pinned():
    from heterorl.protocol import ProtocolError
    from heterorl.protocol.net.spec import check_run_key

    check_run_key(b"a" * 32, None)  # trust on first use
    check_run_key(b"a" * 32, b"a" * 32)
    with pytest.raises(ProtocolError, match="pins run key"):
        check_run_key(b"b" * 32, b"a" * 32)


def test_runspec_hyperparameters_that_are_not_understood_are_refused():
    body = parse_run_config({"learner_keys": [KEY]}).runspec_body(b"\x01" * 32, 40)
    bad_values = ('{"format": 2, "learner": 3}', '{"format": 2, "learner": {"group_size": 0}}')
    for bad in ("not json", "[2]", *bad_values):
        with pytest.raises(ValueError, match="hyperparameters not understood"):
            RunSettings.from_spec({**body, "hyperparameters": bad})


def test_a_metrics_line_a_kill_cut_short_counts_as_after_any_save(tmp_path):
    from heterorl.protocol.storage.jsonlog import drop_rows_after

    path = tmp_path / "metrics.jsonl"
    for torn in ('{"step": 8, "ti', "", '{"time": 1.0}', "[1, 2]"):
        path.write_text('{"step": 7, "time": 1.0}\n' + torn + "\n")
        assert drop_rows_after(path, "step", 10**9) == 1  # dropped with the updates a restart redoes
        assert path.read_text() == '{"step": 7, "time": 1.0}\n'


def test_at_least_sums_the_bands_from_a_start():
    from heterorl.protocol.wire.staleness import STALENESS_BUCKETS, at_least

    hist = {b: 1.0 for b in STALENESS_BUCKETS}
    assert at_least(hist, 16) == 4 and at_least(hist, 0) == len(STALENESS_BUCKETS)
    assert at_least(hist, 1024) == 1 and at_least({"0": 3}, 16) == 0
