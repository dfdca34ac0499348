"""Logits processing, applied identically by the draft, the target and the orchestrator: temperature,
top-k, top-p; the wire form of a row (its logits, in the model's dtype, over the sender's support); and
the acceptance test, which the target and the orchestrator both run on a sampled round.

Rows travel as logits, not probabilities: the receiver forms the distribution with the same function
the sender samples with (`rows_from_wire` and `logits_to_probs` share `_softmax`), so the two agree up
to float32 softmax rounding between devices, and a bfloat16 model's rows cost half. The support (top-k,
top-p) travels as the sender computed it: the receiver never ranks tokens, since ties are common in
bfloat16 and their order depends on the device.
"""

from __future__ import annotations

import torch

from serving.sampling import SamplingParams
from serving.tensors import WireFormatError, tensor_from_proto, tensor_to_proto
from specdec.v1 import common_pb2


def support_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[rows, vocab] float32 logits / temperature, -inf outside the top-k and top-p support."""
    if params.greedy:
        raise ValueError("greedy decoding forms no probability rows")
    scores = logits.float() / params.temperature  # [rows, vocab]
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        # Exactly the k most likely tokens; among tokens tied with the k-th, topk's order decides.
        kept = torch.topk(scores, params.top_k, dim=-1).indices  # [rows, top_k]
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, kept, True)
        scores = scores.masked_fill(~keep, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [rows, vocab]
        sorted_probs = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


# Alternatives per position a request may ask logprobs for (OpenAI's and vLLM's bound).
MAX_TOP_LOGPROBS = 20


def processed_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[rows, vocab] float32 scores whose log-softmax is the distribution a token is drawn from: the
    logits at temperature 1 for greedy rows, `support_scores` otherwise (vLLM's processed logprobs)."""
    return logits.float() if params.greedy else support_scores(logits, params)


def token_logprobs(scores: torch.Tensor, token_ids: list[int], top: int) -> common_pb2.TokenLogprobs:
    """Each row's log-probability of its token, and its `top` most likely tokens, from scores
    [rows, vocab] (float32; -inf outside the support)."""
    logprobs = scores.float().log_softmax(dim=-1)  # [rows, vocab]
    rows = torch.arange(len(token_ids), device=logprobs.device)
    chosen = logprobs[rows, torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)]  # [rows]
    message = common_pb2.TokenLogprobs(logprobs=chosen.cpu().tolist())
    if top and len(token_ids):
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [rows, top]
        message.top_token_ids.extend(ids.flatten().cpu().tolist())
        message.top_logprobs.extend(values.flatten().cpu().tolist())
    return message


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    return scores.softmax(dim=-1)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Next-token distributions for sampling.

    logits: [rows, vocab] in any float dtype. Returns [rows, vocab] float32 rows summing to 1.
    Tokens removed by top-k or top-p get probability exactly 0.
    """
    return _softmax(support_scores(logits, params))


def rows_to_wire(logits: torch.Tensor, params: SamplingParams) -> common_pb2.LogitRows:
    """Rows for the wire: the raw logits ([rows, vocab], the model's dtype), -inf outside the support,
    and over the support alone when it is under half the vocabulary (a sparse column costs an id too)."""
    if params.top_k == 0 and params.top_p >= 1.0:  # the whole vocabulary: the logits as they are
        return common_pb2.LogitRows(logits=tensor_to_proto(logits))
    scores = support_scores(logits, params)
    outside = torch.isneginf(scores)
    raw = logits.masked_fill(outside, float("-inf"))
    rows, vocab = raw.shape
    width = int((~outside).sum(dim=-1).max().item()) if rows else 0
    if rows == 0 or 2 * width >= vocab:
        return common_pb2.LogitRows(logits=tensor_to_proto(raw))
    token_ids = torch.topk(scores, width, dim=-1).indices  # [rows, width]: the support, then -inf columns
    return common_pb2.LogitRows(
        logits=tensor_to_proto(raw.gather(-1, token_ids)), token_ids=tensor_to_proto(token_ids.to(torch.int32))
    )


def rows_from_wire(message: common_pb2.LogitRows, params: SamplingParams, vocab_size: int) -> torch.Tensor:
    """Dense [rows, vocab_size] float32 distributions from a sender's logit rows, formed exactly as the
    sender forms its own; raises WireFormatError for rows that could not be a model's (a misbehaving
    replica's rows are refused, never sampled)."""
    logits = tensor_from_proto(message.logits)
    if logits.dim() != 2 or not logits.is_floating_point():
        raise WireFormatError(f"logit rows must be 2-D floats, got {logits.dtype} of shape {list(logits.shape)}")
    if not message.HasField("token_ids"):
        if logits.shape[1] != vocab_size:
            raise WireFormatError(f"dense rows have width {logits.shape[1]}, vocabulary is {vocab_size}")
        scores = logits.float() / params.temperature
    else:
        scores = torch.full((logits.shape[0], vocab_size), float("-inf"))
        token_ids = tensor_from_proto(message.token_ids).long()
        if token_ids.shape != logits.shape:
            raise WireFormatError(f"token_ids shape {list(token_ids.shape)} != logits shape {list(logits.shape)}")
        if token_ids.numel() and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
            raise WireFormatError(f"sparse row token ids must be in [0, {vocab_size})")
        scores.scatter_(1, token_ids, logits.float() / params.temperature)
    probs = _softmax(scores)
    # One pass for every row no model sends: NaN or +inf anywhere, or no token in the support (all -inf),
    # makes its softmax NaN.
    if not bool(torch.isfinite(probs).all()):
        raise WireFormatError("logit rows hold NaN or +inf, or a row has no token in its support")
    return probs


def first_rejection(
    target_token_probs: torch.Tensor,  # [k] float32: p(x) of each draft token
    draft_token_probs: torch.Tensor,  # [k] float32: q(x), > 0 (each x was sampled from q)
    uniforms: torch.Tensor,  # [>= k] float64
) -> int:
    """The number of draft tokens accepted before the first rejection (k when none is rejected): token i
    is accepted when u_i q(x_i) < p(x_i), in float64, that is with probability min(1, p/q), written
    without a division. The target and the orchestrator both decide a round with this."""
    k = draft_token_probs.numel()
    accepted = uniforms[:k] * draft_token_probs.double() < target_token_probs.double()  # [k] bool
    rejected = (~accepted).nonzero()
    return int(rejected[0, 0]) if rejected.numel() else k


def sample_index(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row of `weights` ([..., vocab], non-negative, any total), the token
    whose cumulative float64 weight first exceeds uniform * total. A token of weight 0 is never chosen
    (its cumulative weight equals the one before)."""
    cumulative = weights.double().cumsum(-1)  # [..., vocab]
    point = uniform * cumulative[..., -1:]  # [..., 1]
    index = torch.searchsorted(cumulative, point, right=True)
    return index.clamp_max(weights.shape[-1] - 1)[..., 0]
