"""Sampling parameters, validated once, shared by the orchestrator and both model services."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.errors import invalid_argument
from specdec.v1 import common_pb2

# vLLM's convention: a temperature below this is greedy decoding (its softmax would be an argmax in
# float32 anyway, and dividing logits by it overflows).
MIN_SAMPLING_TEMPERATURE = 1e-5
# Above this a distribution is indistinguishable from uniform; a finite bound keeps every row finite.
MAX_TEMPERATURE = 100.0
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How next-token distributions are formed: temperature, then top-k, then top-p."""

    temperature: float = 0.0  # 0 (or below MIN_SAMPLING_TEMPERATURE) is greedy
    top_k: int = 0  # 0 keeps all tokens
    top_p: float = 1.0  # 1.0 keeps all tokens

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def validated(self) -> SamplingParams:
        """Return self, or raise INVALID_ARGUMENT naming the field and its allowed range."""
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # also rejects NaN and infinities
            raise invalid_argument(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (below {MIN_SAMPLING_TEMPERATURE:g} is greedy); "
                f"got {self.temperature}"
            )
        if self.top_k < 0:
            raise invalid_argument(f"top_k must be >= 0 (0 keeps all tokens); got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # also rejects NaN
            raise invalid_argument(f"top_p must be in (0, 1]; got {self.top_p}")
        return self

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @classmethod
    def from_proto(cls, message: common_pb2.SamplingParams) -> SamplingParams:
        top_p = message.top_p if message.HasField("top_p") else 1.0
        return cls(temperature=message.temperature, top_k=message.top_k, top_p=top_p).validated()


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _U64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _U64
    return value ^ (value >> 31)


def seeded_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from all 64 bits of `seed`.

    torch's CPU generator keeps only the low 32 bits of its seed, so seeds differing above them would
    give the same stream; mixing the whole seed first (splitmix64, folded to 32 bits) makes every bit count.
    """
    if not 0 <= seed <= _U64:
        raise ValueError(f"seed must be in [0, 2^64); got {seed}")
    mixed = _splitmix64(seed)
    return torch.Generator(device=device).manual_seed((mixed ^ (mixed >> 32)) & 0xFFFFFFFF)
