"""The learner peers' step in parts: each learner's gradient, the writer's bounded reduction (each part
clipped, weighed by the tokens of its batches), the writer's AdamW step turned into an update, and that update
added by every learner. Replicas that add the same update bytes must end bit-identical whatever optimiser
kernel and thread count each runs: the lineage's one-set-of-weights-per-version rests on it."""

from __future__ import annotations

import pytest
import torch
from test_trainer import buffered, options

from heterorl.peer.learner.combine import Accumulator, part_refusal, state_sha256
from heterorl.peer.learner.rows import rows_from_batches
from heterorl.peer.learner.trainer import Trainer
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


def test_the_step_is_the_token_weighted_mean_of_the_clipped_parts_and_refuses_what_is_not_finite():
    shapes = {"a": (3, 4), "b": (5,)}
    parts = [(tokens, grads(k, shapes), lr) for k, tokens, lr in ((3, 10, 1.0), (1, 30, 0.5), (2, 5, 1.0))]
    norms = [float(torch.cat([g[n].flatten() for n in shapes]).norm()) for _, g, _ in parts]
    clip = sorted(norms)[1]  # one part under the clip, two over it
    acc = Accumulator(clip)
    for tokens, g, lr in parts:
        acc.add(tokens, {n: t.clone() for n, t in g.items()}, lr)
    out, norm, lr = acc.result()
    total = sum(t for t, _, _ in parts)
    for n in shapes:  # float64 reference: each part clipped on its own, then weighed by its tokens
        each = zip(parts, norms, strict=True)
        scaled = [g[n].double() * min(1.0, clip / (nm + 1e-6)) * t for (t, g, _), nm in each]
        ref = sum(scaled) / total
        torch.testing.assert_close(out[n].double(), ref, atol=1e-6, rtol=0)
    assert norm <= clip * (1 + 1e-5)  # a mean of parts within the clip is within it
    assert lr == pytest.approx((10 * 1.0 + 30 * 0.5 + 5 * 1.0) / 45)
    assert acc.tokens == total and len(acc) == 3
    bad = Accumulator(0.0)  # no clip: a huge part overflows the sum
    bad.add(1, {"a": torch.full((2,), 3e38)})
    bad.add(1, {"a": torch.full((2,), 3e38)})
    with pytest.raises(ValueError, match="not finite"):
        bad.result()
    with pytest.raises(ValueError, match="no part"):
        Accumulator(1.0).result()


def test_a_part_is_bounded_by_its_batches():
    """Tokens are those of the batches a part names, each within what one batch of the run holds; a
    gradient needs batches and batches need a gradient; lr_scale at most 1; a batch named once."""
    b = lambda i, tokens: (bytes([i]) * 16, bytes([i]) * 32, tokens)  # noqa: E731
    assert part_refusal([b(1, 10), b(2, 64)], 1.0, True, batch_tokens=64) is None
    assert part_refusal([], 1.0, False, 64) is None  # an empty part: nothing to say
    assert "without batches" in part_refusal([], 1.0, True, 64)
    assert "without a gradient" in part_refusal([b(1, 10)], 1.0, False, 64)
    assert "65 tokens" in part_refusal([b(1, 65)], 1.0, True, 64)  # more than one batch of the run holds
    assert "twice" in part_refusal([b(1, 10), b(1, 10)], 1.0, True, 64)
    assert "lr_scale" in part_refusal([b(1, 10)], 1e6, True, 64)


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


def _adamw(kind: str):
    """One of torch's AdamW kernels: "fused" (the learner's), "foreach" or "loop" (the per-tensor one)."""

    def make(params, lr):
        opts = {"fused": dict(fused=True), "foreach": dict(foreach=True), "loop": dict(foreach=False)}[kind]
        return torch.optim.AdamW(list(params), lr=lr, weight_decay=0.0, **opts)

    return make


def test_a_member_on_another_adamw_kernel_stays_bit_identical_for_50_versions():
    """The writer (fused AdamW, 1 thread) commits the parameter update; a member running another AdamW
    implementation (the per-tensor loop, 2 threads) adds it: their float32 weights hash the same after every
    one of 50 versions, so no resync is ever needed. Applying the combined gradient through each one's own
    AdamW instead (what learners did before) forks within a few steps: the test can tell."""
    before = torch.get_num_threads()
    w = Trainer(model(), options(lr=1e-2), pad_id=0, optimizer=_adamw("fused"))
    m = Trainer(model(), options(lr=1e-2), pad_id=0, optimizer=_adamw("loop"))
    own = Trainer(model(), options(lr=1e-2), pad_id=0, optimizer=_adamw("loop"))  # its own AdamW: forks
    schema = parameter_schema(w.model.named_parameters())
    forked = None
    try:
        for step in range(50):
            torch.set_num_threads(1)
            g, _ = w.gradients(rows_from_batches(buffered(2, version=step), pad_id=0))
            acc = Accumulator(1.0)
            acc.add(8, g)
            combined, _, _ = acc.result()
            update = w.commit_update(combined)
            data, sha = encode_gradient({n: u.to(torch.float32) for n, u in update.items()})
            gdata, gsha = encode_gradient(combined)
            torch.set_num_threads(2)
            m.apply_update(decode_gradient(data, sha, schema), decode_gradient(gdata, gsha, schema), step + 1)
            assert m.version == w.version == step + 1
            assert state_sha256(m.named_trainable()) == state_sha256(w.named_trainable()), step
            for n, p in own.named_trainable():
                p.grad = combined[n].clone()
            own.optimizer.step()
            if forked is None and state_sha256(own.named_trainable()) != state_sha256(w.named_trainable()):
                forked = step
        assert forked is not None and forked < 10, forked
        # the member's moments came from the same gradients: it writes on with nearly the writer's steps
        for (_, p), (_, q) in zip(w.optimizer.state.items(), m.optimizer.state.items(), strict=True):
            torch.testing.assert_close(p["exp_avg_sq"], q["exp_avg_sq"], rtol=1e-4, atol=1e-10)
            assert float(p["step"]) == float(q["step"]) == 50
    finally:
        torch.set_num_threads(before)


def test_the_writers_update_is_its_adamw_step():
    """commit_update moves the writer as its own optimiser step would (up to the one float rounding of
    adding the update back), and a learner alone through the parts steps as Trainer.step does."""
    ref = Trainer(model(), options(lr=1e-2, grad_clip=1e9), pad_id=0)
    parts = Trainer(model(), options(lr=1e-2, grad_clip=1e9), pad_id=0)
    rows = rows_from_batches(buffered(2), pad_id=0)
    ref.step(rows)
    g, _ = parts.gradients(rows)
    parts.commit_update(g)
    for (n, p), (_, q) in zip(ref.named_trainable(), parts.named_trainable(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=n)


def test_a_joining_learner_takes_the_writers_weights_and_adamw_state_and_steps_identically():
    """state_bytes → load_state_bytes: the joiner's weights hash as the writer's, and the next update
    leaves both bit-identical; as a writer next, it takes the writer's own step (the moments came across).
    What does not fit the model is refused."""
    from heterorl.protocol import ProtocolError

    writer, joiner = Trainer(model(0), options(), pad_id=0), Trainer(model(1), options(), pad_id=0)
    for step in range(2):
        g, _ = writer.gradients(rows_from_batches(buffered(2, version=step), pad_id=0))
        writer.commit_update(g)
    weights, optimizer = writer.state_bytes()
    joiner.load_state_bytes(writer.version, weights, optimizer)
    assert joiner.version == writer.version == 2
    assert state_sha256(joiner.named_trainable()) == state_sha256(writer.named_trainable())
    g, _ = writer.gradients(rows_from_batches(buffered(3, version=2), pad_id=0))
    twin = Trainer(model(1), options(), pad_id=0)
    twin.load_state_bytes(2, weights, optimizer)
    update = writer.commit_update({n: t.clone() for n, t in g.items()})
    joiner.apply_update(update, g, 3)
    assert state_sha256(joiner.named_trainable()) == state_sha256(writer.named_trainable())
    twin.commit_update(g)  # the joiner as a writer: the same AdamW state, the same step
    assert state_sha256(twin.named_trainable()) == state_sha256(writer.named_trainable())
    other = Trainer(model(0, hidden=64), options(), pad_id=0)
    with pytest.raises(ProtocolError, match="shape|float32|parameters"):
        other.load_state_bytes(2, weights, optimizer)
    with pytest.raises(ProtocolError, match="safetensors"):
        joiner.load_state_bytes(2, b"garbage", optimizer)
