"""`evaluate` metric module: streaming long-text perplexity with `HybridRingCache` (load it from this folder).

```python
>>> import evaluate
>>> import hybrid_cache.tools
>>> from hybrid_cache.tools.models import load_model
>>> model, tokenizer = load_model()  # the embedded Gemma 3 270M
>>> metric = evaluate.load(hybrid_cache.tools.RING_PERPLEXITY_METRIC)  # a local folder: works offline
>>> metric.compute(predictions=["A text of any length ..."], model=model, tokenizer=tokenizer, chunk_size=512)
{'perplexities': [...], 'mean_perplexity': ...}
```

(docs/evaluation.md has the same as a script that runs as written.)

Unlike `evaluate`'s own `perplexity` (loaded from the Hub, and truncating each text to the model's `max_length`
in one forward), every text is scored whole: streamed through one ring in `chunk_size`-token forwards, the memory of
the ring, the result of one full forward without a cache (`hybrid_cache.tools.perplexity.evaluate_perplexity`).
"""

from __future__ import annotations

import datasets
import evaluate
import torch

from hybrid_cache.tools.perplexity import evaluate_perplexity

_DESCRIPTION = (
    "Perplexity of each text (exp of the mean next-token negative log-likelihood, the first token given the BOS token "
    "when add_start_token), the whole text streamed through a HybridRingCache: no truncation, ring memory."
)
_INPUTS = """
Args:
    predictions (`list[str]`): the texts to score.
    model: a causal LM (transformers `*ForCausalLM`); default: the embedded Gemma 3 270M (`hybrid_cache.tools.models`).
    tokenizer: its tokenizer (required with `model`).
    chunk_size (`int`, defaults to 512): tokens per forward.
    add_start_token (`bool`, defaults to True): prepend the tokenizer's BOS token, so the first token is scored too.
Returns:
    perplexities (`list[float]`), mean_perplexity (`float`).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS)
class RingPerplexity(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(self, predictions, model=None, tokenizer=None, chunk_size: int = 512, add_start_token: bool = True):
        if model is None:
            from hybrid_cache.tools.models import load_model

            model, tokenizer = load_model()
        if tokenizer is None:
            raise ValueError("ring_perplexity: pass the model's `tokenizer` together with `model`.")
        perplexities = []
        for text in predictions:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            if add_start_token:
                ids = [tokenizer.bos_token_id, *ids]
            if len(ids) < 2:
                raise ValueError(f"ring_perplexity: a text of {len(ids)} token(s) has nothing to predict.")
            tokens = torch.tensor(ids, dtype=torch.long)
            result = evaluate_perplexity(model, tokens, "ring", min(chunk_size, len(ids) - 1), progress=False)
            perplexities.append(result.ppl)
        return {"perplexities": perplexities, "mean_perplexity": sum(perplexities) / len(perplexities)}
