"""Streaming text: deltas concatenate to the full decode; nothing past a stop string is released."""

from __future__ import annotations

from transformers import AutoTokenizer

from orchestrator.text import TextStream
from tests.tiny_models import word_tokenizer


def _stream(tokenizer, ids, stop, chunk=2):
    stream = TextStream(tokenizer, stop)
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


def test_byte_level_multibyte_characters_are_never_split(tmp_path):
    from default_models.train import train_tokenizer

    tokenizer = train_tokenizer(["héllo wörld ünïcode ✓ — ok"] * 20, 300)
    tokenizer.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "naïve ✓ café — 終わり"
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer, [])
    pieces = [stream.push([token]).text for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + stream.finish() == text
