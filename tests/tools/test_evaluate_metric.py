"""The `evaluate` metric module `ring_perplexity` (hybrid_cache/metrics/ring_perplexity), loaded from its folder
offline: the perplexity of whole texts longer than the window equals one forward without a cache (slow: the embedded
Gemma 3 270M)."""

from __future__ import annotations

import evaluate
import pytest
import torch

from hybrid_cache.tools import RING_PERPLEXITY_METRIC
from hybrid_cache.tools.perplexity import evaluate_perplexity

pytestmark = pytest.mark.slow


def test_ring_perplexity_metric_equals_no_cache_forward():
    from hybrid_cache.tools.models import load_model
    from hybrid_cache.tools.text import load_text

    model, tokenizer = load_model()
    text, _ = load_text()
    texts = [text[:4000], text[4000:5000]]  # ~900 tokens (past the 512-token window) and ~230 tokens
    metric = evaluate.load(RING_PERPLEXITY_METRIC)
    got = metric.compute(predictions=texts, model=model, tokenizer=tokenizer, chunk_size=200)
    expected = []
    for piece in texts:
        ids = torch.tensor([tokenizer.bos_token_id, *tokenizer(piece, add_special_tokens=False).input_ids])
        expected.append(evaluate_perplexity(model, ids, "none", 1, progress=False).ppl)
    assert len(tokenizer(texts[0]).input_ids) > model.config.get_text_config().sliding_window
    assert got["perplexities"] == pytest.approx(expected, rel=1e-5)
    assert got["mean_perplexity"] == pytest.approx(sum(expected) / 2, rel=1e-5)
