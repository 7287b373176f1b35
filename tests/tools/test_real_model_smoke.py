"""The embedded Gemma 3 270M on the installed transformers release: its tokenizer and a short perplexity (slow).

`.ci/run` runs this file on the oldest release the pyproject declares, in a fresh venv with a fresh
`HYBRID_CACHE_HOME`, so the conversion itself runs on that release; the whole suite runs it again on the newest. A
conversion whose tokenizer falls apart (single characters, no BOS) gives thousands of tokens for the README's 5,000
characters and a perplexity in the thousands: both fail here.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

pytestmark = pytest.mark.slow

#: The README quick start's text: 5,000 characters of the default text.
QUICK_START_CHARS = 5000


@pytest.fixture(scope="module")
def embedded(embedded_model_installed):
    from hybrid_cache.tools.models import load_model
    from hybrid_cache.tools.text import load_text

    model, tokenizer = load_model()
    text, _ = load_text()
    return model, tokenizer, text


def test_the_conversion_in_use_was_made_by_this_release(embedded):
    """The manifest of the checkpoint `load_model` read names the installed release (a conversion made by another
    release is rebuilt, so what is checked below is what this release produced)."""
    from hybrid_cache.tools import models

    gguf, sha = models.default_gguf_path()
    manifest = json.loads(
        (models.cache_home() / "converted" / f"{gguf.stem}-{sha[:16]}" / "manifest.json").read_text()
    )
    assert manifest["transformers_version"] == transformers.__version__
    assert manifest["format"] == models._CONVERSION_FORMAT


def test_tokenizer_bos_first_subwords_and_round_trip(embedded, tmp_path):
    from transformers import AutoTokenizer

    from hybrid_cache.tools import models

    _, tokenizer, text = embedded
    ids = tokenizer(text[:QUICK_START_CHARS]).input_ids
    assert ids[0] == tokenizer.bos_token_id == 2
    # Subwords: about 4 characters a token on English prose (1,210 ids on every release tested); a character-level
    # tokenizer gives about 5,000.
    assert 1100 <= len(ids) <= 1300, len(ids)
    assert list(tokenizer(models._PROBE_TEXT).input_ids) == list(models._EMBEDDED_PROBE_IDS)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text[:QUICK_START_CHARS]
    # What a user saving the tokenizer gets back tokenizes the same.
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(str(tmp_path))(text[:QUICK_START_CHARS]).input_ids == ids


def test_short_perplexity_is_sane(embedded):
    """512 tokens of the default text without a cache: about 18 when the model and tokenizer are right (19.3 on
    every release tested); a broken tokenizer gives thousands."""
    from hybrid_cache.tools.perplexity import evaluate_perplexity

    model, tokenizer, text = embedded
    ids = tokenizer(text, return_tensors="pt").input_ids[0, :512]
    with torch.inference_mode():
        result = evaluate_perplexity(model, ids, "none", 256, progress=False)  # "none": one forward
    print(f"transformers {transformers.__version__}: perplexity {result.ppl:.4f} over {ids.numel()} tokens")
    assert 5 < result.ppl < 60, result.ppl
