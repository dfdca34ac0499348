"""Tiny Llama checkpoints built on the fly, so that tests download nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bench.cross_pair import sentencepiece_tokenizer
from serving.vocab_map import reference_text, token_bytes

EOS = "<eos>"


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Token i is the word `w{i}` (id 0 is EOS); text is words separated by spaces."""
    vocab = {EOS: 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, unk_token=EOS)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE without merges: token i < 256 is byte i, 256 is EOS. llguidance reads it (it
    cannot read the word tokenizer's WordPiece decoder), and every string has one tokenization, so a
    constrained output distribution can be enumerated exactly."""
    byte_vocab = {char: i for i, char in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    # ByteLevel's alphabet maps byte b to a printable character; order the vocabulary by byte value.
    by_byte = {b: char for char, b in _byte_chars().items()}
    vocab = {by_byte[b]: b for b in range(256)}
    assert set(vocab) == set(byte_vocab)
    vocab[EOS] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, unk_token=EOS)


def byte_level_bpe(vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's kind) trained on the standard library's source; EOS <|endoftext|> is 0."""
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(
        [reference_text()[:60_000], "naïve café — “quoted” ✓"], vocab_size=vocab_size, special_tokens=["<|endoftext|>"]
    )
    return PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer, eos_token="<|endoftext|>")


def sentencepiece_from(byte_level: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Metaspace, byte fallback) sharing part of `byte_level`'s
    vocabulary: a piece for every third of its tokens (bench/cross_pair.py's layout)."""
    return sentencepiece_tokenizer(byte_level, sorted(token_bytes(byte_level))[::3])


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte-to-character table (ByteLevel's): printable bytes stand for themselves."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def tiny_llama(
    vocab_size: int,
    seed: int,
    hidden: int = 32,
    layers: int = 2,
    max_context: int = 256,
    init_range: float = 0.2,
    eos: int = 0,
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
        eos_token_id=eos,
        bos_token_id=eos,
        pad_token_id=eos,
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


def build_pair(
    root: Path, vocab_size: int = 96, max_context: int = 256, tokenizer: PreTrainedTokenizerFast | None = None
) -> TinyPair:
    tokenizer = tokenizer or word_tokenizer(vocab_size)
    eos = tokenizer.eos_token_id
    target = tiny_llama(vocab_size, seed=1, hidden=48, layers=3, max_context=max_context, eos=eos)
    close = perturbed_copy(target, scale=0.02, seed=2)
    random_draft = tiny_llama(vocab_size, seed=3, hidden=16, layers=1, max_context=max_context, eos=eos)
    return TinyPair(
        target=save(target, tokenizer, root / "target"),
        close_draft=save(close, tokenizer, root / "close_draft"),
        random_draft=save(random_draft, tokenizer, root / "random_draft"),
        vocab_size=vocab_size,
    )


def build_byte_pair(root: Path, max_context: int = 512) -> TinyPair:
    """The tiny pair over `byte_tokenizer` (257 tokens; EOS is 256), for structured outputs. Its model's
    vocabulary is wider than the tokenizer (264): the mask is the logits' width, not the tokenizer's."""
    return build_pair(root, vocab_size=264, max_context=max_context, tokenizer=byte_tokenizer())
