"""Tiny Llama checkpoints built on the fly, so that tests download nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<eos>"


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Token i is the word `w{i}` (id 0 is EOS); text is words separated by spaces."""
    vocab = {EOS: 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, unk_token=EOS)


def tiny_llama(
    vocab_size: int, seed: int, hidden: int = 32, layers: int = 2, max_context: int = 256, init_range: float = 0.2
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_context,
        initializer_range=init_range,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def perturbed_copy(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with the target most of the time: its weights plus a little noise."""
    copy = LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in copy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return copy


@dataclass(frozen=True)
class TinyPair:
    target: Path
    close_draft: Path  # agrees with the target often
    random_draft: Path  # almost never agrees
    vocab_size: int


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_pair(root: Path, vocab_size: int = 96, max_context: int = 256) -> TinyPair:
    tokenizer = word_tokenizer(vocab_size)
    target = tiny_llama(vocab_size, seed=1, hidden=48, layers=3, max_context=max_context)
    close = perturbed_copy(target, scale=0.02, seed=2)
    random_draft = tiny_llama(vocab_size, seed=3, hidden=16, layers=1, max_context=max_context)
    return TinyPair(
        target=save(target, tokenizer, root / "target"),
        close_draft=save(close, tokenizer, root / "close_draft"),
        random_draft=save(random_draft, tokenizer, root / "random_draft"),
        vocab_size=vocab_size,
    )
