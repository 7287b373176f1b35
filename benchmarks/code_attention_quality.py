"""Quality of attention on the codes, through the perplexity tool, at the speed of prefill chunks.

In `generate`, only decode steps (at most `MAX_CODE_QUERY_LENGTH` = 16 tokens) attend on the codes; the perplexity
tool feeds a text in chunks (512 tokens by default), which would keep the dequantizing path. This wrapper runs
`python -m hybrid_cache.tools.cli.perplexity` with the model's attention set to ``hybrid_cache_sdpa`` and every compressed
layer attending on its codes for steps of up to `--max-query-length` tokens (default: any chunk), so that every query
after the first chunk is computed exactly as a decode step computes it (query rounded per query and group, int32
products of codes, the chunk's own keys and values exact as in both paths). `ring-int*-deq` caches in the same run
keep dequantizing: the side-by-side comparison of the two paths.

    HF_HUB_OFFLINE=1 python benchmarks/code_attention_quality.py --query-parts 1 -- --dtype float32 \
        --max-tokens 2048 --chunk-size 512 --caches ring,ring-int8,ring-int8-deq,ring-int4,ring-int4-deq \
        --reference ring
"""

from __future__ import annotations

import argparse
import sys

from hybrid_cache.code_attention import CODE_ATTENTION
from hybrid_cache.quantized import QuantizedFullLayer
from hybrid_cache.tools.cli.perplexity import main as perplexity_main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--query-parts", type=int, default=1, choices=[1, 2])
    parser.add_argument("--max-query-length", type=int, default=1 << 30)
    parser.add_argument(
        "perplexity_args", nargs=argparse.REMAINDER, help="arguments after -- go to the perplexity tool"
    )
    args = parser.parse_args()
    original_init = QuantizedFullLayer.__init__

    def init(self, *init_args, **init_kwargs) -> None:
        original_init(self, *init_args, **init_kwargs)
        self.code_query_parts = args.query_parts
        self.code_max_query_length = args.max_query_length

    QuantizedFullLayer.__init__ = init
    forwarded = [a for a in args.perplexity_args if a != "--"]
    print(f"attention on the codes for steps of up to {args.max_query_length} tokens, query parts {args.query_parts}")
    return perplexity_main([*forwarded, "--attn-implementation", CODE_ATTENTION])


if __name__ == "__main__":
    sys.exit(main())
