"""A run's learner keys: several train one lineage (the lowest writes); a list naming a key twice is refused
by the coordinator (run.toml, or a stored RunSpec from before) and by a peer joining it."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from heterorl.peer.daemon.hardware import Hardware
from heterorl.peer.daemon.runtime import PeerRuntime
from heterorl.protocol import encode, load_or_create_identity
from heterorl.protocol.net.join import Joined
from heterorl.protocol.settings import RunConfig, RunSettings, load_run_config, parse_run_config

pytestmark = pytest.mark.fast

KEYS = ["ab" * 32, "cd" * 32]
REFUSED = "learner_keys lists a key twice"
TWICE = [KEYS[0], KEYS[0]]


def _twice_spec() -> dict:
    body = RunConfig(run_id="two", learner_keys=(KEYS[0],)).runspec_body(b"\x01" * 32, 40)
    return {**body, "learner_keys": [bytes.fromhex(k) for k in TWICE]}


def test_several_learner_keys_make_one_run_and_a_key_twice_is_refused(tmp_path):
    assert parse_run_config({"learner_keys": KEYS}).learner_keys == tuple(KEYS)
    body = RunConfig(run_id="two", learner_keys=tuple(KEYS)).runspec_body(b"\x01" * 32, 40)
    assert RunSettings.from_spec(body).learner_keys == tuple(bytes.fromhex(k) for k in KEYS)
    with pytest.raises(ValueError, match=REFUSED):
        parse_run_config({"learner_keys": TWICE})
    path = tmp_path / "run.toml"
    path.write_text(f'run_id = "two"\nlearner_keys = ["{KEYS[0]}", "{KEYS[0]}"]\n')
    with pytest.raises(ValueError, match=f"run.toml: {REFUSED}"):
        load_run_config(path)


def _coordinator(state_dir, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "heterorl", "coordinator", "--state-dir", str(state_dir), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_the_coordinator_will_not_sign_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f'run_id = "two"\nlearner_keys = ["{KEYS[0]}", "{KEYS[0]}"]\n')
    done = _coordinator(tmp_path / "coord", "--run-config", str(path))
    assert done.returncode == 2 and REFUSED in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "coord" / "runspec.msgpack").exists()


def test_the_coordinator_will_not_serve_a_stored_one_again(tmp_path):
    state = tmp_path / "coord"
    state.mkdir()
    identity, _ = load_or_create_identity(state / "coordinator.key")
    (state / "runspec.msgpack").write_bytes(encode("RunSpec", _twice_spec(), identity))
    done = _coordinator(state)
    assert done.returncode == 2 and REFUSED in done.stderr and "runspec.msgpack" in done.stderr, done.stderr


def test_a_peer_will_not_join_it(tmp_path):
    with pytest.raises(ValueError, match=REFUSED):
        RunSettings.from_spec(_twice_spec())
    closed = []
    node = types.SimpleNamespace(close=lambda: closed.append(True))
    with pytest.raises(ValueError, match=REFUSED):  # what `heterorl peer` builds once it joined
        PeerRuntime(
            Joined(node, b"", _twice_spec(), b""),
            None,
            tmp_path,
            Hardware("cpu", "test CPU", 1 << 30, 1),
            "sampler",
            store_bytes=1 << 20,
        )
    assert closed == [True]  # and it left: its node closed
