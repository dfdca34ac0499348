"""The target's logprobs of committed tokens, as the client API returns them.

The target answers them for the rows it decides (greedy rows; a sampled round's accepted draft tokens);
a sampled round's recovered or bonus token is drawn here from the target's row, so its entry is
formed here from that row. Either way the values are the target's processed distribution (vLLM's
"processed_logprobs"), never the draft's.
"""

from __future__ import annotations

import torch

from serving.tensors import WireFormatError
from specdec.v1 import common_pb2, orchestrator_pb2


def entries_from_wire(
    message: common_pb2.TokenLogprobs, token_ids: list[int], top: int, sent_top: int
) -> list[orchestrator_pb2.TokenLogprob]:
    """One entry per token of `token_ids` from the target's answer, which holds `sent_top` alternatives
    a row (the step asked for the larger of the generated and the prompt counts); `top` are kept."""
    rows = len(message.logprobs)
    sizes = {len(message.top_token_ids), len(message.top_logprobs)}
    if rows != len(token_ids) or sizes != {rows * sent_top}:
        raise WireFormatError(
            f"the target sent logprobs for {rows} rows with {len(message.top_token_ids)} alternatives, for "
            f"{len(token_ids)} tokens with {sent_top} alternatives each"
        )
    entries = []
    for row, token in enumerate(token_ids):
        ids = message.top_token_ids[row * sent_top : row * sent_top + top]
        values = message.top_logprobs[row * sent_top : row * sent_top + top]
        entries.append(
            orchestrator_pb2.TokenLogprob(
                token_id=token,
                logprob=message.logprobs[row],
                top=[orchestrator_pb2.TopLogprob(token_id=i, logprob=v) for i, v in zip(ids, values, strict=True)],
            )
        )
    return entries


def entry_from_row(target_row: torch.Tensor, token: int, top: int) -> orchestrator_pb2.TokenLogprob:
    """The entry of a token drawn from the target's row (target_row: [vocab] float32 probabilities)."""
    logprobs = target_row.log()  # [vocab]; -inf outside the support
    entry = orchestrator_pb2.TokenLogprob(token_id=token, logprob=float(logprobs[token]))
    if top:
        values, ids = logprobs.topk(min(top, logprobs.numel()))
        entry.top.extend(
            orchestrator_pb2.TopLogprob(token_id=i, logprob=v)
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)
        )
    return entry
