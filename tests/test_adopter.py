"""A lineage member's check of published versions (peer/daemon/adopter.py): its own weights against the
writer's signed manifests, whatever order the two arrive in."""

from __future__ import annotations

import hashlib

import pytest
import torch

from heterorl.peer.daemon.adopter import Adopter
from heterorl.peer.learner.trainer import Snapshot
from heterorl.protocol import encode
from heterorl.protocol.storage.store import ChunkStore
from heterorl.protocol.wire.checkpoint import manifest_body, serialize_state_dict
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.identity import Identity

pytestmark = pytest.mark.fast

RUN = "adopter-unit"
WRITER = Identity.generate()


def weights(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)}


def manifest(v: int, w: dict | None = None, by: Identity = WRITER) -> bytes:
    body, _ = manifest_body(RUN, v, v - 1, serialize_state_dict(weights(v) if w is None else w), "float32")
    return encode("CheckpointManifest", body, by)


@pytest.fixture
def adopter(tmp_path):
    store = ChunkStore(tmp_path / "chunks", 1 << 30, keep_latest=16)
    rows: list[dict] = []
    adopter = Adopter(RUN, WRITER.public_key, store, "float32", log=rows.append)
    adopter.rows = rows
    return adopter


def keep(adopter: Adopter, v: int, w: dict | None = None) -> None:
    adopter.keep(v, Snapshot(v, weights(v) if w is None else w))


def test_a_kept_version_whose_manifest_comes_agrees_and_is_stored(adopter, tmp_path):
    keep(adopter, 3)
    assert adopter.adopt(manifest(3)) is True
    assert adopter.store.has_version(3) and adopter.published_version == 3
    assert [(r["event"], r["version"], r["agree"]) for r in adopter.rows] == [("checked", 3, True)]
    assert adopter.rows[0]["manifest"] == hashlib.sha256(manifest(3)).hexdigest()  # which signed bytes


def test_other_weights_disagree_and_nothing_is_stored(adopter):
    keep(adopter, 3, weights(99))
    assert adopter.adopt(manifest(3)) is False
    assert not adopter.store.has_version(3) and adopter.mismatched == 1


def test_a_manifest_before_its_version_is_reached_is_checked_when_it_is(adopter):
    """A joiner took the writer's state at 5 while the writer went on: the hello carries the manifests of 4,
    6 and 8. 4 was published before this learner had it (unchecked); 6 and 8 wait for their weights."""
    keep(adopter, 5)
    assert adopter.adopt(manifest(4)) is None
    assert adopter.adopt(manifest(6)) is None and adopter.adopt(manifest(8)) is None
    assert adopter.unchecked == 1 and not adopter.store.has_version(6)
    keep(adopter, 6)  # the commit of 6 arrives: its manifest is checked at once
    assert adopter.store.has_version(6) and adopter.agreed == 1
    keep(adopter, 8, weights(7))  # another learner's bytes at 8: disagreement found, not lost
    assert adopter.mismatched == 1 and adopter.agreed == 1


def test_a_manifest_not_signed_by_the_writer_is_refused(adopter):
    keep(adopter, 2)
    with pytest.raises(ProtocolError, match="not signed by the writer"):
        adopter.adopt(manifest(2, by=Identity.generate()))


def test_a_member_keeps_at_most_two_versions_waiting_for_their_manifests(adopter):
    """Weights kept on the training device are bounded: the writer's manifest of a version comes with the
    next reply, so two versions waiting is enough; an older one waiting is let go (counted unchecked)."""
    for v in range(1, 9):
        keep(adopter, v)
    assert len(adopter._kept) == 2 and sorted(adopter._kept) == [7, 8]
    assert adopter.adopt(manifest(8)) is True and adopter.adopt(manifest(3)) is None
    seen = []
    adopter.on_signed = lambda v, sha: seen.append((v, sha))
    adopter.adopt(manifest(2))  # not held here: the trust gate still learns the writer signed it
    assert seen == [(2, hashlib.sha256(manifest(2)).digest())]
