"""The learner's background publisher: state saved before a version is public, chunks and deltas in the store,
one version in hand (a busy publisher is skipped to the newest), a restart re-announces, errors surface."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from heterorl.peer.daemon.announcer import Announcer
from heterorl.peer.daemon.publisher import Publisher
from heterorl.peer.learner.state import current_save
from heterorl.peer.learner.trainer import Trainer
from heterorl.peer.learner.update import StepOptions
from heterorl.protocol import Identity
from heterorl.protocol.storage.ledger import AcceptedLog
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import delta_part, serialize_state_dict
from heterorl.protocol.wire.delta import apply_delta

pytestmark = pytest.mark.fast

RUN = "pub-run"


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 8)


class Starts:
    """The announcer's start function: records versions; blocks while ``gate`` is cleared."""

    def __init__(self, store: ChunkStore, state_root) -> None:
        self.versions: list[int] = []
        self.saved_at_announce: list[str | None] = []
        self.gate = threading.Event()
        self.gate.set()
        self.store, self.state_root = store, state_root

    def __call__(self, raw: bytes, body: dict) -> concurrent.futures.Future:
        save = current_save(self.state_root)
        self.saved_at_announce.append(save.name if save else None)
        self.gate.wait(10)
        self.versions.append(body["version"])
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(None)
        return fut


class Rig:
    def __init__(self, tmp_path, deltas: int = 2) -> None:
        self.store = ChunkStore(tmp_path / "chunks", max_bytes=1 << 30, keep_latest=8)
        self.ledger = AcceptedLog(tmp_path / "ledger.sqlite")
        self.state_root = tmp_path / "state"
        self.starts = Starts(self.store, self.state_root)
        self.identity = Identity.generate()
        self.trainer = Trainer(Model(), _options(), pad_id=0, optimizer=_sgd)
        self.pub = self.publisher(deltas)
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.pub.run()
        except Exception as e:  # what a supervisor would see
            self.errors.append(e)

    def publisher(self, deltas: int = 2) -> Publisher:
        return Publisher(
            run_id=RUN,
            identity=self.identity,
            store=self.store,
            ledger=self.ledger,
            announcer=Announcer(self.starts),
            state_root=self.state_root,
            checkpoint_dtype="bfloat16",
            deltas=deltas,
        )

    def update(self) -> None:
        """A stand-in for an RL step: move a few weights (most bf16 words stay), count the version."""
        with torch.no_grad():
            for p in self.trainer.model.parameters():
                p.view(-1)[self.trainer.version % 7 :: 13] += 0.05
        self.trainer.version += 1

    def offer(self) -> bool:
        return self.pub.offer(lambda: self.trainer.snapshot("bfloat16"))

    def close(self) -> None:
        self.starts.gate.set()
        self.pub.close()
        self.thread.join(10)
        self.ledger.close()


def _options() -> StepOptions:
    return StepOptions("gepo", None, {}, 1.0, 4, lr=0.1, grad_clip=1.0)


def _sgd(params, lr):
    return torch.optim.SGD(params, lr=lr)


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def test_a_version_is_saved_then_stored_then_announced_off_the_callers_thread(rig):
    rig.pub.publish_now(rig.trainer.snapshot("bfloat16", with_state=False))  # version 0, as at start
    rig.update()
    assert rig.offer()
    assert rig.pub.wait_idle(10)
    assert rig.starts.versions == [0, 1] and rig.pub.published_version == 1
    assert rig.starts.saved_at_announce == [None, "step-00000001"]  # state saved before it was public
    assert rig.store.versions() == [0, 1]
    expected = serialize_state_dict(rig.trainer.snapshot("bfloat16", with_state=False).weights)
    assert rig.store.assemble(1) == expected
    s = rig.pub.stats()
    assert s["published"] == 2 and s["publish_save_s"] > 0 and s["publish_build_s"] > 0


def test_a_busy_publisher_is_skipped_and_the_newest_version_goes_next(rig):
    rig.update()
    rig.starts.gate.clear()  # version 1's announce hangs: the publisher stays busy
    assert rig.offer()
    made = []
    for _ in range(3):  # versions 2, 3, 4 are due while it is busy: refused, and no snapshot is even made
        rig.update()
        assert not rig.pub.offer(lambda: made.append(1))
    assert made == [] and not rig.pub.idle()
    rig.starts.gate.set()
    assert rig.pub.wait_idle(10)
    assert rig.offer() and rig.pub.wait_idle(10)  # the newest, version 4
    assert rig.starts.versions == [1, 4] and rig.store.versions() == [1, 4]
    assert current_save(rig.state_root).name == "step-00000004"


def test_versions_come_with_deltas_that_rebuild_them_bit_for_bit(rig):
    for _ in range(3):
        rig.update()
        assert rig.offer() and rig.pub.wait_idle(10)
    body = rig.store.body(3)
    assert sorted(d["base_version"] for d in body["deltas"]) == [1, 2]  # deltas=2: the two before it
    full = rig.store.assemble(3)
    for d in body["deltas"]:
        delta = rig.store.assemble_part(delta_part(body, d), "delta")
        assert apply_delta(rig.store.assemble(d["base_version"]), delta) == full
    assert 0 < rig.pub.stats()["delta_ratio"] < 0.5


def test_a_restarted_publisher_diffs_against_versions_read_back_from_the_store(rig):
    rig.update()
    assert rig.offer() and rig.pub.wait_idle(10)
    again = rig.publisher()  # holds no tensors of earlier versions
    rig.update()
    again.publish_now(rig.trainer.snapshot("bfloat16", with_state=False))
    body = rig.store.body(2)
    assert [d["base_version"] for d in body["deltas"]] == [1]
    delta = rig.store.assemble_part(delta_part(body, body["deltas"][0]), "delta")
    assert apply_delta(rig.store.assemble(1), delta) == rig.store.assemble(2)


def test_a_restarted_publisher_announces_the_stored_version_again_without_rebuilding(rig):
    rig.update()
    assert rig.offer() and rig.pub.wait_idle(10)
    raw = rig.store.manifest(1)
    again = rig.publisher()  # a restarted learner, same store, same saved weights
    again.publish_now(rig.trainer.snapshot("bfloat16", with_state=False))
    assert rig.starts.versions == [1, 1] and rig.store.manifest(1) == raw


def test_the_checker_hears_a_version_only_with_the_weights_it_holds(rig):
    """A restart resumed from an older save re-announces the newest version found published; those weights are
    not the resumed ones, so the spot checker is not handed them (it reads that version from the store)."""
    rig.update()
    assert rig.offer() and rig.pub.wait_idle(10)  # version 1
    heard: list[int] = []
    same = rig.publisher()
    same.on_published = lambda v, weights: heard.append(v)
    same.publish_now(rig.trainer.snapshot("bfloat16", with_state=False))  # the very weights of version 1
    assert heard == [1]
    resumed = rig.publisher()
    resumed.on_published = lambda v, weights: heard.append(v)
    with torch.no_grad():  # a state older than version 1's, numbered as the newest published
        for p in rig.trainer.model.parameters():
            p.add_(1.0)
    resumed.publish_now(rig.trainer.snapshot("bfloat16", with_state=False))
    assert heard == [1] and rig.starts.versions[-1] == 1  # announced again, not handed to the checker


def test_publishing_prunes_the_ledger_up_to_the_saved_step(rig):
    for i, step in enumerate((1, 2)):
        bid = bytes([i + 1]) * 16
        rig.ledger.accept(bid, b"a" * 32, 0, b"payload", 0.0)
        rig.ledger.mark_applied([bid], step)
    rig.update()
    rig.update()
    assert rig.offer() and rig.pub.wait_idle(10)  # saves step 2: payloads applied before it may go
    assert rig.ledger.get(bytes([1]) * 16).data == b"" and rig.ledger.get(bytes([2]) * 16).data == b"payload"


def test_a_publish_that_fails_ends_the_thread_with_its_error(tmp_path):
    rig = Rig(tmp_path)
    rig.state_root.write_text("not a folder")  # the state save cannot be written
    rig.update()
    assert rig.offer()
    rig.thread.join(10)
    assert not rig.thread.is_alive() and isinstance(rig.errors[0], OSError)
    assert rig.pub.idle() and rig.pub.published_version == -1 and rig.store.versions() == []
    rig.close()


def test_an_idle_publisher_announces_the_newest_version_again_before_its_records_expire(
    tmp_path, monkeypatch
):
    from heterorl.peer.daemon import publisher

    monkeypatch.setattr(publisher, "REANNOUNCE_S", 0.05)
    rig = Rig(tmp_path)
    try:
        rig.update()
        assert rig.offer() and rig.pub.wait_idle(10)
        done = threading.Event()
        for _ in range(400):  # nothing new is offered: the same version is announced again, and again
            if rig.starts.versions.count(1) >= 3:
                break
            done.wait(0.05)
        assert set(rig.starts.versions) == {1} and len(rig.starts.versions) >= 3
    finally:
        rig.close()


def test_the_state_is_saved_with_the_first_version_then_every_save_every_s(tmp_path):
    rig = Rig(tmp_path)
    rig.pub.save_every_s = 3600.0
    try:
        for _ in range(3):
            rig.update()
            assert rig.pub.offer(lambda: rig.trainer.snapshot("bfloat16", with_state=rig.pub.save_due()))
            assert rig.pub.wait_idle(10)
        assert rig.store.versions()[-1] == 3 and rig.pub.saved_version == 1
        assert current_save(rig.state_root).name == "step-00000001"
        assert not rig.pub.save_due()
    finally:
        rig.close()
