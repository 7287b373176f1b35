"""``python -m hybrid_cache.tools.cli.lm_eval_ring <lm_eval arguments>``: lm_eval's own command line, with the model type
``hf-ring`` (`hybrid_cache.tools.lm_eval_ring.RingLM`) registered."""

from __future__ import annotations

import sys

from .. import lm_eval_ring  # noqa: F401  registers the model type "hf-ring"

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """lm_eval's command line (`argv`, default `sys.argv[1:]`) with `hf-ring` registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
