"""Bad inputs to the objectives get a clear ValueError, never a silent wrong loss."""

import pytest
import torch

from heterorl.peer import objectives as obj

pytestmark = pytest.mark.fast  # in `make test-fast`


def _batch(b=4, t=3):
    lp = -torch.rand(b, t) - 0.1
    return lp, lp.clone(), torch.ones(b, t), torch.randn(b), torch.tensor([0, 0, 1, 1])[:b]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: {**a, "logq": a["logq"][:, :2]}, "logq must have"),
        (lambda a: {**a, "mask": a["mask"][:3]}, "mask must have"),
        (lambda a: {**a, "advantages": a["advantages"][:3]}, "advantages must have"),
        (lambda a: {**a, "group_ids": a["group_ids"][:3]}, "group_ids must have"),
        (lambda a: {**a, "logp": a["logp"][0]}, r"logp must be \[B,T\]"),
    ],
)
def test_shape_errors(mutate, match):
    lp, lq, m, adv, g = _batch()
    args = mutate({"logp": lp, "logq": lq, "mask": m, "advantages": adv, "group_ids": g})
    with pytest.raises(ValueError, match=match):
        obj.compute("gepo", **args)


def test_nonfinite_behaviour_logprobs_and_advantages_are_rejected():
    lp, lq, m, adv, g = _batch()
    bad = lq.clone()
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="logq has non-finite"):
        obj.compute("grpo", lp, bad, m, adv, g)
    bad_adv = adv.clone()
    bad_adv[0] = float("inf")
    with pytest.raises(ValueError, match="advantages must be finite"):
        obj.compute("grpo", lp, lq, m, bad_adv, g)


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("gepo", {"group_scope": "galaxy"}, "group_scope"),
        ("gepo", {"defensive_lambda": 1.5}, "defensive_lambda"),
        ("gepo", {"defensive_schedule": "moon"}, "defensive_schedule"),
        ("gepo", {"defensive_sampling": True}, "needs the staleness"),
        ("grpo", {"clip": -0.1}, "clip epsilons"),
        ("grpo", {"clip": "wide"}, "clip must be"),
        ("grpo", {"dual_clip": 0.5}, "dual_clip"),
        ("grpo", {"aggregation": "median"}, "unknown aggregation"),
        ("topr", {"clip": 0.0}, "truncation level"),
    ],
)
def test_bad_params(name, params, match):
    lp, lq, m, adv, g = _batch()
    with pytest.raises(ValueError, match=match):
        obj.compute(name, lp, lq, m, adv, g, **params)


@pytest.mark.parametrize("name", ["gepo", "gspo", "gmpo", "topr"])
def test_sequence_objectives_refuse_token_advantages(name):
    lp, lq, m, _, g = _batch()
    with pytest.raises(ValueError, match="advantages must have shape"):
        obj.compute(name, lp, lq, m, torch.randn(4, 3), g)


def test_advantage_input_errors():
    with pytest.raises(ValueError, match="unknown advantage"):
        obj.advantages("ppo", torch.ones(2), torch.zeros(2))
    with pytest.raises(ValueError, match="rewards must be finite"):
        obj.advantages("grpo", torch.tensor([1.0, float("nan")]), torch.zeros(2))
    with pytest.raises(ValueError, match="r_max > r_min"):
        obj.advantages("bnpo", torch.ones(2), torch.zeros(2), r_min=1.0, r_max=1.0)
