"""The learner peers' step in parts: each learner's gradient, the writer's reduction (token-weighted, key
order, one clip), and the same bytes applied by every learner. Replicas that apply the same gradient bytes
must end bit-identical, whatever their thread count: the lineage's weights_agree rests on it."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_trainer import buffered, options

from heterorl.peer.learner.combine import combine_gradients, parts_for_step, state_sha256, weighted_lr_scale
from heterorl.peer.learner.rows import rows_from_batches
from heterorl.peer.learner.trainer import Trainer
from heterorl.protocol.net.lineage import Contributed
from heterorl.protocol.wire.gradients import decode_gradient, encode_gradient, parameter_schema

pytestmark = pytest.mark.fast

V = 37


def model(seed: int = 0, hidden: int = 128):
    """Large enough (≥ 64k elements in a tensor) that 2 threads split each elementwise kernel."""
    from transformers import LlamaForCausalLM

    from heterorl.peer.model.tiny import build_config

    torch.manual_seed(seed)
    return LlamaForCausalLM(build_config(V, hidden=hidden, layers=1, heads=2, max_len=32)).eval()


def grads(seed: int, shapes: dict) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_combine_is_the_token_weighted_mean_in_any_order_clipped_once():
    shapes = {"a": (3, 4), "b": (5,)}
    parts = [(bytes([k]) * 32, tokens, grads(k, shapes)) for k, tokens in ((3, 10), (1, 30), (2, 5))]
    out, norm = combine_gradients(parts, max_norm=0.0)
    total = sum(t for _, t, _ in parts)
    for n in shapes:  # float64 reference
        ref = sum(g[n].double() * t / total for _, t, g in parts)
        torch.testing.assert_close(out[n].double(), ref, atol=1e-6, rtol=0)
    ref_norm = torch.cat(
        [sum(g[n].double() * t / total for _, t, g in parts).flatten() for n in shapes]
    ).norm()
    assert norm == pytest.approx(float(ref_norm), rel=1e-6)
    for perm in itertools.permutations(parts):  # the same bytes whatever order they arrived in
        again, _ = combine_gradients(list(perm), max_norm=0.0)
        assert encode_gradient(again)[1] == encode_gradient(out)[1]
    clipped, before = combine_gradients(parts, max_norm=norm / 4)
    assert before == pytest.approx(norm)
    after = torch.cat([clipped[n].flatten() for n in shapes]).norm()
    assert float(after) == pytest.approx(norm / 4, rel=1e-5)
    assert weighted_lr_scale([(10, 1.0), (30, 0.5)]) == pytest.approx(0.625)


def test_gradient_frames_refuse_the_wrong_hash_shape_dtype_names_and_non_finite_values():
    from heterorl.protocol import ProtocolError

    schema = (("a", (3, 4)), ("b", (5,)))
    g = grads(0, dict(schema))
    data, sha = encode_gradient(g)
    back = decode_gradient(data, sha, schema)
    assert all(torch.equal(back[n], g[n]) for n in g)
    with pytest.raises(ProtocolError, match="hash"):
        decode_gradient(data, bytes(32), schema)
    bad = {
        "another shape": {**g, "b": torch.zeros(6)},
        "not the model's": {**g, "c": torch.zeros(1)},
        "not finite": {**g, "b": torch.full((5,), float("nan"))},
    }
    for tensors in bad.values():
        d, h = encode_gradient(tensors)
        with pytest.raises(ProtocolError, match="float32|not the model's|not finite"):
            decode_gradient(d, h, schema)
    from safetensors.torch import save

    d = save({"a": torch.zeros(3, 4, dtype=torch.float64), "b": torch.zeros(5)})
    import hashlib

    with pytest.raises(ProtocolError, match="float32"):
        decode_gradient(d, hashlib.sha256(d).digest(), schema)
    with pytest.raises(ProtocolError, match="not safetensors"):
        decode_gradient(b"\x00" * 64, hashlib.sha256(b"\x00" * 64).digest(), schema)


def test_two_learners_applying_the_same_bytes_stay_bit_identical_at_1_and_2_threads():
    """Two replicas, each its own batches; the combined gradient applied by each (one at 1 thread, one at
    2): after every step their float32 states hash the same. And one learner alone, through the parts,
    takes the same step as Trainer.step."""
    before = torch.get_num_threads()
    a, b = Trainer(model(), options(lr=1e-2), pad_id=0), Trainer(model(), options(lr=1e-2), pad_id=0)
    assert state_sha256(a.named_trainable()) == state_sha256(b.named_trainable())
    schema = parameter_schema(a.model.named_parameters())
    try:
        for step in range(3):
            ra = rows_from_batches(buffered(2, version=step), pad_id=0)
            rb = rows_from_batches(buffered(3, version=step)[1:], pad_id=0)
            torch.set_num_threads(1)
            ga, _ = a.gradients(ra)
            torch.set_num_threads(2)
            gb, _ = b.gradients(rb)
            combined, _ = combine_gradients([(b"\x01" * 32, 8, ga), (b"\x02" * 32, 9, gb)], max_norm=1.0)
            data, sha = encode_gradient(combined)
            torch.set_num_threads(1)
            a.apply(decode_gradient(data, sha, schema))
            torch.set_num_threads(2)
            b.apply(decode_gradient(data, sha, schema))
            assert a.version == b.version == step + 1
            assert state_sha256(a.named_trainable()) == state_sha256(b.named_trainable()), step
        ref = Trainer(model(), options(lr=1e-2, grad_clip=1e9), pad_id=0)
        parts = Trainer(model(), options(lr=1e-2, grad_clip=1e9), pad_id=0)
        rows = rows_from_batches(buffered(2), pad_id=0)
        ref.step(rows)
        g, _ = parts.gradients(rows)
        parts.apply(combine_gradients([(b"\x01" * 32, 1, g)], max_norm=0.0)[0])
        for (n, p), (_, q) in zip(ref.named_trainable(), parts.named_trainable(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=n)
    finally:
        torch.set_num_threads(before)


def test_a_joining_learner_takes_the_writers_weights_and_adamw_state_and_steps_identically():
    """state_bytes → load_state_bytes: the joiner's weights hash as the writer's, and the next step on the
    same gradient leaves both bit-identical (the optimiser's moments and step came across). What does not fit
    the model is refused."""
    from heterorl.peer.learner.state_transfer import load_state_bytes, state_bytes
    from heterorl.protocol import ProtocolError

    writer, joiner = Trainer(model(0), options(), pad_id=0), Trainer(model(1), options(), pad_id=0)
    for step in range(2):
        g, _ = writer.gradients(rows_from_batches(buffered(2, version=step), pad_id=0))
        writer.apply(combine_gradients([(b"\x01" * 32, 1, g)], max_norm=1.0)[0])
    snap = writer.snapshot("float32", with_state=True)
    named = [(n, snap.model_state[n]) for n, _ in writer.named_trainable()]
    weights, optimizer = state_bytes(named, snap.optimizer_state)
    load_state_bytes(joiner, snap.version, weights, optimizer)
    assert joiner.version == writer.version == 2
    assert state_sha256(joiner.named_trainable()) == state_sha256(writer.named_trainable())
    g, _ = writer.gradients(rows_from_batches(buffered(3, version=2), pad_id=0))
    step, _ = combine_gradients([(b"\x01" * 32, 1, g)], max_norm=1.0)
    writer.apply(step)
    joiner.apply(step)
    assert state_sha256(joiner.named_trainable()) == state_sha256(writer.named_trainable())
    other = Trainer(model(0, hidden=64), options(), pad_id=0)
    with pytest.raises(ProtocolError, match="shape|float32|parameters"):
        load_state_bytes(other, 2, weights, optimizer)
    with pytest.raises(ProtocolError, match="safetensors"):
        load_state_bytes(joiner, 2, b"garbage", optimizer)


def test_a_step_takes_each_batch_once_and_never_one_the_lineage_trained(caplog):
    """The writer's own part first; a part without tokens, one repeating a batch an earlier part named (it
    waits for the next step) and one naming a batch the lineage already trained are left out."""
    ids = [bytes([i]) * 16 for i in range(6)]

    def part(key: bytes, batch: list[int], tokens: int = 5) -> Contributed:
        return Contributed(key * 32, 3, [ids[i] for i in batch], tokens, 1.0, {} if tokens else None)

    own, empty = part(b"a", [0, 1]), part(b"b", [], tokens=0)
    again, trained, fresh = part(b"c", [1, 2]), part(b"d", [3, 4]), part(b"e", [5])
    lineage = {ids[4]}
    chosen = parts_for_step([own, empty, again, trained, fresh], lambda xs: lineage & set(xs))
    assert chosen == [own, fresh]
    assert "part names batches the lineage trained" in caplog.text
    assert parts_for_step([again, own], lambda xs: set()) == [again]  # whichever came first
