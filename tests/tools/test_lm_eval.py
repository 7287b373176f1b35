"""lm-evaluation-harness with the ring (`hybrid_cache.lm_eval_ring`, model type `hf-ring`) on the embedded Gemma 3 270M
and two local tasks (tests/lm_eval_tasks, no Hub): a `generate_until` task whose prompts are longer than the 512-token
window, and a rolling log-likelihood (perplexity) task. Property: the same generations and the same perplexities as
lm-eval's own `hf` model (DynamicCache / one forward without a cache), with one ring built per generation (slow)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

import hybrid_cache
from hybrid_cache.tools.lm_eval_ring import RingLM

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TASKS = ["ring_local_generate", "ring_local_perplexity"]


@pytest.fixture(scope="module")
def runs():
    from hybrid_cache.tools.models import load_model

    model, tokenizer = load_model()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the task YAMLs name their data files relative to the repository root, as documented
    try:
        tasks = TaskManager(include_path=str(ROOT / "tests" / "lm_eval_tasks"))
        outputs = {}
        for name, lm in (
            ("hf", lambda: HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1)),
            ("hf-ring", lambda: RingLM(pretrained=model, tokenizer=tokenizer, batch_size=1, ring_chunk_size=256)),
        ):
            built = lm()
            outputs[name] = simple_evaluate(model=built, tasks=TASKS, task_manager=tasks, log_samples=True)
            outputs[name]["caches_built"] = getattr(model.generate, "caches_built", 0)
        return model, tokenizer, outputs
    finally:
        os.chdir(cwd)
        hybrid_cache.disable(model)


def test_generate_until_past_the_window_same_generations(runs):
    model, tokenizer, outputs = runs
    window = model.config.get_text_config().sliding_window
    plain, ring = (outputs[name]["samples"]["ring_local_generate"] for name in ("hf", "hf-ring"))
    assert len(plain) == len(ring) == 3
    for a, b in zip(plain, ring):
        prompt = a["arguments"]["gen_args_0"]["arg_0"] if isinstance(a["arguments"], dict) else a["arguments"][0][0]
        assert len(tokenizer(prompt).input_ids) > window  # the ring wrapped in every generation
        assert a["resps"] == b["resps"]
    assert outputs["hf"]["caches_built"] == 0 and outputs["hf-ring"]["caches_built"] == 3  # one ring per generate
    em = [outputs[name]["results"]["ring_local_generate"]["exact_match,none"] for name in ("hf", "hf-ring")]
    assert em[0] == em[1]


def test_rolling_loglikelihood_same_perplexity(runs):
    _, _, outputs = runs
    plain, ring = (outputs[name]["results"]["ring_local_perplexity"] for name in ("hf", "hf-ring"))
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isfinite(plain[metric]) and plain[metric] > 0
        assert ring[metric] == pytest.approx(plain[metric], rel=1e-4), metric
