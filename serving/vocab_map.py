"""The tokens two tokenizers share, by their bytes: the ground of a draft with another tokenizer
(token-level intersection, Timor et al., ICML 2025; docs/design.md, "Drafts with another tokenizer").

A token's bytes are what it adds to the text:
- byte-level BPE (GPT-2, Llama 3, Qwen): each character of the token stands for one byte
  (`bytes_to_unicode`), so Ġ is a space and Ċ a newline;
- SentencePiece-style (Llama 2, Mistral, Gemma; a `Metaspace` or `Replace("▁", " ")` decoder): ▁ is
  a space and `<0xNN>` the byte NN (byte fallback); the rest is the piece's UTF-8.
Tokens that are partial UTF-8 (a lone byte of a character) are bytes like any other, so `<0xE2>`
meets the byte-level token for byte 0xE2. Special tokens (control tokens, chat markers) are never
shared, nor are tokens added to a vocabulary (a tokenizer's decode treats them apart from its pieces);
the end of sequence is mapped explicitly, one EOS to the other. Where one side has several ids for the
same bytes (SentencePiece's `<0x65>` and its piece `e`), the piece stands for them (the tokenizer
writes `e` with it, never with the byte), else the lowest id, so that the map is a bijection.

The map is built once at start and checked against each tokenizer's own decode on a sample of
tokens, decoded after a fixed token so that a SentencePiece decoder's dropped leading space shows.
"""

from __future__ import annotations

import inspect
import json
import random
import re
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_METASPACE = "\u2581"
# Tokens of each tokenizer whose bytes are checked against its own decode.
_CHECKED_TOKENS = 2000


class VocabularyError(ValueError):
    """A tokenizer whose tokens' bytes cannot be read, or a pair that shares too little."""


def _kind(tokenizer: PreTrainedTokenizerBase) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise VocabularyError(f"{_name(tokenizer)} is not a fast tokenizer: its tokens' bytes cannot be read")
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {part.get("type") for part in parts}
    if "ByteLevel" in types:
        return "byte_level"
    replaces_metaspace = any(
        part.get("type") == "Replace" and (part.get("pattern") or {}).get("String") == _METASPACE for part in parts
    )
    if "Metaspace" in types or replaces_metaspace:
        return "sentencepiece"
    raise VocabularyError(
        f"{_name(tokenizer)} has a {decoder.get('type') or 'missing'} decoder; a draft with another tokenizer needs "
        "byte-level BPE or SentencePiece-style (Metaspace) tokenizers on both sides"
    )


def _name(tokenizer: PreTrainedTokenizerBase) -> str:
    return repr(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    special = set(tokenizer.all_special_ids)
    special.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return special


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> dict[int, bytes]:
    """Each ordinary token's bytes (special and added tokens left out), checked against the tokenizer's
    decode. Raises VocabularyError for a tokenizer of another kind, or one whose decode disagrees."""
    kind = _kind(tokenizer)
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    left_out = _special_ids(tokenizer) | set(tokenizer.added_tokens_decoder)
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    table: dict[int, bytes] = {}
    for token, token_id in vocab.items():
        if token_id in left_out:
            continue
        if kind == "byte_level":
            if not all(char in to_byte for char in token):
                raise VocabularyError(f"{_name(tokenizer)}: token {token!r} is not byte-level")
            table[token_id] = bytes(to_byte[char] for char in token)
        else:
            match = _BYTE_PIECE.match(token)
            table[token_id] = bytes([int(match[1], 16)]) if match else token.replace(_METASPACE, " ").encode()
    _check(tokenizer, table)
    return table


def _check(tokenizer: PreTrainedTokenizerBase, table: dict[int, bytes]) -> None:
    """Each sampled token, decoded after an anchor token of plain letters, adds its bytes' text (only
    tokens that are whole UTF-8 are compared: a partial one decodes to a replacement character)."""
    anchor = next(
        (i for i, b in sorted(table.items()) if len(b) > 1 and b.isascii() and b.decode().isalpha()),
        None,
    )
    if anchor is None:
        return
    anchor_text = tokenizer.decode([anchor], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    ids = sorted(table)
    for token_id in random.Random(0).sample(ids, min(len(ids), _CHECKED_TOKENS)):
        try:
            want = table[token_id].decode("utf-8")
        except UnicodeDecodeError:
            continue
        text = tokenizer.decode([anchor, token_id], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if text != anchor_text + want:
            raise VocabularyError(
                f"{_name(tokenizer)}: token {token_id} decodes as {text[len(anchor_text) :]!r} after another token, "
                f"but its bytes read {want!r}; its tokenizer is not one whose bytes can be read"
            )


@dataclass(frozen=True)
class VocabMap:
    """Ids of the tokens both tokenizers share, one to one; and the EOS of each."""

    draft_to_target: dict[int, int]
    target_eos: int | None
    draft_eos: int | None
    target_name: str
    draft_name: str

    @property
    def target_to_draft(self) -> dict[int, int]:
        return {target: draft for draft, target in self.draft_to_target.items()}

    @property
    def proposable(self) -> dict[int, int]:
        """Draft id to target id for every token the draft may propose: the shared ones and the EOS."""
        mapping = dict(self.draft_to_target)
        if self.draft_eos is not None and self.target_eos is not None:
            mapping[self.draft_eos] = self.target_eos
        return mapping

    def overlap(self, target_ids: list[int]) -> float:
        """The share of a text's target tokens that the draft can propose (the EOS included)."""
        shared = set(self.proposable.values())
        return sum(i in shared for i in target_ids) / max(1, len(target_ids))


def ids_by_bytes(tokenizer: PreTrainedTokenizerBase, table: dict[int, bytes] | None = None) -> dict[bytes, int]:
    """Bytes to the id that stands for them: a piece before a byte-fallback token, then the lowest id
    (`table`: the tokenizer's `token_bytes`, when already read)."""
    table = token_bytes(tokenizer) if table is None else table
    tokens = tokenizer.convert_ids_to_tokens(sorted(table))
    order = sorted(zip(sorted(table), tokens, strict=True), key=lambda it: (bool(_BYTE_PIECE.match(it[1])), it[0]))
    index: dict[bytes, int] = {}
    for token_id, _ in order:
        index.setdefault(table[token_id], token_id)
    return index


def spell_longest(data: bytes, index: dict[bytes, int], longest: int) -> list[int]:
    """`data` in the ids of `index` (bytes -> id, its longest key `longest` bytes): the longest token at
    each point, left to right; a byte no token holds is left out."""
    ids: list[int] = []
    start = 0
    while start < len(data):
        for end in range(min(len(data), start + longest), start, -1):
            token = index.get(data[start:end])
            if token is not None:
                ids.append(token)
                start = end
                break
        else:
            start += 1
    return ids


def intersect(
    target: PreTrainedTokenizerBase,
    draft: PreTrainedTokenizerBase,
    target_index: dict[bytes, int] | None = None,
    draft_index: dict[bytes, int] | None = None,
) -> VocabMap:
    """The tokens both share by bytes, and the EOS of each (the `ids_by_bytes` indexes, when already read)."""
    target_index = ids_by_bytes(target) if target_index is None else target_index
    draft_index = ids_by_bytes(draft) if draft_index is None else draft_index
    shared = {draft_index[b]: target_index[b] for b in draft_index.keys() & target_index.keys() if b}
    return VocabMap(shared, target.eos_token_id, draft.eos_token_id, _name(target), _name(draft))


def reference_text() -> str:
    """A reference text every Python install has, prose and code: the standard library's own
    docstrings and source of a fixed list of modules (about 200 kB)."""
    import argparse
    import collections
    import json as json_module
    import textwrap

    return "\n\n".join(inspect.getsource(module) for module in (argparse, collections, json_module, textwrap))


def check_overlap(pair: VocabMap, target: PreTrainedTokenizerBase, floor: float) -> float:
    """The pair's overlap over the reference text, weighted by how often the target uses each token;
    VocabularyError below `floor`."""
    ids = target.backend_tokenizer.encode(reference_text(), add_special_tokens=False).ids
    overlap = pair.overlap(ids)
    if overlap < floor:
        raise VocabularyError(
            f"draft tokenizer {pair.draft_name} shares {overlap:.0%} of target tokenizer {pair.target_name}'s tokens "
            f"(weighted by use over a reference text), below the floor of {floor:.0%}: choose a draft whose "
            "tokenizer covers more of the target's, or lower the floor"
        )
    return overlap


def main(argv: list[str] | None = None) -> None:
    """`python -m serving.vocab_map TARGET DRAFT`: how much two tokenizers share (local paths or hub ids)."""
    import argparse

    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--floor", type=float, default=0.0, help="exit 1 below this overlap")
    args = parser.parse_args(argv)
    target, draft = AutoTokenizer.from_pretrained(args.target), AutoTokenizer.from_pretrained(args.draft)
    try:
        pair = intersect(target, draft)
        overlap = check_overlap(pair, target, args.floor)
    except VocabularyError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(
        f"{len(pair.draft_to_target):,} tokens shared by bytes (target {len(token_bytes(target)):,} ordinary tokens, "
        f"draft {len(token_bytes(draft)):,}); EOS {pair.draft_eos} -> {pair.target_eos}; "
        f"overlap weighted by the target's use over the reference text: {overlap:.1%}"
    )


if __name__ == "__main__":
    main()
