"""Generate with `HybridRingCache` under transformers' tensor or pipeline parallelism, and check each process's KV
bytes against the planner.

    torchrun --nproc-per-node 2 examples/distributed_generate.py --tp 2              # tiny random Gemma 3, CPU/gloo
    torchrun --nproc-per-node 2 examples/distributed_generate.py --pp 2 MODEL_DIR    # a local checkpoint

On GPUs the same command uses NCCL (transformers picks the backend of the accelerator; one GPU per process).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig
from transformers.distributed import DistributedConfig

from hybrid_cache import HybridRingCache, cache_kwargs
from hybrid_cache.tools.planner import plan_kv_memory


def tiny_checkpoint() -> Path:
    """A tiny random Gemma 3 (window 4), written once by rank 0."""
    path = Path(tempfile.gettempdir()) / "hybrid_cache_tiny_gemma3"
    if int(os.environ.get("RANK", 0)) == 0 and not (path / "config.json").exists():
        torch.manual_seed(0)
        config = Gemma3TextConfig(
            vocab_size=101,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        )
        Gemma3ForCausalLM(config).save_pretrained(path)
    dist.barrier()
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", help="local checkpoint directory (default: a tiny random Gemma 3)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)  # transformers would start it too; we need it earlier for the barrier
    path = args.model or tiny_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=args.tp, pp_size=args.pp), dtype=torch.float32
    ).eval()
    cache = HybridRingCache.for_model(model)  # under pipeline parallelism: this stage's layers only

    torch.manual_seed(0)
    input_ids = torch.randint(3, 100, (2, 12), device=model.device)
    out = model.generate(
        input_ids, **cache_kwargs(cache), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens
    )

    rank, report = dist.get_rank(), cache.memory_report()
    plan = plan_kv_memory(
        model.config,
        report.tokens,
        prompt_length=input_ids.shape[1],
        batch_size=2,
        dtype=torch.float32,
        tp_size=args.tp,
        pp_size=args.pp,
    )
    stage = model._pp_stage.pp_rank if args.pp > 1 else 0
    print(f"[rank {rank}] tokens {out[0, -args.new_tokens :].tolist()}")
    planned = plan.stages[stage]["ring"].total_bytes
    print(f"[rank {rank}] KV held {report.total_bytes} B, planner {planned} B\n{report}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
