"""Tensors on the wire: `bytes` plus dtype and shape, never `repeated float`."""

from __future__ import annotations

import math

import torch

from specdec.v1 import common_pb2

_TO_TORCH: dict[int, torch.dtype] = {
    common_pb2.DTYPE_FLOAT32: torch.float32,
    common_pb2.DTYPE_FLOAT16: torch.float16,
    common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    common_pb2.DTYPE_INT32: torch.int32,
}
_TO_WIRE: dict[torch.dtype, int] = {v: k for k, v in _TO_TORCH.items()}


class WireFormatError(ValueError):
    """A Tensor message whose bytes do not match its dtype and shape."""


def tensor_to_proto(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Serialise a CPU or GPU tensor (copied to host memory, little-endian)."""
    if tensor.dtype not in _TO_WIRE:
        raise WireFormatError(f"dtype {tensor.dtype} cannot travel; use one of {sorted(map(str, _TO_WIRE))}")
    host = tensor.detach().to("cpu").contiguous()
    return common_pb2.Tensor(
        dtype=_TO_WIRE[host.dtype],  # type: ignore[arg-type]
        shape=list(host.shape),
        data=host.view(torch.uint8).numpy().tobytes() if host.numel() else b"",
    )


def tensor_from_proto(message: common_pb2.Tensor) -> torch.Tensor:
    """Deserialise into a new CPU tensor; raises WireFormatError when bytes and shape disagree."""
    if message.dtype not in _TO_TORCH:
        raise WireFormatError(f"unknown tensor dtype {message.dtype}")
    dtype = _TO_TORCH[message.dtype]
    shape = tuple(message.shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(message.data) != expected:
        raise WireFormatError(f"tensor of shape {list(shape)} needs {expected} bytes, got {len(message.data)}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(message.data), dtype=dtype).reshape(shape)


def encode_prob_rows(probs: torch.Tensor) -> common_pb2.ProbRows:
    """Probability rows for the wire, sparse over their support when that is smaller.

    probs: [rows, vocab] float32. A sparse column costs 8 bytes (id and probability) against 4 for a
    dense one, so rows go sparse when the widest support is under half the vocabulary. Decoding
    restores the same float32 values exactly.
    """
    rows, vocab = probs.shape
    width = int((probs > 0).sum(dim=-1).max().item()) if rows else 0
    if rows == 0 or 2 * width >= vocab:
        return common_pb2.ProbRows(probs=tensor_to_proto(probs.float()))
    values, token_ids = torch.topk(probs.float(), width, dim=-1)  # [rows, width] each
    return common_pb2.ProbRows(probs=tensor_to_proto(values), token_ids=tensor_to_proto(token_ids.to(torch.int32)))


# How far a row's sum may be from 1: float32 softmax rows over 256k tokens stay well within this.
_ROW_SUM_TOLERANCE = 1e-3


def check_distribution_rows(values: torch.Tensor) -> None:
    """Raise WireFormatError unless every row is finite, non-negative and sums to 1. values: [rows, width]"""
    if values.numel() == 0:
        return
    if not bool(torch.isfinite(values).all()):
        raise WireFormatError("probability rows hold a value that is not finite")
    if bool((values < 0).any()):
        raise WireFormatError("probability rows hold a negative value")
    sums = values.double().sum(dim=-1)  # [rows]
    worst = float((sums - 1.0).abs().max())
    if worst > _ROW_SUM_TOLERANCE:
        raise WireFormatError(f"probability rows must sum to 1; one is off by {worst:.3g}")


def decode_prob_rows(message: common_pb2.ProbRows, vocab_size: int) -> torch.Tensor:
    """Dense [rows, vocab_size] float32 rows from either encoding, checked to be distributions (a
    misbehaving replica's rows are refused, never sampled)."""
    values = tensor_from_proto(message.probs)
    if values.dim() != 2:
        raise WireFormatError(f"probability rows must be 2-D, got shape {list(values.shape)}")
    check_distribution_rows(values)
    if not message.HasField("token_ids"):
        if values.shape[1] != vocab_size:
            raise WireFormatError(f"dense rows have width {values.shape[1]}, vocabulary is {vocab_size}")
        return values.float()
    token_ids = tensor_from_proto(message.token_ids).long()
    if token_ids.shape != values.shape:
        raise WireFormatError(f"token_ids shape {list(token_ids.shape)} != probs shape {list(values.shape)}")
    if token_ids.numel() and (token_ids.min() < 0 or token_ids.max() >= vocab_size):
        raise WireFormatError(f"sparse row token ids must be in [0, {vocab_size})")
    dense = torch.zeros(values.shape[0], vocab_size, dtype=torch.float32)
    return dense.scatter_(1, token_ids, values.float())
