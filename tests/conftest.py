"""Fixtures only: what the tests build (tiny models, prompts, schedules, the no-cache oracle) lives in builders.py."""

from __future__ import annotations

import os

import pytest
from builders import BANDED, BANDED_TEST_SETTINGS, one_torch_thread

from hybrid_cache.banded import banded_prefill

# Tests of attention on the codes test it wherever they run: a layer the native kernel cannot take attends on its codes
# with torch ops instead of dequantizing when that measures faster (code_path.codes_preferred).
# tests/core/test_code_kernel_fallback.py tests that choice.
os.environ.setdefault("HYBRID_CACHE_CODE_FALLBACK", "codes")


@pytest.fixture(params=["gemma3", "gemma4"])
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module: tiny models run faster, and logits are bit-reproducible across processes
    (the summation order of a kernel depends on its thread count)."""
    with one_torch_thread():
        yield


@pytest.fixture(autouse=True)
def banded_when_asked(request):
    """A test whose `attn` parameter is `builders.BANDED` runs with the banded prefill from 2-token steps."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("attn") == BANDED:
        with banded_prefill(**BANDED_TEST_SETTINGS):
            yield
    else:
        yield
