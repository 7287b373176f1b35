"""Fixtures only: what the tests build (tiny models, prompts, schedules, the no-cache oracle) lives in builders.py."""

from __future__ import annotations

import pytest
from builders import one_torch_thread


@pytest.fixture(params=["gemma3", "gemma4"])
def model_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module: tiny models run faster, and logits are bit-reproducible across processes
    (the summation order of a kernel depends on its thread count)."""
    with one_torch_thread():
        yield
