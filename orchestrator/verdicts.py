"""The material of a sampled round's verdict, checked: the target's first rejection against the pure
acceptance function's, and the rows at that position at the target's width."""

from __future__ import annotations

import torch

from orchestrator.proposals import Draft
from orchestrator.requests import ModelLimits
from serving.logits import first_rejection, rows_from_wire
from serving.sampling import SamplingParams
from serving.tensors import WireFormatError
from specdec.v1 import common_pb2, target_pb2


class TargetDisagreement(ValueError):
    """The target found a sampled round's first rejection elsewhere than the acceptance function does."""


def check_sampled(
    draft: Draft, response: target_pb2.VerifyResponse, uniforms: torch.Tensor, sampling: SamplingParams, vocab: int
) -> tuple[int, torch.Tensor]:
    """The round's first rejection, decided here from the target's p(x) and the draft's q(x) with the
    round's own uniforms, and the target's row for it; raises ValueError when the target's own
    decision differs (a bug, or a faulty replica) or its material is malformed."""
    k = len(draft.token_ids)
    target_token_probs = list(response.draft_token_target_probs)
    if len(target_token_probs) != k:
        raise ValueError(f"{len(target_token_probs)} target probabilities for {k} draft tokens")
    assert draft.token_probs is not None or k == 0
    num_accepted = first_rejection(
        torch.tensor(target_token_probs, dtype=torch.float32),
        torch.tensor(draft.token_probs or [], dtype=torch.float32),
        uniforms,
    )
    if num_accepted != response.num_accepted:
        raise TargetDisagreement(
            f"the target found the first rejection at {response.num_accepted}, the orchestrator at {num_accepted}"
        )
    row = rows_from_wire(response.row, sampling, vocab)  # [1, vocab]
    if row.shape[0] != 1:
        raise ValueError(f"the target sent {row.shape[0]} rows for the last token, not 1")
    return num_accepted, row[0]


def draft_row_from(message: common_pb2.LogitRows, sampling: SamplingParams, limits: ModelLimits) -> torch.Tensor:
    """q at the target's width: a narrower draft's row padded with zeros (it cannot propose those ids),
    a wider draft's cut (it masked the ids past the target's width: `vocab_limit`), a draft with
    another tokenizer's moved to the target's ids (it proposes the shared tokens alone)."""
    vocab, width = limits.vocab_size, limits.draft_vocab_size or limits.vocab_size
    row = rows_from_wire(message, sampling, width)
    if row.shape[0] != 1:
        raise WireFormatError(f"the draft sent {row.shape[0]} rows for one")
    if limits.translation is not None:
        return limits.translation.target_row(row[0], vocab)
    if width < vocab:
        return torch.nn.functional.pad(row[0], (0, vocab - width))
    if width > vocab and bool(row[0, vocab:].any()):
        raise WireFormatError("the draft's row gives probability to ids past the target's vocabulary")
    return row[0, :vocab]
