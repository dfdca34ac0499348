"""Rows on the wire: bytes with dtype and shape; sparse rows decode to the same values exactly."""

from __future__ import annotations

import pytest
import torch

from model_host.logits import logits_to_probs
from serving.sampling import SamplingParams
from serving.tensors import WireFormatError, decode_prob_rows, encode_prob_rows, tensor_from_proto, tensor_to_proto
from specdec.v1 import common_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
def test_round_trip(dtype: torch.dtype):
    tensor = (torch.randn(3, 5) * 100).to(dtype)
    decoded = tensor_from_proto(tensor_to_proto(tensor))
    assert decoded.dtype == dtype and torch.equal(decoded, tensor)


def test_wrong_byte_count_is_rejected():
    message = tensor_to_proto(torch.zeros(2, 2))
    message.shape[:] = [3, 2]
    with pytest.raises(WireFormatError):
        tensor_from_proto(message)


def test_dense_rows_stay_dense():
    probs = torch.softmax(torch.randn(3, 50), -1)
    message = encode_prob_rows(probs)
    assert not message.HasField("token_ids")
    assert torch.equal(decode_prob_rows(message, 50), probs)


def test_top_k_rows_travel_sparse_and_decode_exactly():
    probs = logits_to_probs(torch.randn(5, 1000), SamplingParams(temperature=0.8, top_k=20))
    message = encode_prob_rows(probs)
    assert message.HasField("token_ids")
    assert list(message.probs.shape) == [5, 20]
    assert torch.equal(decode_prob_rows(message, 1000), probs)
    assert message.ByteSize() < tensor_to_proto(probs).ByteSize() / 10


def test_sparse_ids_out_of_range_are_rejected():
    message = common_pb2.ProbRows(
        probs=tensor_to_proto(torch.ones(1, 1)), token_ids=tensor_to_proto(torch.tensor([[7]], dtype=torch.int32))
    )
    with pytest.raises(WireFormatError):
        decode_prob_rows(message, 5)
