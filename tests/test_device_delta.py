"""Deltas found on the tensors' device (peer/learner/device_delta.py): the very bytes of the numpy encoder."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from heterorl.peer.learner.device_delta import device_delta, word_changes
from heterorl.protocol.wire.checkpoint import serialize_state_dict
from heterorl.protocol.wire.delta import (
    Change,
    DeltaError,
    apply_delta,
    encode_delta,
    file_order,
    pack_delta,
    read_header,
)

pytestmark = pytest.mark.fast


def _states(dtype: torch.dtype, device: str = "cpu") -> tuple[dict, dict]:
    """A parent and a child in ``dtype``: a tied pair that moves, a tensor that stays, one where every word
    changes, a 0-dim and a 1-element tensor, an integer buffer; the child moves ~1/4 of the rest."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(40, 8, generator=g).to(dtype)
    parent = {
        "model.embed.weight": emb,
        "lm_head.weight": emb,  # tied: one storage, two names
        "layer.weight": torch.randn(33, 17, generator=g).to(dtype),
        "frozen.weight": torch.randn(50, generator=g).to(dtype),
        "all.weight": torch.randn(64, generator=g).to(dtype),
        "scale": torch.tensor(0.5, dtype=dtype),
        "one": torch.ones(1, dtype=dtype),
        "steps": torch.arange(-3, 5, dtype=torch.int64),
    }
    child = {k: v.clone() for k, v in parent.items()}
    bump = lambda t: t + (torch.rand(t.shape, generator=g) < 0.25) * torch.randn(t.shape, generator=g)  # noqa: E731
    new_emb = bump(emb.float()).to(dtype)
    child["model.embed.weight"] = child["lm_head.weight"] = new_emb
    child["layer.weight"] = bump(parent["layer.weight"].float()).to(dtype)
    child["all.weight"] = (-parent["all.weight"].float() - 1).to(dtype)  # every word, some up, some down
    child["scale"] = torch.tensor(-2.0, dtype=dtype)
    child["steps"] = parent["steps"] - 7  # 64-bit words that wrap below zero
    move = lambda s: {k: v.to(device) for k, v in s.items()}  # noqa: E731
    tied = {**move(parent)}
    tied["lm_head.weight"] = tied["model.embed.weight"]  # .to(device) copies: tie them again there
    ctied = move(child)
    ctied["lm_head.weight"] = ctied["model.embed.weight"]
    return tied, ctied


def _check_same_bytes(dtype: torch.dtype, device: str) -> None:
    parent, child = _states(dtype, device)
    pa, pb = serialize_state_dict(parent), serialize_state_dict(child)
    expected = encode_delta(pa, pb)
    got = device_delta(parent, child, hashlib.sha256(pa).digest(), file_order(pb))
    assert got == expected
    assert apply_delta(pa, got) == pb
    _, entries, _ = read_header(got)
    by_name = {e[0]: e for e in entries}
    assert "frozen.weight" not in by_name  # unchanged: not listed
    assert by_name["all.weight"][1] == 64 and by_name["scale"][1] == 1 and by_name["steps"][1] == 8
    assert by_name["model.embed.weight"][2] == "lm_head.weight"  # the tie travels once (file order: name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_device_delta_is_byte_for_byte_the_numpy_delta(dtype):
    _check_same_bytes(dtype, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_delta_on_cuda_is_byte_for_byte_the_numpy_delta(dtype):
    _check_same_bytes(dtype, "cuda")


def test_untied_copies_alias_as_in_the_numpy_path_and_no_change_is_an_empty_delta():
    parent, child = _states(torch.bfloat16)
    parent["lm_head.weight"] = parent["lm_head.weight"].clone()  # equal values, separate storage
    child["lm_head.weight"] = child["lm_head.weight"].clone()
    pa, pb = serialize_state_dict(parent), serialize_state_dict(child)
    assert device_delta(parent, child, hashlib.sha256(pa).digest(), file_order(pb)) == encode_delta(pa, pb)
    same = device_delta(parent, parent, hashlib.sha256(pa).digest(), file_order(pa))
    assert same == encode_delta(pa, pa) and read_header(same)[1] == []


def test_differences_wrap_at_the_word_size():
    old = torch.tensor([0, -1, 0x7FFF, -0x8000, 5], dtype=torch.int16)
    new = torch.tensor([-1, 0, -0x8000, 0x7FFF, 5], dtype=torch.int16)
    idx, diff = word_changes(old, new)
    assert idx.tolist() == [0, 1, 2, 3] and diff.dtype == np.uint16
    assert diff.tolist() == [0xFFFF, 1, 1, 0xFFFF]  # one down, one up, across the sign edges
    i32 = torch.tensor([2**31 - 1, -(2**31)], dtype=torch.int32)
    idx, diff = word_changes(i32, i32.flip(0))
    assert diff.dtype == np.uint32 and diff.tolist() == [1, 2**32 - 1]
    idx, diff = word_changes(torch.tensor([True, False]), torch.tensor([False, False]))
    assert idx.tolist() == [0] and diff.tolist() == [255]


def test_states_that_do_not_match_are_refused():
    parent, child = _states(torch.bfloat16)
    sha, order = bytes(32), file_order(serialize_state_dict(parent))
    with pytest.raises(DeltaError, match="publish in full"):
        device_delta(parent, {**child, "extra": torch.zeros(2)}, sha, order)
    with pytest.raises(DeltaError, match="publish in full"):
        device_delta(parent, child, sha, order[1:])
    with pytest.raises(DeltaError, match="shape, dtype"):
        device_delta(parent, {**child, "one": torch.ones(1)}, sha, order)


def test_pack_delta_refuses_what_no_finder_makes():
    ok = Change("t", 2, 10, np.array([1, 4]), np.array([1, 2], dtype=np.uint16))
    assert read_header(pack_delta(bytes(32), [ok]))[1] == [["t", 2, ""]]
    for bad in (
        ok._replace(index=np.array([4, 1])),  # not increasing
        ok._replace(index=np.array([1, 10])),  # past the end
        ok._replace(diff=np.array([1], dtype=np.uint16)),  # unpaired
    ):
        with pytest.raises(ValueError):
            pack_delta(bytes(32), [bad])
    with pytest.raises(ValueError, match="32-byte"):
        pack_delta(b"short", [ok])
