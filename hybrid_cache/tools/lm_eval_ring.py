"""lm-evaluation-harness with the ring: the model type `hf-ring`.

`hf-ring` is lm-eval's own `HFLM` (model type `hf`) with two changes:

- `generate_until` tasks: the model is switched on with `hybrid_cache.enable`, so every `generate()` HFLM makes gets
  a fresh `HybridRingCache` (prompts longer than the sliding window decode with ring memory; same tokens as `hf`).
- rolling log-likelihood tasks (perplexity, `loglikelihood_rolling`): each document is streamed through one
  `HybridRingCache` in chunks of `ring_chunk_size` tokens (`hybrid_cache.tools.perplexity.evaluate_perplexity`), so the
  whole document is scored with its full context at the memory of the ring. HFLM's `hf` instead cuts documents
  longer than `max_length` into disjoint windows that each restart the context; where a document fits in one window
  both give the same log-likelihood (to float32 summation order).

Other request types (`loglikelihood`, multiple choice) are HFLM's own: one forward without any cache.

Command line (`hybrid_cache.tools.cli.lm_eval_ring`; any lm_eval arguments after the module name;
`pretrained=default` is the embedded Gemma 3 270M):

```bash
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python -m hybrid_cache.tools.cli.lm_eval_ring run --model hf-ring \\
    --model_args pretrained=default,ring_chunk_size=256 --include_path tests/lm_eval_tasks \\
    --tasks ring_local_generate,ring_local_perplexity --batch_size 1
```

Python: `lm_eval.simple_evaluate(model=RingLM(pretrained="default"), tasks=[...])` (or a checkpoint path).
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from hybrid_cache import enable

from .perplexity import evaluate_perplexity

__all__ = ["RingLM"]


@register_model("hf-ring")
class RingLM(HFLM):
    """lm-eval's `HFLM` with `HybridRingCache` for generation and rolling log-likelihoods (see the module docstring).

    Args:
        pretrained: what `HFLM` takes (a path, a Hub id or a loaded model), or `"default"` for the embedded Gemma 3
            270M (the checkpoint directory of `hybrid_cache.tools.models.default_checkpoint()`, tokenizer included,
            loaded by `HFLM` without Hub kernels).
        ring_chunk_size (`int`, defaults to 512): tokens per forward when scoring a document with the ring.
        cache_options (`dict`, *optional*): `HybridRingCache` keyword arguments for generation (`hybrid_cache.enable`).
        **kwargs: `HFLM` arguments (`tokenizer`, `batch_size`, `max_length`, ...).
    """

    def __init__(
        self, pretrained: Any = "default", ring_chunk_size: int = 512, cache_options: dict | None = None, **kwargs: Any
    ) -> None:
        if isinstance(pretrained, str) and pretrained == "default":
            from .models import NO_HUB_KERNELS, default_checkpoint

            # A path, as lm-eval expects (`HFLM` loads it and its tokenizer itself; an already-loaded model makes it
            # warn that its other arguments may be ignored), and transformers' own modules, as `load_model` loads.
            pretrained = str(default_checkpoint())
            for key, value in NO_HUB_KERNELS.items():
                kwargs.setdefault(key, value)
            # HFLM's default device is "cuda", which it does not check for a path: a CPU machine would fail.
            kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained=pretrained, **kwargs)
        self.ring_chunk_size = int(ring_chunk_size)
        if self.ring_chunk_size < 1:
            raise ValueError(f"ring_chunk_size must be >= 1, got {ring_chunk_size}")
        enable(self.model, **(cache_options or {}))

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Summed log-probability of every token of each document (given the prefix token), streamed through one
        ring per document."""
        results = []
        for request in tqdm(requests, disable=disable_tqdm or self.rank != 0):
            (string,) = request.args
            ids = [self.prefix_token_id, *self.tok_encode(string)]
            if len(ids) < 2:
                results.append(0.0)
                continue
            tokens = torch.tensor(ids, dtype=torch.long)
            scored = evaluate_perplexity(
                self.model, tokens, "ring", min(self.ring_chunk_size, len(ids) - 1), progress=False
            )
            loglikelihood = -scored.nll
            results.append(loglikelihood)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), loglikelihood)
        return results
