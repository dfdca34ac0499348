"""Sampling parameters, validated once, shared by the orchestrator and both model services."""

from __future__ import annotations

from dataclasses import dataclass

from serving.errors import invalid_argument
from specdec.v1 import common_pb2


@dataclass(frozen=True)
class SamplingParams:
    """How next-token distributions are formed: temperature, then top-k, then top-p."""

    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps all tokens
    top_p: float = 1.0  # 1.0 keeps all tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validated(self) -> SamplingParams:
        """Return self, or raise INVALID_ARGUMENT naming the field and its allowed range."""
        if not self.temperature >= 0.0:  # also rejects NaN
            raise invalid_argument(f"temperature must be >= 0 (0 is greedy); got {self.temperature}")
        if self.top_k < 0:
            raise invalid_argument(f"top_k must be >= 0 (0 keeps all tokens); got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise invalid_argument(f"top_p must be in (0, 1]; got {self.top_p}")
        return self

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    @classmethod
    def from_proto(cls, message: common_pb2.SamplingParams) -> SamplingParams:
        top_p = message.top_p if message.HasField("top_p") else 1.0
        return cls(temperature=message.temperature, top_k=message.top_k, top_p=top_p).validated()
