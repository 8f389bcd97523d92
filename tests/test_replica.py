"""ModelReplica: built once on first use, loads published states by the model's names (cast to its dtype,
tied weights kept tied, missing names kept, unknown ones refused), skips a tag it already holds; an adapter
run's published adapters load into a peft replica of the base."""

from __future__ import annotations

import threading

import pytest
import torch

from heterorl.peer.learner.replica import ModelReplica
from heterorl.peer.model.tiny import build_config

pytestmark = pytest.mark.fast  # in `make test-fast`

VOCAB = 40
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tiny(seed: int, dtype: torch.dtype = torch.float32):
    """A one-layer Llama with tied embeddings, its weights drawn from ``seed``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(build_config(VOCAB, hidden=16, layers=1)).to(dtype)


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def logits(model, ids=((3, 4, 5, 6),)) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits.float()


def counted(seed: int = 0, dtype: torch.dtype = torch.float32):
    calls: list[int] = []

    def factory():
        calls.append(1)
        return tiny(seed, dtype)

    return factory, calls


def test_the_model_is_built_once_on_first_use_for_reading_only():
    factory, calls = counted()
    replica = ModelReplica(factory)
    assert calls == [] and replica.builds == 0 and replica.tag is None  # nothing until used
    model = replica.model
    assert replica.model is model and replica.load(state(tiny(1)), 1) is model
    assert calls == [1] and replica.builds == 1
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_a_load_makes_the_replica_compute_what_the_source_computes_and_a_held_tag_is_not_reloaded():
    source, other = tiny(1), tiny(2)
    replica = ModelReplica(lambda: tiny(0))
    assert not torch.allclose(logits(replica.model), logits(source))
    replica.load(state(source), 1)
    assert torch.equal(logits(replica.model), logits(source)) and replica.tag == 1 and replica.loads == 1
    replica.load(state(other), 1)  # the same tag: taken as the same weights, not copied
    assert torch.equal(logits(replica.model), logits(source)) and replica.loads == 1
    replica.load(state(other), 2)
    assert torch.equal(logits(replica.model), logits(other)) and replica.tag == 2 and replica.loads == 2
    replica.load(state(source))  # no tag: always copied, and nothing is taken as held after it
    assert torch.equal(logits(replica.model), logits(source)) and replica.tag is None
    replica.load(state(other), 2)
    assert torch.equal(logits(replica.model), logits(other)) and replica.loads == 4
    replica.forget()
    assert replica.tag is None
    replica.load(state(other), 2)
    assert replica.loads == 5


@pytest.mark.parametrize("own,published", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_floating_weights_are_cast_to_the_replicas_own_dtype(own, published):
    source = tiny(1)
    weights = {k: v.to(published) for k, v in state(source).items()}
    replica = ModelReplica(lambda: tiny(0, own))
    model = replica.load(weights, 1)
    assert {p.dtype for p in model.parameters()} == {own}
    for name, t in model.state_dict().items():
        assert torch.equal(t, weights[name].to(own)), name


def test_tied_weights_stay_tied_whether_the_state_names_one_or_both():
    source = tiny(1)
    replica = ModelReplica(lambda: tiny(0))
    model = replica.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tiny model ties them
    replica.load(state(source), 1)  # both names, as a published state carries them
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, source.lm_head.weight)
    other = state(tiny(2))
    replica.load({EMBED: other[EMBED]}, 2)  # one name: the other follows
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, other[EMBED])


def test_names_missing_from_the_weights_keep_the_models_own():
    base, source = tiny(0), tiny(1)
    replica = ModelReplica(lambda: tiny(0))
    name = "model.layers.0.mlp.up_proj.weight"
    model = replica.load({name: source.state_dict()[name]}, 1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, (source if k == name else base).state_dict()[k]), k


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"model.layers.0.extra.weight": torch.zeros(2)}, "does not have"),
        ({HEAD: torch.zeros(VOCAB, 8)}, "shape"),
        ({HEAD: torch.zeros(VOCAB, 16, dtype=torch.long)}, "dtype"),
    ],
)
def test_weights_the_model_cannot_take_are_refused_and_the_model_is_untouched(bad, message):
    replica = ModelReplica(lambda: tiny(0))
    replica.load(state(tiny(1)), 1)
    before = state(replica.model)
    with pytest.raises(ValueError, match=message):
        replica.load({**state(tiny(2)), **bad}, 2)
    assert replica.tag == 1  # nothing was copied: it still holds version 1
    for k, v in replica.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_one_user_at_a_time():
    replica = ModelReplica(lambda: tiny(0))
    assert replica.model is not None  # built before the threads race
    loaded = threading.Event()

    def other():
        replica.load(state(tiny(2)), 2)
        loaded.set()

    with replica:
        replica.load(state(tiny(1)), 1)
        t = threading.Thread(target=other)
        t.start()
        assert not loaded.wait(0.3)  # waits while this user holds the replica
        assert replica.tag == 1
    t.join(5)
    assert loaded.is_set() and replica.tag == 2


def test_an_adapter_runs_published_adapters_load_into_a_peft_replica_of_the_base():
    from heterorl.peer.model.adapter import adapter_state, wrap
    from heterorl.protocol.settings import AdapterSettings

    settings = AdapterSettings(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"))
    trained = wrap(tiny(0), settings)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    published = adapter_state(trained)  # peft's saved names: ...lora_A.weight
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in published)
    replica = ModelReplica(lambda: wrap(tiny(0), settings))
    assert not torch.allclose(logits(replica.model), logits(trained))
    model = replica.load(published, 1)
    assert torch.allclose(logits(model), logits(trained), atol=1e-6)
    with pytest.raises(ValueError, match="does not have"):
        replica.load({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 16)}, 2)
