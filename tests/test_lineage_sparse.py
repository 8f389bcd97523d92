"""The learner peers' sparse exchange (``[lineage] exchange = "sparse"``), in parts: each learner's own AdamW
step, not applied (:meth:`Trainer.local_update`); its top-k with error feedback as a checked frame; the
writer's token-weighted, clipped combination of the decoded parts; the top-k of that with the writer's own
error feedback as the commit; the commit added by every learner. Replicas on different AdamW kernels and
thread counts end bit-identical after every version, as with the dense exchange."""

from __future__ import annotations

import hashlib

import pytest
import torch
from test_lineage_math import _adamw, model
from test_trainer import buffered, options

from heterorl.peer.learner.combine import Accumulator, state_sha256
from heterorl.peer.learner.compress import ErrorFeedback, flatten, unflatten
from heterorl.peer.learner.rows import rows_from_batches
from heterorl.peer.learner.trainer import Trainer
from heterorl.protocol import ProtocolError
from heterorl.protocol.net.lineage import Exchange
from heterorl.protocol.settings import LineageSettings
from heterorl.protocol.wire.gradients import gradient_frame_cap, parameter_schema
from heterorl.protocol.wire.sparse_gradient import decode_part, flat_size, frame_size

pytestmark = pytest.mark.fast

LR = 1e-2


def test_local_update_is_the_adamw_step_and_leaves_the_weights_exactly():
    """The step local_update returns is what Trainer.step moves the weights by (to float rounding), the
    weights stay bit for bit, and the moments advance."""
    ref = Trainer(model(), options(lr=LR), pad_id=0)
    me = Trainer(model(), options(lr=LR), pad_id=0)
    rows = rows_from_batches(buffered(2), pad_id=0)
    before = {n: p.detach().clone() for n, p in me.named_trainable()}
    g, _ = me.gradients(rows)
    step = me.local_update(g)
    for n, p in me.named_trainable():
        assert torch.equal(p, before[n]), n
    ref.step(rows)
    for n, p in ref.named_trainable():
        torch.testing.assert_close(before[n] + step[n], p.detach(), rtol=0, atol=1e-7, msg=n)
    assert all(float(s["step"]) == 1 for s in me.optimizer.state.values())


def test_a_gradient_at_an_offset_is_the_shifted_weights_gradient_and_leaves_the_weights_exactly():
    """Trainer.gradients(rows, offset): the gradient (and stats) of a copy whose weights are moved by
    ``offset``, the trainer's own weights restored bit for bit; an offset of zeros changes nothing."""
    me = Trainer(model(), options(lr=LR), pad_id=0)
    rows = rows_from_batches(buffered(2), pad_id=0)
    before = {n: p.detach().clone() for n, p in me.named_trainable()}
    offset = {n: torch.randn_like(p) * 0.05 for n, p in before.items()}
    shifted = Trainer(model(), options(lr=LR), pad_id=0)
    with torch.no_grad():
        for n, p in shifted.named_trainable():
            p.add_(offset[n])
    got, stats = me.gradients(rows, offset)
    want, want_stats = shifted.gradients(rows)
    plain, _ = me.gradients(rows)
    for n, p in me.named_trainable():
        assert torch.equal(p, before[n]), n
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)
    assert stats.keys() == want_stats.keys()
    for key, value in want_stats.items():
        if not key.startswith(("time/", "mem/")):
            assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert any(not torch.allclose(got[n], plain[n]) for n in got), "the offset changed no gradient"
    zeros, _ = me.gradients(rows, {n: torch.zeros_like(p) for n, p in before.items()})
    assert all(torch.equal(zeros[n], plain[n]) for n in plain)


def test_two_learners_on_other_kernels_agree_bit_for_bit_at_every_version_of_a_sparse_exchange():
    """30 versions: the writer (fused AdamW, 1 thread) and a member (the per-tensor loop, 2 threads) each
    take their own batches, each gradient taken at its weights plus what it has not sent (as the daemon does);
    only compressed frames cross (the member's part, the writer's commit) and both hash the same after every
    commit. An honest part stays well inside the default clip, every frame is
    0.39 % of the dense gradient's bytes, and the weights moved (the commits carry the steps)."""
    before = torch.get_num_threads()
    w = Trainer(model(), options(lr=LR), pad_id=0, optimizer=_adamw("fused"))
    m = Trainer(model(), options(lr=LR), pad_id=0, optimizer=_adamw("loop"))
    schema = parameter_schema(w.model.named_parameters())
    numel, k = flat_size(schema), LineageSettings().k
    exchange = Exchange(schema, sparse=True, k=k)
    clip = LineageSettings().update_clip * LR * numel**0.5
    sent, committed = ErrorFeedback(numel, k), ErrorFeedback(numel, k)
    start = flatten(dict(w.named_trainable()), schema).clone()
    ratios = []
    try:
        for step in range(30):
            torch.set_num_threads(2)
            held = unflatten(sent.residual * 0.5, schema)  # the member's offset: its residual × its share
            g, _ = m.gradients(rows_from_batches(buffered(3, version=step), pad_id=0), held)
            part = sent.step(flatten(m.local_update(g), schema)).frame()
            assert len(part) == exchange.cap == frame_size(numel, k)
            torch.set_num_threads(1)
            acc = Accumulator(clip)
            theirs = exchange.decode(part, hashlib.sha256(part).digest())
            ratios.append(float(flatten(theirs, schema).norm()) / (LR * numel**0.5))
            acc.add(8, theirs)
            held = unflatten(committed.residual, schema)  # the writer's: its commits' residual
            g, _ = w.gradients(rows_from_batches(buffered(2, version=step), pad_id=0), held)
            acc.add(8, w.local_update(g))
            combined, _, _ = acc.result()
            frame = committed.step(flatten(combined, schema)).frame()
            sha = hashlib.sha256(frame).digest()
            w.apply_update(decode_part(frame, sha, schema, k), None, step + 1)
            torch.set_num_threads(2)
            m.apply_update(exchange.decode(frame, sha), None, step + 1)
            assert state_sha256(m.named_trainable()) == state_sha256(w.named_trainable()), step
        assert len(frame) / (gradient_frame_cap(schema) - (1 << 20)) < 0.005
        assert max(ratios) < LineageSettings().update_clip / 4, ratios  # honest parts are far from the clip
        moved = flatten(dict(w.named_trainable()), schema) - start
        assert float(moved.abs().max()) > LR, "the commits moved no weight by a step's size"
    finally:
        torch.set_num_threads(before)


def test_the_sparse_exchange_refuses_frames_of_another_size_hash_or_range():
    schema = parameter_schema(model().named_parameters())
    exchange = Exchange(schema, sparse=True, k=32)
    good = ErrorFeedback(flat_size(schema), 32).step(torch.randn(flat_size(schema))).frame()
    with pytest.raises(ProtocolError, match="hash"):
        exchange.decode(good, bytes(32))
    short = good[:-1]
    with pytest.raises(ProtocolError, match="bytes"):
        exchange.decode(short, hashlib.sha256(short).digest())
    bad = bytearray(good)
    bad[0:4] = b"\x00\x00\xc0\x7f"  # chunk 0's lo: NaN
    with pytest.raises(ProtocolError, match="finite"):
        exchange.decode(bytes(bad), hashlib.sha256(bytes(bad)).digest())


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("exchange", "gossip", "one of"), ("k", 30, "multiple of 4"), ("k", 512, "multiple of 4"),
     ("update_clip", 0.0, "> 0")],
)  # fmt: skip
def test_lineage_settings_refuse_what_the_exchange_cannot_do(field, value, match):
    with pytest.raises(ValueError, match=match):
        LineageSettings(**{field: value})


@pytest.mark.parametrize("exchange", ["sparse", "dense"])
def test_a_local_lineage_combines_each_learners_part_and_overlaps_the_members(exchange):
    """peer/train/lineage_local.py (the quality bench's two learners in one process): with overlap, the
    member's part joins the step after the one it was computed in; every step moves the weights."""
    from heterorl.peer.learner.update import StepOptions
    from heterorl.peer.train.lineage_local import LocalLineage

    settings = LineageSettings(exchange=exchange)
    opts = options(lr=LR)
    writer = Trainer(model(), opts, pad_id=0)
    lineage = LocalLineage(writer, 2, settings, opts)
    assert isinstance(opts, StepOptions)
    parts, before = [], flatten(dict(writer.named_trainable()), lineage.schema).clone()
    for step in range(3):
        rows = [rows_from_batches(buffered(2, version=step), pad_id=0) for _ in range(2)]
        stats = lineage.step(rows)
        parts.append(stats["lineage/parts"])
        after = flatten(dict(writer.named_trainable()), lineage.schema).clone()
        assert not torch.equal(after, before), step
        before = after
    assert parts == [1, 2, 2] and writer.version == 3
    with pytest.raises(ValueError, match="parts for 2 learners"):
        lineage.step([rows[0]])


def test_a_learner_takes_its_gradient_where_its_unsent_steps_put_the_weights():
    """LineageRole._unsent_offset: a writer's offset is its commits' residual, a member's its parts' residual
    times its share of a commit; the dense exchange, or nothing held back yet, has none."""
    from types import SimpleNamespace

    from heterorl.peer.daemon.learner_lineage import LineageRole

    schema = parameter_schema(model().named_parameters())
    numel = flat_size(schema)
    sent, committed = ErrorFeedback(numel, 32), ErrorFeedback(numel, 32)
    sent.step(torch.randn(numel))
    committed.step(torch.randn(numel))
    role = SimpleNamespace(
        exchange=Exchange(schema, sparse=True, k=32), schema=schema, share=0.25,
        sent_feedback=sent, commit_feedback=committed, is_writer=True,
    )  # fmt: skip
    assert torch.equal(flatten(LineageRole._unsent_offset(role), schema), committed.residual)
    role.is_writer = False
    assert torch.equal(flatten(LineageRole._unsent_offset(role), schema), sent.residual * 0.25)
    role.sent_feedback = None  # a member that has sent nothing yet
    assert LineageRole._unsent_offset(role) is None
    role.exchange = Exchange(schema, sparse=False, k=32)
    role.sent_feedback = sent
    assert LineageRole._unsent_offset(role) is None
