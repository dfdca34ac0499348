"""Streaming text: deltas concatenate to the full decode; nothing past a stop string is released."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from orchestrator.text import TextStream, byte_table
from tests.tiny_models import word_tokenizer


def _stream(tokenizer, ids, stop, chunk=2, table=None):
    stream = TextStream(tokenizer, stop, table)
    text, consumed = "", []
    for start in range(0, len(ids), chunk):
        delta = stream.push(ids[start : start + chunk])
        text += delta.text
        consumed += delta.token_ids
        if delta.stopped:
            return text, consumed, True
    return text + stream.finish(), consumed, False


def test_deltas_concatenate_to_full_decode():
    tokenizer = word_tokenizer(20)
    ids = [3, 4, 5, 6, 7, 8, 9]
    text, consumed, stopped = _stream(tokenizer, ids, [])
    assert text == tokenizer.decode(ids) and consumed == ids and not stopped


def test_stop_string_truncates_text_and_tokens():
    tokenizer = word_tokenizer(20)
    ids = [3, 4, 5, 6, 7, 8, 9]
    text, consumed, stopped = _stream(tokenizer, ids, ["w6 w7"], chunk=3)
    assert stopped
    assert text == "w3 w4 w5 "
    assert consumed == [3, 4, 5, 6, 7]  # up to the token that completed the stop string


def test_partial_stop_is_held_back_then_released():
    tokenizer = word_tokenizer(20)
    stream = TextStream(tokenizer, ["w5 w9"])
    first = stream.push([3, 4, 5])
    assert "w5" not in first.text  # might begin the stop string
    second = stream.push([6])
    assert first.text + second.text == "w3 w4 w5 w6"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    from default_models.train import train_tokenizer

    folder = tmp_path_factory.mktemp("byte_level")
    train_tokenizer(["héllo wörld ünïcode ✓ — ok"] * 20, 300).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("with_table", [False, True])
def test_byte_level_multibyte_characters_are_never_split(byte_level, with_table):
    tokenizer = byte_level
    text = "naïve ✓ café — 終わり"
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer, [], byte_table(tokenizer) if with_table else None)
    pieces = [stream.push([token]).text for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + stream.finish() == text


def test_the_byte_table_streams_exactly_the_tokenizers_decode(byte_level):
    """Random token sequences (split characters, invalid bytes, special tokens among them) stream to
    what the tokenizer decodes, in any chunking, with one table lookup a token."""
    for tokenizer in (byte_level, AutoTokenizer.from_pretrained("default_models/pair/target")):
        table = byte_table(tokenizer)
        assert table is not None
        rng = random.Random(1)
        for _ in range(200):
            ids = rng.choices(range(len(tokenizer)), k=rng.randint(1, 30))
            expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            for chunk in (1, 3):
                text, consumed, _ = _stream(tokenizer, ids, [], chunk=chunk, table=table)
                assert text == expected and consumed == ids


def test_tokenizers_that_are_not_byte_level_get_no_table():
    assert byte_table(word_tokenizer(20)) is None
