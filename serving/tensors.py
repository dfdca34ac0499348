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
