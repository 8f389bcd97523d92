"""The compressed exchange's codec: top-k of each chunk, 2-bit values, 12-bit indices, local error feedback
(peer/learner/compress.py) and its frame (protocol/wire/sparse_gradient.py): the bytes round-trip to what the
sender meant, error feedback loses nothing (it only delays), a frame's size is fixed by the model, and a
hostile frame is refused with the reason before anything is decoded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from heterorl.peer.learner.compress import ErrorFeedback, compress, flatten, unflatten
from heterorl.protocol.wire.errors import ProtocolError
from heterorl.protocol.wire.sparse_gradient import (
    CHUNK,
    DEFAULT_K,
    decode_frame,
    frame_size,
    pack_frame,
    unpack_frame,
)

pytestmark = pytest.mark.fast


def test_a_frame_round_trips_to_the_values_the_sender_meant():
    torch.manual_seed(0)
    x = torch.randn(3 * CHUNK + 123)  # the last chunk padded
    sent = compress(x)
    frame = sent.frame()
    assert len(frame) == frame_size(x.numel()) == 4 * (8 + DEFAULT_K * 3 // 2 + DEFAULT_K // 4)
    assert torch.equal(decode_frame(frame, x.numel()), sent.dense)
    assert int((sent.dense != 0).sum()) == 4 * DEFAULT_K
    big = 1_000 * CHUNK
    assert frame_size(big) / (4 * big) < 0.005  # <= 0.5 % of dense float32 bytes: 256x fewer


def test_each_chunk_sends_its_k_largest_values_as_sign_and_one_of_two_magnitudes():
    torch.manual_seed(1)
    x = torch.randn(2 * CHUNK)
    sent = compress(x, k=8)
    for c in range(2):
        chunk = x[c * CHUNK : (c + 1) * CHUNK]
        top = set(torch.topk(chunk.abs(), 8).indices.tolist())
        assert set(sent.indices[c].tolist()) == top
        mags = sorted(chunk.abs()[list(top)].tolist())
        lo, hi = sent.scales[c]
        assert lo == pytest.approx(sum(mags[:4]) / 4, rel=1e-6) and hi == pytest.approx(sum(mags[4:]) / 4)
        got = sent.dense[c * CHUNK : (c + 1) * CHUNK]
        for i in top:
            assert torch.sign(got[i]) == torch.sign(chunk[i]) and float(got[i].abs()) in (
                pytest.approx(lo),
                pytest.approx(hi),
            )
        assert float(got.abs().sum()) == pytest.approx(sum(mags), rel=1e-5)  # the magnitude is kept


def test_error_feedback_loses_nothing_it_only_delays():
    torch.manual_seed(2)
    n = 2 * CHUNK
    fb = ErrorFeedback(n, k=4)
    total, sent = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for _ in range(30):
        g = torch.randn(n)
        total += g.double()
        sent += fb.step(g).dense.double()
    assert torch.allclose(sent + fb.residual.double(), total, atol=1e-4)
    # a small steady value, never among one step's top-k, is sent once the residual has grown
    fb = ErrorFeedback(CHUNK, k=4)
    g = torch.zeros(CHUNK)
    g[:4] = 1.0
    g[100] = 0.3
    steps = [fb.step(g).dense for _ in range(8)]
    assert float(steps[0][100]) == 0.0 and any(float(s[100]) != 0.0 for s in steps)


def test_flatten_and_unflatten_follow_the_schema():
    schema = (("a", (2, 3)), ("b", (4,)))
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    v = flatten(tensors, schema)
    assert v.tolist() == [0, 1, 2, 3, 4, 5, 1, 1, 1, 1]
    back = unflatten(v, schema)
    assert all(torch.equal(back[n], tensors[n]) for n in tensors)
    with pytest.raises(ValueError, match="shape"):
        flatten({"a": torch.zeros(3, 2), "b": torch.ones(4)}, schema)
    with pytest.raises(ValueError, match="schema"):
        unflatten(torch.zeros(11), schema)


def _good(numel: int = 2 * CHUNK, k: int = 8, chunk: int = CHUNK):
    torch.manual_seed(3)
    sent = compress(torch.randn(numel), k=k, chunk=chunk)
    return sent.indices.copy(), sent.codes.copy(), sent.scales.copy()


@pytest.mark.parametrize(
    ("spoil", "match"),
    [
        (lambda i, c, s: (i, c, s.__setitem__((0, 1), np.nan) or s), "not finite"),
        (lambda i, c, s: (i, c, s.__setitem__((1, 0), np.inf) or s), "not finite"),
        (lambda i, c, s: (i, c, s.__setitem__((0, 0), -1.0) or s), "lo <= hi"),
        (lambda i, c, s: (i, c, s.__setitem__((1, 0), s[1, 1] * 2) or s), "lo <= hi"),
        (lambda i, c, s: (i.__setitem__((0, 1), i[0, 0]) or i, c, s), "strictly increasing"),
        (lambda i, c, s: (i[:, ::-1].copy(), c, s), "strictly increasing"),
    ],
)
def test_a_hostile_frame_is_refused_saying_why(spoil, match):
    frame = pack_frame(*spoil(*_good()))
    with pytest.raises(ProtocolError, match=match):
        decode_frame(frame, 2 * CHUNK, k=8)


def test_a_frame_of_another_size_or_an_index_past_a_short_chunk_is_refused():
    frame = pack_frame(*_good())
    for wrong in (frame[:-1], frame + b"\0", b""):
        with pytest.raises(ProtocolError, match="bytes"):
            decode_frame(wrong, 2 * CHUNK, k=8)
    # chunks of 1 024: a 12-bit index can point past them
    indices, codes, scales = _good(2 * 1024, chunk=1024)
    indices = np.sort(indices % 1024, axis=1)
    indices[:, -1] = 1500
    with pytest.raises(ProtocolError, match="past its chunk"):
        unpack_frame(pack_frame(indices, codes, scales), 2 * 1024, k=8, chunk=1024)
    with pytest.raises(ValueError, match="multiple of 4"):
        frame_size(100, k=6)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=frame_size(CHUNK + 5, 8), max_size=frame_size(CHUNK + 5, 8)))
def test_any_bytes_of_the_right_size_decode_to_finite_values_or_are_refused(data):
    try:
        dense = decode_frame(data, CHUNK + 5, k=8)
    except ProtocolError:
        return
    assert dense.shape == (CHUNK + 5,) and torch.isfinite(dense).all()
    assert int((dense != 0).sum()) <= 2 * 8
