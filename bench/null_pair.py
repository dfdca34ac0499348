"""The near-null pair: a Llama of 1 layer and hidden size 32 with the default pair's tokenizer, as
both target and draft. A decode step costs about the same for 1 row as for 64 (0.90 ms and 1.77 ms in
Hugging Face `generate()` on this 2-core machine), the shape of a GPU's step: what remains of a
served step is the serving stack's own cost.

The tokenizer has no end-of-sequence token, so every request runs to max_new_tokens, as Hugging
Face's padded batch does with min_new_tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

DEFAULT_TOKENIZER = Path("default_models/pair/target")


def build_null_pair(folder: Path, tokenizer_source: Path = DEFAULT_TOKENIZER) -> Path:
    """Write folder/target and folder/draft (the same weights) once; returns `folder`."""
    target, draft = folder / "target", folder / "draft"
    if (draft / "config.json").exists():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    tokenizer.eos_token = None
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    partial = folder.with_name(folder.name + ".partial")  # renamed whole: a crash leaves no half-written pair
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial / "target")
    tokenizer.save_pretrained(partial / "target")
    shutil.copytree(partial / "target", partial / "draft")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    assert target.exists() and draft.exists()
    return folder
