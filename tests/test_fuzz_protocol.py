"""The decoder fuzzer (heterorl.bench.fuzz): a bounded run over every target, and proof that the harness
notices each kind of failure (crash, hang, lax or over-strict decoder, over-reading framer)."""

import asyncio
import json
import math
import time

import msgpack
import pytest

from heterorl.bench import fuzz
from heterorl.bench.fuzz.harness import _Harness
from heterorl.bench.fuzz.oracle import _Reject
from heterorl.bench.fuzz.runner import _split
from heterorl.protocol import Identity, ProtocolError, decode, encode
from heterorl.protocol.net import framing
from heterorl.protocol.wire import messages
from heterorl.protocol.wire.messages import _signed_bytes

BOUNDED_INPUTS = 3000

# Regression probes for the four bugs the first 100 000-input run found (all fixed in protocol/).


def test_unhashable_message_type_is_refused_not_a_crash():
    env = {"v": 1, "type": [], "body": {}, "author": b"a" * 32, "sig": b"s" * 64}
    with pytest.raises(ProtocolError, match="unknown message type list"):
        decode(msgpack.packb(env))


def test_deep_nesting_is_refused_without_recursion():
    deep = b"\x85\xa1v\x01\xa4type\xa3Ack\xa4body\x81\xa6run_id" + b"\x91" * 1000 + b"\xc0"
    deep += b"\xa6author\xc4\x20" + b"a" * 32 + b"\xa3sig\xc4\x40" + b"s" * 64
    with pytest.raises(ProtocolError, match="nests deeper"):
        decode(deep)
    nested_version = 1
    for _ in range(40):
        nested_version = [nested_version]
    env = {"v": nested_version, "type": "Ack", "body": {}, "author": b"a" * 32, "sig": b"s" * 64}
    deep_version = msgpack.packb(env)
    with pytest.raises(ProtocolError):
        decode(deep_version)


@pytest.mark.parametrize("version", [1.0, True, "1"])
def test_protocol_version_must_be_the_integer(version):
    alice = Identity.generate()
    body = {"run_id": "r", "batch_id": b"\x01" * 16}
    sig = alice.sign(_signed_bytes(1, "Ack", body, alice.public_key))
    good = {"v": 1, "type": "Ack", "body": body, "author": alice.public_key, "sig": sig}
    assert decode(msgpack.packb(good))[0] == "Ack"
    with pytest.raises(ProtocolError, match="protocol version"):
        decode(msgpack.packb({**good, "v": version}))


@pytest.mark.parametrize("expiration", [math.nan, math.inf])
def test_non_finite_record_expiration_is_refused(expiration):
    from heterorl.protocol.net.dht import SignedRecordValidator, make_record, peers_key

    alice = Identity.generate()
    hb = {
        "run_id": "r",
        "role": "s",
        "state": "g",
        "policy_version": 1,
        "tokens_per_s": 1.0,
        "timestamp": fuzz.NOW,
        "peer_id": "p",
        "maddrs": [],
        "hardware": "cpu",
        "stats": [],
    }
    validator = SignedRecordValidator(None, clock=lambda: fuzz.NOW)
    ok = make_record(peers_key("r"), alice.public_key, encode("Heartbeat", hb, alice), fuzz.NOW + 30, alice)
    assert validator.validate(ok)
    bad = make_record(peers_key("r"), alice.public_key, encode("Heartbeat", hb, alice), expiration, alice)
    assert not validator.validate(bad)


@pytest.fixture(scope="module")
def bounded():
    return fuzz.run_fuzz(BOUNDED_INPUTS, seed=0, progress=False)


def _signatures(report):
    return {sig: n for t in report.targets.values() for sig, n in t._signatures.items()}


def test_bounded_run_exercises_every_target(bounded):
    assert bounded.inputs == BOUNDED_INPUTS
    assert bounded.wall_s < 30
    assert set(bounded.targets) == set(fuzz.DEFAULT_TARGETS)
    for name, t in bounded.targets.items():
        assert t.inputs == _split(BOUNDED_INPUTS, fuzz.DEFAULT_TARGETS)[name]
        assert t.rejected > 0, f"{name} never refused an input"
        assert t.accepted > 0, f"{name} never accepted an input: the generators only make garbage"
        assert t.sources.get("hypothesis", 0) > 0 and t.sources.get("random", 0) > 0
        assert t.rejected + t.accepted == t.inputs
        assert len(t.digest) == 64
    # structure-aware bodies must reach the schema layer and pass it often (signed correctly)
    assert bounded.targets["decode_signed"].accepted > 0.1 * bounded.targets["decode_signed"].inputs


def test_bounded_run_finds_nothing(bounded):
    for t in bounded.targets.values():
        assert t.harness_errors == 0, t.harness_error_examples
        assert t.rejected_but_should_not == t.wrong_result == t.over_read == 0, t.violation_examples
        assert t.hangs == 0, t.hang_examples
    assert not _signatures(bounded), bounded.format_table()
    assert bounded.ok, bounded.format_table()
    for t in bounded.targets.values():
        assert t.crashes == t.hangs == t.violations == t.accepted_but_should_not == 0


def test_same_seed_same_inputs_other_seed_other_inputs():
    targets = ["decode_signed", "frame", "chunk_request"]
    a, b = (fuzz.run_fuzz(300, seed=7, targets=targets, progress=False) for _ in range(2))
    c = fuzz.run_fuzz(300, seed=8, targets=targets, progress=False)
    for name in targets:
        assert a.targets[name].digest == b.targets[name].digest
        assert a.targets[name].accepted == b.targets[name].accepted
        assert a.targets[name].digest != c.targets[name].digest


def test_unknown_target_refused():
    with pytest.raises(ValueError, match="unknown fuzz targets"):
        fuzz.run_fuzz(10, targets=["decode", "nope"], progress=False)


# ----------------------------------------------------------------- the harness can fail: each failure kind


def test_a_decoder_raising_a_foreign_exception_is_a_crash(monkeypatch):
    real = messages.decode

    def flaky(data, *args, **kw):
        if len(data) % 5 == 0:
            raise ValueError("boom")
        return real(data, *args, **kw)

    monkeypatch.setattr(messages, "decode", flaky)
    report = fuzz.run_fuzz(300, targets=["decode"], progress=False)
    t = report.targets["decode"]
    assert t.crashes > 0 and not report.ok
    assert any(ex["error"] == "ValueError" and "input_hex" in ex for ex in t.crash_examples)


def test_a_lax_schema_is_caught_accepting_signed_garbage(monkeypatch):
    for kind in list(messages.SCHEMAS):
        monkeypatch.setitem(messages.SCHEMAS, kind, lambda v, path: v)
    report = fuzz.run_fuzz(400, targets=["decode_signed"], progress=False)
    t = report.targets["decode_signed"]
    assert t.accepted_but_should_not > 0 and not report.ok
    assert any(ex["kind"] == "accepted_but_should_not" for ex in t.violation_examples)


def test_signature_check_removed_is_caught(monkeypatch):
    monkeypatch.setattr(messages, "verify", lambda *a: True)
    report = fuzz.run_fuzz(400, targets=["decode"], progress=False)
    reasons = {ex.get("reason") for ex in report.targets["decode"].violation_examples}
    assert "not signed by its author" in reasons


def test_an_over_strict_decoder_is_caught(monkeypatch):
    def refuse(data, *a, **kw):
        raise ProtocolError("no")

    monkeypatch.setattr(messages, "decode", refuse)
    report = fuzz.run_fuzz(200, targets=["decode_signed"], progress=False)
    assert report.targets["decode_signed"].rejected_but_should_not > 0 and not report.ok


def test_a_wrong_result_is_caught(monkeypatch):
    real = messages.decode

    def tampering(*a, **kw):
        kind, body, author = real(*a, **kw)
        return kind, {**body, "run_id": body["run_id"] + "!"}, author

    monkeypatch.setattr(messages, "decode", tampering)
    report = fuzz.run_fuzz(200, targets=["decode_signed"], progress=False)
    assert report.targets["decode_signed"].wrong_result > 0


def test_a_framer_that_ignores_its_cap_is_caught(monkeypatch):
    async def uncapped(reader, max_bytes, timeout):  # keeps the deadline, forgets the cap
        async def read():
            header = await reader.readexactly(4)
            return await reader.readexactly(int.from_bytes(header, "big"))

        return await asyncio.wait_for(read(), timeout)

    monkeypatch.setattr(framing, "read_frame", uncapped)
    report = fuzz.run_fuzz(300, targets=["frame"], progress=False)
    t = report.targets["frame"]
    assert t.over_read > 0
    assert t.crashes > 0  # IncompleteReadError / TimeoutError escape: not FrameError
    assert not report.ok


def test_a_framer_without_a_deadline_is_a_hang(monkeypatch):
    async def forever(reader, max_bytes, timeout):
        await asyncio.sleep(3600)

    monkeypatch.setattr(fuzz.config, "FRAME_GUARD_S", 0.05)
    monkeypatch.setattr(framing, "read_frame", forever)
    report = fuzz.run_fuzz(5, targets=["frame"], progress=False, hypothesis_share=0)
    t = report.targets["frame"]
    assert t.hangs == 5 and t.crashes == 0 and "still running" in t.hang_examples[0]["detail"]


def test_a_validator_that_accepts_everything_or_raises_is_caught(monkeypatch):
    from heterorl.protocol.net import dht

    monkeypatch.setattr(dht.SignedRecordValidator, "validate", lambda self, record: True)
    report = fuzz.run_fuzz(200, targets=["dht_record"], progress=False)
    t = report.targets["dht_record"]
    reasons = {ex["reason"] for ex in t.violation_examples}
    assert t.accepted_but_should_not > 0
    assert "record not signed by its subkey's owner" in reasons

    def raising(self, record):
        raise KeyError("x")

    monkeypatch.setattr(dht.SignedRecordValidator, "validate", raising)
    assert fuzz.run_fuzz(50, targets=["dht_record"], progress=False).targets["dht_record"].crashes == 50


def test_a_lax_chunk_request_parser_is_caught(monkeypatch):
    from heterorl.protocol.net import chunks

    monkeypatch.setattr(chunks, "_parse_request", lambda frame: msgpack.unpackb(frame)["hashes"])
    report = fuzz.run_fuzz(300, targets=["chunk_request"], progress=False)
    t = report.targets["chunk_request"]
    assert t.crashes > 0 and t.accepted_but_should_not > 0


def test_a_slow_input_is_a_hang(monkeypatch):
    real = messages.decode

    def slow(data, *a, **kw):
        if len(data) % 11 == 0:
            time.sleep(0.03)
        return real(data, *a, **kw)

    monkeypatch.setattr(fuzz.config, "HANG_S", 0.02)
    monkeypatch.setattr(messages, "decode", slow)
    report = fuzz.run_fuzz(150, targets=["decode"], progress=False, hypothesis_share=0)
    t = report.targets["decode"]
    assert t.hangs > 0 and t.hang_examples and not report.ok


def test_a_stuck_input_is_interrupted_and_the_run_goes_on(monkeypatch):
    real = messages.decode
    calls = []

    def stuck(data, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            time.sleep(60)
        return real(data, *a, **kw)

    monkeypatch.setattr(fuzz.config, "ABORT_S", 0.2)
    monkeypatch.setattr(messages, "decode", stuck)
    t0 = time.perf_counter()
    report = fuzz.run_fuzz(40, targets=["decode"], progress=False, hypothesis_share=0)
    assert time.perf_counter() - t0 < 20
    t = report.targets["decode"]
    assert t.inputs == 40 and t.hangs == 1
    assert "aborted" in t.hang_examples[0]["detail"]


def test_a_generator_bug_is_reported_not_swallowed(monkeypatch):
    real = fuzz.ChunkRequestTarget.generate

    def buggy(self, rng):
        if rng.random() < 0.2:
            raise IndexError("generator bug")
        return real(self, rng)

    monkeypatch.setattr(fuzz.ChunkRequestTarget, "generate", buggy)
    report = fuzz.run_fuzz(100, targets=["chunk_request"], progress=False, hypothesis_share=0)
    t = report.targets["chunk_request"]
    assert t.inputs == 100 and t.harness_errors > 0 and not report.ok


# ----------------------------------------------------------------------------------- oracle and CLI


def test_oracle_accepts_what_encode_makes_and_refuses_a_float_version():
    oracle = fuzz.Oracle()
    h = _Harness(0)
    import random

    rng = random.Random(0)
    for kind in fuzz.KINDS:
        body = fuzz.valid_body(kind, rng)
        data = h.sign_message(kind, body, rng)
        got = decode(data)
        assert h.oracle.message(data) == got
        assert encode(kind, body, h.honest[0])  # the generator's valid bodies pass the real encoder too
        with pytest.raises(_Reject, match="not signed"):
            oracle.message(data)  # another oracle never saw that signature: a forgery to it
    env = msgpack.unpackb(data)
    env["v"] = 1.0
    with pytest.raises(_Reject, match="protocol version"):
        h.oracle.message(msgpack.packb(env))


def test_cli(tmp_path, monkeypatch, capsys):
    out = tmp_path / "report.json"
    argv = ["--inputs", "120", "--targets", "frame,chunk_request", "--json", str(out), "--no-progress"]
    assert fuzz.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["inputs"] == 120 and set(report["targets"]) == {"frame", "chunk_request"}
    assert "chunk_request" in capsys.readouterr().out
    assert fuzz.main(["--targets", "decode,bogus", "--no-progress"]) == 2

    from heterorl.protocol.net import chunks

    def broken(frame):
        raise KeyError("x")

    monkeypatch.setattr(chunks, "_parse_request", broken)
    assert fuzz.main(["--inputs", "20", "--targets", "chunk_request", "--no-progress"]) == 1
