"""A draft with another tokenizer: token-level intersection (TLI; Timor et al., ICML 2025), across the
services and lossless at any temperature (docs/design.md, "Drafts with another tokenizer").

- The draft service proposes only the tokens both tokenizers share by bytes (`--target-tokenizer`: its
  logits are masked before the softmax, so q is exactly the distribution it drew from).
- Each drafted token is mapped to its target id here, and a draft row to the target's width (zeros at
  the target tokens the draft cannot propose). The usual rejection sampling then keeps the target's
  distribution: the draft is only a proposal whose support is smaller.
- The draft's session holds the request's text in the draft's ids: each target token is spelled in
  draft tokens (its shared id, else the longest draft tokens that spell its bytes), in order. The
  spelling of a sequence is the concatenation of its tokens' spellings, so a target prefix is always a
  draft prefix, and a rollback to a target position is a rollback to that prefix in draft ids: a split
  token is kept or dropped whole.

Greedy requests may instead draft by string-level exact match (SLEM, `--cross-greedy slem`): the
draft drafts from its whole vocabulary, its block's text is re-tokenized by the target's tokenizer
(`retokenized`), and the target keeps the tokens it would have produced, as for any greedy block.
Any proposal is exact under greedy verification; the re-tokenization only decides how many agree.

The spelling is not the draft tokenizer's own tokenization of the text (that would re-tokenize an
unstable tail at every round): a target token the draft does not share becomes the draft's longest
tokens for its bytes, which its own tokenizer might have merged differently with its neighbours. That
changes what the draft sees, so how often it agrees, never what the target outputs.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from orchestrator.context import Context
from serving.tensors import WireFormatError
from serving.vocab import tokenizer_fingerprint
from serving.vocab_map import VocabMap, ids_by_bytes, intersect, spell_longest, token_bytes


class Translation:
    """The pair's map between id spaces: built once at start, shared by every request."""

    def __init__(self, target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
        self.target, self.draft = target, draft
        target_bytes = token_bytes(target)
        self._draft_bytes = token_bytes(draft)
        draft_index = ids_by_bytes(draft, self._draft_bytes)
        self.pair: VocabMap = intersect(target, draft, ids_by_bytes(target, target_bytes), draft_index)
        self.draft_fingerprint = tokenizer_fingerprint(draft)
        self.to_target = self.pair.proposable  # draft id -> target id
        order = sorted(self.to_target)
        self._draft_ids = torch.tensor(order, dtype=torch.long)  # [shared]
        self._target_ids = torch.tensor([self.to_target[d] for d in order], dtype=torch.long)  # [shared]
        self._draft_index = draft_index
        self._longest = max(map(len, draft_index), default=1)
        # A target token's bytes: its own, or a special or added token's text (a chat marker is spelled
        # as the draft's tokens for that text); the BOS is the draft's BOS.
        self._target_bytes = dict(target_bytes)
        for token_id, added in target.added_tokens_decoder.items():
            self._target_bytes.setdefault(token_id, added.content.encode())
        self._spellings: dict[int, tuple[int, ...]] = {target_id: (d,) for d, target_id in self.to_target.items()}
        if target.bos_token_id is not None and draft.bos_token_id is not None:
            self._spellings[target.bos_token_id] = (draft.bos_token_id,)

    def spell(self, token: int) -> tuple[int, ...]:
        """A target token in draft ids: its shared id, else the longest draft tokens that spell its bytes,
        left to right (a byte no draft token holds is left out)."""
        spelled = self._spellings.get(token)
        if spelled is None:
            spelled = tuple(spell_longest(self._target_bytes.get(token, b""), self._draft_index, self._longest))
            self._spellings[token] = spelled
        return spelled

    def target_ids(self, draft_ids: list[int]) -> list[int]:
        """A drafted block in target ids; WireFormatError for a token the draft should not have proposed."""
        try:
            return [self.to_target[d] for d in draft_ids]
        except KeyError as exc:
            raise WireFormatError(
                f"the draft proposed token {exc.args[0]}, which the target's tokenizer does not share "
                "(is its --target-tokenizer the target's?)"
            ) from None

    def retokenized(self, draft_ids: list[int]) -> list[int]:
        """SLEM: a block drafted from the draft's whole vocabulary, in the target's ids: its text (up to a
        special or added token, less a trailing partial character) encoded by the target's tokenizer, with no
        special tokens added; the draft's EOS becomes the target's. Empty when no whole character was
        drafted (the round then verifies nothing drafted)."""
        data = bytearray()
        eos = False
        for token in draft_ids:
            piece = self._draft_bytes.get(token)
            if piece is None:  # a special or added token: the draft's EOS ends the text, any other cuts it
                eos = token == self.draft.eos_token_id
                break
            data += piece
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            text = data[: exc.start].decode()  # a partial character, at the end (or in a byte piece's run)
        ids = list(self.target.backend_tokenizer.encode(text, add_special_tokens=False).ids) if text else []
        if eos and self.target.eos_token_id is not None:
            ids.append(self.target.eos_token_id)
        return ids

    def target_row(self, row: torch.Tensor, width: int) -> torch.Tensor:
        """A draft row of q ([draft vocab]) at the target's width ([width]): each shared token's q at its
        target id, 0 at the tokens the draft cannot propose. WireFormatError if the row gives any
        probability to a draft token outside the intersection."""
        moved = row.new_zeros(width)
        moved[self._target_ids] = row[self._draft_ids]
        if float(row.sum() - moved.sum()) > 1e-4:
            raise WireFormatError("the draft's row gives probability to tokens the target's tokenizer does not share")
        return moved


class DraftContext:
    """One request's sequence in the draft's ids, spelled as the sequence grows (it only grows)."""

    def __init__(self, translation: Translation) -> None:
        self.translation = translation
        self.ids: list[int] = []  # the spelled sequence; only ever grows, as Context needs
        self.ends: list[int] = []  # ends[i]: len(ids) once target token i is spelled

    def of(self, context: Context) -> Context:
        """`context` (target ids) in draft ids."""
        spell = self.translation.spell
        for token in context.base[len(self.ends) : context.base_len]:
            self.ids.extend(spell(token))
            self.ends.append(len(self.ids))
        extra = [d for token in context.extra for d in spell(token)]
        base_len = self.ends[context.base_len - 1] if context.base_len else 0
        return Context(self.ids, extra, base_len)
