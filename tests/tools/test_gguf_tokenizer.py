"""The GGUF metadata reader and Gemma's tokenizer built from a GGUF vocabulary (`hybrid_cache.tools.models`), on small
GGUF files written here by hand (fast; the real Gemma 3 270M is in test_real_model_smoke.py)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import transformers
from transformers import AutoTokenizer

from hybrid_cache.tools import models

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
# A Gemma-like vocabulary: specials first, then user-defined runs of newlines / spaces (the GGUF spells spaces as
# spaces), byte fallbacks, then pieces in merge order.
VOCAB = [
    ("<pad>", CONTROL),
    ("<eos>", CONTROL),
    ("<bos>", CONTROL),
    ("<unk>", CONTROL),
    ("<start_of_turn>", CONTROL),
    ("\n", USER_DEFINED),
    ("  ", USER_DEFINED),
    *[(f"<0x{b:02X}>", BYTE) for b in range(256)],
    ("\u2581", NORMAL),
    ("a", NORMAL),
    ("b", NORMAL),
    ("c", NORMAL),
    ("ab", NORMAL),
    ("\u2581a", NORMAL),
    ("\u2581ab", NORMAL),
    ("abc", NORMAL),
]
ID = {token.replace("  ", "\u2581\u2581"): index for index, (token, _) in enumerate(VOCAB)}


def _string(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _write_gguf(path: Path, metadata: dict, version: int = 3) -> Path:
    """A GGUF file with `metadata` and no tensors (strings, bools, uint32 and arrays of strings / int32 / float32)."""
    body = b""
    for key, value in metadata.items():
        body += _string(key)
        if isinstance(value, bool):
            body += struct.pack("<I?", 7, value)
        elif isinstance(value, int):
            body += struct.pack("<II", 4, value)
        elif isinstance(value, str):
            body += struct.pack("<I", 8) + _string(value)
        elif isinstance(value[0], str):
            body += struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_string(v) for v in value)
        elif isinstance(value[0], int):
            body += struct.pack("<IIQ", 9, 5, len(value)) + struct.pack(f"<{len(value)}i", *value)
        else:
            body += struct.pack("<IIQ", 9, 6, len(value)) + struct.pack(f"<{len(value)}f", *value)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, len(metadata)) + body)
    return path


METADATA = {
    "general.architecture": "gemma3",
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": [token for token, _ in VOCAB],
    "tokenizer.ggml.scores": [-float(i) for i in range(len(VOCAB))],
    "tokenizer.ggml.token_type": [kind for _, kind in VOCAB],
    "tokenizer.ggml.bos_token_id": 2,
    "tokenizer.ggml.eos_token_id": 1,
    "tokenizer.ggml.unknown_token_id": 3,
    "tokenizer.ggml.padding_token_id": 0,
    "tokenizer.ggml.add_bos_token": True,
    "tokenizer.ggml.add_eos_token": False,
}


def test_metadata_reader_reads_back_what_was_written(tmp_path):
    read = models.read_gguf_metadata(_write_gguf(tmp_path / "m.gguf", METADATA))
    assert read == METADATA


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: b"GGML" + data[4:], "not a GGUF file"),
        (lambda data: data[:-3], "truncated"),
        (lambda data: data[:4] + struct.pack("<I", 1) + data[8:], "GGUF version 1"),
    ],
)
def test_metadata_reader_refuses_what_is_not_a_gguf_v2_or_v3(tmp_path, damage, message):
    path = _write_gguf(tmp_path / "m.gguf", METADATA)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        models.read_gguf_metadata(path)


def test_metadata_reader_refuses_an_unknown_value_type(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string("key") + struct.pack("<I", 99))
    with pytest.raises(ValueError, match="value type 99"):
        models.read_gguf_metadata(path)


def test_merges_follow_the_token_order():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    # "ab" before "bc" (its token comes first); "abc" last, its longer left piece first (as transformers'
    # `generate_merges` orders merges of one token).
    assert models._sentencepiece_merges(tokens) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


@pytest.fixture
def built(tmp_path):
    models._write_gemma_tokenizer(METADATA, tmp_path)
    return AutoTokenizer.from_pretrained(str(tmp_path))


@pytest.mark.parametrize(
    "text, pieces",
    [
        ("ab a", ["ab", "\u2581a"]),
        ("abc ab", ["abc", "\u2581ab"]),
        ("a\n  b", ["a", "\n", "\u2581\u2581", "b"]),  # a run of spaces: the vocabulary's ▁▁
        ("<start_of_turn>a", ["<start_of_turn>", "a"]),  # a control token stays whole
        ("a\u00e9", ["a", "<0xC3>", "<0xA9>"]),  # not in the vocabulary: its UTF-8 bytes
    ],
)
def test_built_tokenizer_bos_first_and_round_trip(built, text, pieces):
    ids = built(text).input_ids
    assert ids == [2, *(ID[p] for p in pieces)]
    assert built.decode(ids, skip_special_tokens=True) == text.replace("<start_of_turn>", "")
    assert built(text, add_special_tokens=False).input_ids == ids[1:]


def test_built_tokenizer_survives_save_and_reload(built, tmp_path):
    built.save_pretrained(tmp_path / "again")
    again = AutoTokenizer.from_pretrained(str(tmp_path / "again"))
    for text in ("ab a", "abc ab\n  c", "a\u00e9"):
        assert again(text).input_ids == built(text).input_ids


def test_no_bos_when_the_gguf_says_so(tmp_path):
    models._write_gemma_tokenizer(dict(METADATA, **{"tokenizer.ggml.add_bos_token": False}), tmp_path)
    assert AutoTokenizer.from_pretrained(str(tmp_path))("ab").input_ids == [ID["ab"]]


def test_tokenizer_problem_names_what_is_wrong(built, tmp_path):
    assert models._tokenizer_problem(built, None, 2) is None
    assert models._tokenizer_problem(None, None, 2) == "no tokenizer was saved"
    wrong = models._tokenizer_problem(built, (2, 5, 6), 2)
    assert wrong.startswith(repr(models._PROBE_TEXT)) and "expected 3 [2, 5, 6]" in wrong
    models._write_gemma_tokenizer(dict(METADATA, **{"tokenizer.ggml.add_bos_token": False}), tmp_path)
    no_bos = models._tokenizer_problem(AutoTokenizer.from_pretrained(str(tmp_path)), None, 2)
    assert no_bos.startswith("no BOS (id 2) first")
    refusal = models._refusal(Path("x.gguf"), no_bos)
    assert "\n" not in refusal and f"transformers {transformers.__version__}" in refusal and "x.gguf" in refusal


def test_only_gemma_sentencepiece_files_get_the_built_tokenizer():
    assert models._is_gemma_sentencepiece(METADATA)
    assert not models._is_gemma_sentencepiece(dict(METADATA, **{"general.architecture": "llama"}))
    assert not models._is_gemma_sentencepiece(dict(METADATA, **{"tokenizer.ggml.model": "gpt2"}))
