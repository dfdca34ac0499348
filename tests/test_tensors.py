"""Rows on the wire: bytes with dtype and shape; logit rows decode to the sender's own distributions."""

from __future__ import annotations

import pytest
import torch

from serving.logits import logits_to_probs, rows_from_wire, rows_to_wire
from serving.sampling import SamplingParams
from serving.tensors import WireFormatError, tensor_from_proto, tensor_to_proto
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_rows_travel_as_logits_in_the_models_dtype(dtype: torch.dtype):
    params = SamplingParams(temperature=0.9)
    logits = (torch.randn(3, 50) * 4).to(dtype)
    message = rows_to_wire(logits, params)
    assert not message.HasField("token_ids")
    assert tensor_from_proto(message.logits).dtype == dtype
    assert torch.equal(rows_from_wire(message, params, 50), logits_to_probs(logits, params))


def test_top_k_rows_travel_over_the_senders_support_and_decode_exactly():
    params = SamplingParams(temperature=0.8, top_k=20)
    logits = torch.randn(5, 1000)
    message = rows_to_wire(logits, params)
    assert message.HasField("token_ids")
    assert list(message.logits.shape) == [5, 20]
    assert torch.equal(rows_from_wire(message, params, 1000), logits_to_probs(logits, params))
    assert message.ByteSize() < tensor_to_proto(logits).ByteSize() / 10


def test_a_wide_top_p_support_travels_dense_with_the_rest_masked():
    """A support over half the vocabulary travels dense; tokens outside it arrive as -inf, so the
    receiver, which never ranks tokens itself, gives them probability 0."""
    params = SamplingParams(temperature=1.0, top_p=0.7)  # near-flat rows: about 28 of 40 tokens
    logits = torch.randn(2, 40) * 0.1
    message = rows_to_wire(logits, params)
    sent = tensor_from_proto(message.logits)
    assert not message.HasField("token_ids") and bool(torch.isneginf(sent).any())
    assert torch.equal(rows_from_wire(message, params, 40), logits_to_probs(logits, params))


@pytest.mark.parametrize(
    ("logits", "token_ids", "complaint"),
    [
        ([[1.0]], [[7]], "token ids"),
        ([[float("nan"), 0.0]], None, "NaN"),
        ([[float("inf"), 0.0]], None, "NaN or \\+inf"),
        ([[float("-inf"), float("-inf")]], None, "no token"),
        ([[1.0, 2.0], [float("-inf"), float("-inf")]], None, "no token"),
        ([[0.0, 1.0, 2.0]], None, "width"),
    ],
)
def test_rows_no_model_could_send_are_refused(logits, token_ids, complaint):
    message = common_pb2.LogitRows(logits=tensor_to_proto(torch.tensor(logits)))
    if token_ids is not None:
        message.token_ids.CopyFrom(tensor_to_proto(torch.tensor(token_ids, dtype=torch.int32)))
    vocab = 5 if token_ids is not None else 2
    with pytest.raises(WireFormatError, match=complaint):
        rows_from_wire(message, SamplingParams(temperature=1.0), vocab)
