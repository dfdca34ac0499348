"""The batched forward over resident slots computes each session's own logits, for any mix of rows,
in the Llama, Qwen2 and GPT-2 families; an architecture it cannot serve falls back to one session per
forward."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from model_host.forward import BatchedForward, SerialForward, choose_forward
from model_host.kv_slots import Row, SlotStore
from tests.tiny_models import tiny_llama


def _models() -> dict:
    torch.manual_seed(0)
    qwen = Qwen2Config(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    gpt2 = GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return {
        "llama": tiny_llama(96, seed=1, hidden=48, layers=3),
        "qwen2": Qwen2ForCausalLM(qwen).eval(),
        "gpt2": GPT2LMHeadModel(gpt2).eval(),
    }


def _store(model) -> SlotStore:
    return SlotStore(torch.device("cpu"), torch.float32, model.config.max_position_embeddings)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_random_batches_match_each_sessions_own_forward(family, attention):
    model = _models()[family]
    model.config._attn_implementation = attention
    vocab = model.get_output_embeddings().weight.shape[0]
    forward = choose_forward(model, _store(model))
    assert isinstance(forward, BatchedForward)
    rng = random.Random(1)
    sequences: dict[int, list[int]] = {slot: [] for slot in range(6)}
    with torch.inference_mode():
        for _ in range(40):
            rows = []
            for slot in sorted(rng.sample(range(6), rng.randrange(1, 6))):
                sequence = sequences[slot]
                if rng.random() < 0.1 or len(sequence) > 90:
                    sequence.clear()  # the slot goes to a new session
                else:
                    del sequence[max(0, len(sequence) - rng.randrange(0, 4)) :]  # a rollback
                new = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 3, 5, 9]))]
                rows.append(Row(slot, len(sequence), new, rng.randrange(0, len(new) + 1)))
                sequence += new
            for row, logits in zip(rows, forward(rows), strict=True):
                if row.num_logits:
                    want = model(torch.tensor([sequences[row.slot]])).logits[0, -row.num_logits :]
                    assert logits is not None and torch.allclose(logits, want, atol=1e-4)


def test_storage_is_finite_where_nothing_was_written():
    """A batch reads every row's window up to its longest row; masked positions must hold finite values
    (attention turns a masked NaN into a NaN output)."""
    model = _models()["llama"]
    store = _store(model)
    forward = BatchedForward(model, store)
    with torch.inference_mode():
        forward([Row(0, 0, [1, 2, 3], 1)])
        forward([Row(9, 0, list(range(1, 60)) * 4, 1)])  # grows slots and capacity
        with pytest.raises(ValueError):
            store.ensure(10, 300)  # beyond the context: refused, never grown
    for tensor in [*store.keys.values(), *store.values.values()]:
        assert torch.isfinite(tensor).all()
        assert tensor[1:9].abs().sum() == 0  # untouched slots stay zero


class _PositionBlind(LlamaForCausalLM):
    """An architecture the batched pass cannot serve: it ignores the positions it is given."""

    def forward(self, *args, position_ids=None, attention_mask=None, **kwargs):  # type: ignore[override]
        return super().forward(*args, **kwargs)


def test_an_unservable_architecture_falls_back_to_one_session_per_forward():
    base = tiny_llama(96, seed=1, hidden=48, layers=2)
    model = _PositionBlind(base.config).eval()
    model.load_state_dict(base.state_dict())
    forward = choose_forward(model, _store(model))
    assert isinstance(forward, SerialForward) and not forward.batched
    with torch.inference_mode():
        first = forward([Row(0, 0, [5, 6, 7], 1), Row(1, 0, [8, 9], 1)])
        again = forward([Row(0, 2, [7, 4], 2)])  # a rollback by one, then two tokens
    assert first[1] is not None and again[0] is not None
    assert torch.allclose(first[1], model(torch.tensor([[8, 9]])).logits[0, -1:], atol=1e-5)
    assert torch.allclose(again[0], model(torch.tensor([[5, 6, 7, 4]])).logits[0, -2:], atol=1e-5)
