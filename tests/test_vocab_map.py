"""The tokens two tokenizers share, by bytes (serving/vocab_map.py): a byte-level BPE against a
SentencePiece-style (Metaspace, byte-fallback) tokenizer built from part of its vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from bench.cross_pair import METASPACE
from serving.vocab_map import VocabularyError, check_overlap, intersect, main, token_bytes
from tests.tiny_models import byte_level_bpe, sentencepiece_from, word_tokenizer

PAIR = Path(__file__).resolve().parents[1] / "default_models" / "pair"


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return byte_level_bpe()


@pytest.fixture(scope="module")
def sentencepiece(byte_level: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    return sentencepiece_from(byte_level)


def test_a_tokens_bytes_read_through_each_kind_of_marker(byte_level, sentencepiece):
    level = token_bytes(byte_level)
    assert level[byte_level.convert_tokens_to_ids("Ġ")] == b" "
    assert level[byte_level.convert_tokens_to_ids("Ċ")] == b"\n"
    assert byte_level.convert_tokens_to_ids("<|endoftext|>") not in level  # special
    piece = token_bytes(sentencepiece)
    assert piece[sentencepiece.convert_tokens_to_ids("<0xE2>")] == b"\xe2"  # byte fallback: partial UTF-8
    assert piece[sentencepiece.convert_tokens_to_ids(f"{METASPACE}zzyzx")] == b" zzyzx"
    assert sentencepiece.eos_token_id not in piece


def test_the_map_is_a_bijection_of_equal_bytes_with_the_eos_mapped(byte_level, sentencepiece):
    pair = intersect(byte_level, sentencepiece)
    level, piece = token_bytes(byte_level), token_bytes(sentencepiece)
    assert pair.draft_to_target and all(piece[d] == level[t] for d, t in pair.draft_to_target.items())
    assert len(set(pair.draft_to_target.values())) == len(pair.draft_to_target)  # one to one
    # Every byte of the byte-level side meets its <0xNN> piece, whole UTF-8 or not.
    assert pair.draft_to_target[sentencepiece.convert_tokens_to_ids("<0xE2>")] == byte_level.convert_tokens_to_ids("â")
    # " the" as ▁the and as Ġthe.
    the = byte_level.convert_tokens_to_ids("Ġthe")
    if sentencepiece.convert_tokens_to_ids(f"{METASPACE}the") != sentencepiece.unk_token_id:
        assert pair.target_to_draft[the] == sentencepiece.convert_tokens_to_ids(f"{METASPACE}the")
    # Two ids for "e": the piece stands for both, not the byte-fallback token with the lower id.
    e = [i for i, b in piece.items() if b == b"e"]
    assert len(e) == 2
    assert pair.target_to_draft[byte_level.convert_tokens_to_ids("e")] == sentencepiece.convert_tokens_to_ids("e")
    assert sentencepiece.convert_tokens_to_ids("zzyzx") not in piece
    # The draft's own pieces are not shared; specials never are.
    assert sentencepiece.convert_tokens_to_ids(f"{METASPACE}zzyzx") not in pair.draft_to_target
    assert not set(pair.draft_to_target) & set(sentencepiece.all_special_ids)
    assert (pair.target_eos, pair.draft_eos) == (byte_level.eos_token_id, sentencepiece.eos_token_id)


def test_a_pair_below_the_overlap_floor_is_refused_with_both_names_and_the_overlap(byte_level, sentencepiece):
    pair = intersect(byte_level, sentencepiece)
    overlap = check_overlap(pair, byte_level, floor=0.1)
    assert 0.1 < overlap < 1.0
    with pytest.raises(VocabularyError, match=r"shares \d+% of target tokenizer .* below the floor of 99%"):
        check_overlap(pair, byte_level, floor=0.99)


def test_one_tokenizer_shares_every_ordinary_token_with_itself():
    tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
    pair = intersect(tokenizer, tokenizer)
    assert all(d == t for d, t in pair.draft_to_target.items())
    assert len(pair.draft_to_target) == len(token_bytes(tokenizer))
    assert check_overlap(pair, tokenizer, floor=0.99) == 1.0


def test_a_tokenizer_whose_bytes_cannot_be_read_is_refused_by_name():
    with pytest.raises(VocabularyError, match="WordPiece decoder"):
        token_bytes(word_tokenizer(16))


def test_the_command_line_reports_the_overlap_and_exits_below_the_floor(capsys, tmp_path, byte_level, sentencepiece):
    main([str(PAIR / "target"), str(PAIR / "draft")])
    assert "4,095 tokens shared by bytes" in capsys.readouterr().out
    byte_level.save_pretrained(tmp_path / "level")
    sentencepiece.save_pretrained(tmp_path / "piece")
    with pytest.raises(SystemExit, match="below the floor of 99%"):
        main([str(tmp_path / "level"), str(tmp_path / "piece"), "--floor", "0.99"])
