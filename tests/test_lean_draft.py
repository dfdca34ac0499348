"""The draft's lean forward pass computes the model's own function, through prefill, steps and rollback."""

from __future__ import annotations

import random

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from draft_service.lean import LeanDraft
from draft_service.servicer import DraftServicer
from model_host.config import ModelServiceConfig
from tests.tiny_models import tiny_llama


def test_matches_hugging_face_forward_under_random_rollbacks():
    model = tiny_llama(96, seed=4, hidden=48, layers=3)  # grouped-query attention: 4 heads, 2 kv heads
    lean = LeanDraft.attach(model)
    assert lean is not None
    rng = random.Random(0)
    cache = lean.new_cache()
    sequence: list[int] = []
    with torch.inference_mode():
        for _ in range(40):
            keep = rng.randrange(0, len(sequence) + 1)
            cache.crop(keep - cache.length)
            sequence = sequence[:keep]
            new = [rng.randrange(96) for _ in range(rng.choice([1, 1, 2, 5]))]
            got = lean.forward(new, cache)
            sequence += new
            want = model(torch.tensor([sequence])).logits[0, -1]
            assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        assert cache.length == len(sequence)


def test_cache_grows_past_its_first_allocation():
    model = tiny_llama(64, seed=5, max_context=1024)
    lean = LeanDraft.attach(model)
    assert lean is not None
    cache = lean.new_cache()
    ids = list(range(1, 64)) * 8  # 504 tokens: past the first 256-token block
    with torch.inference_mode():
        got = lean.forward(ids, cache)
        want = model(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(got, want, atol=1e-4)


def test_fused_projections_keep_biases_and_the_models_own_forward():
    # Qwen2 has biases on its query, key and value projections; the lean pass fuses all three.
    torch.manual_seed(6)
    config = Qwen2Config(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    for layer in model.model.layers:
        for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(projection.bias, std=0.5)  # zero at initialisation: make them count
    ids = torch.randint(0, 80, (1, 20))
    with torch.inference_mode():
        before = model(ids).logits[0]
        lean = LeanDraft.attach(model)
        assert lean is not None
        assert torch.equal(model(ids).logits[0], before)
        cache = lean.new_cache()
        got = torch.stack([lean.forward(ids[0, :12].tolist(), cache), lean.forward(ids[0, 12:].tolist(), cache)])
    assert torch.allclose(got, before[[11, 19]], atol=1e-4)


def test_unsupported_architectures_keep_the_ordinary_forward():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2)).eval()
    assert LeanDraft.attach(gpt2) is None


def test_draft_service_uses_it_and_can_be_told_not_to(close_draft_model):
    assert DraftServicer(close_draft_model, ModelServiceConfig(model="x")).lean is not None
    assert DraftServicer(close_draft_model, ModelServiceConfig(model="x", lean_draft=False)).lean is None
