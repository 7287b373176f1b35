"""``hybrid-cache-plan`` / ``python -m hybrid_cache.tools.cli.planner``: the KV bytes of every cache for a preset, a config.json
or a model directory (`hybrid_cache.tools.planner`), as tables or JSON, and the longest context within ``--budget``.

A config that cannot be planned (an unknown preset or file, a tensor-parallel degree that does not divide the KV
heads, ...) prints ``error: <why>`` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

from transformers.configuration_utils import PreTrainedConfig

from hybrid_cache.specs import CHUNKED, FULL, SHARED, SLIDING, layer_specs, text_config

from ..compare import layer_kv_geometry
from ..planner import CACHE_LABELS, PRESETS, KVPlan, load_config, max_context_length, plan_kv_memory

__all__ = ["build_parser", "format_plan", "main", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """`24GiB`, `80GB`, `512MiB`, `1e9` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 24GiB, 80GB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _describe(config: PreTrainedConfig, tp_size: int) -> str:
    text = text_config(config)
    specs = layer_specs(text)
    geometry = layer_kv_geometry(text)
    parts = []
    for kind in (SLIDING, CHUNKED, FULL, SHARED):
        indices = [spec.index for spec in specs if spec.kind == kind]
        if not indices:
            continue
        shapes = sorted({geometry[i] for i in indices if geometry[i] is not None})
        shape_text = ", ".join(f"{heads}x{dim}" for heads, dim in shapes)
        window = {SLIDING: " window", CHUNKED: " chunk"}.get(kind, "")
        window += f" {specs[indices[0]].window}" if window else ""
        parts.append(f"{len(indices)} {kind}{window}" + (f" (KV heads x head size {shape_text})" if shapes else ""))
    per_rank = f", {tp_size} tensor-parallel ranks" if tp_size > 1 else ""
    return f"{type(text).__name__}, {text.num_hidden_layers} layers: " + "; ".join(parts) + per_rank


def format_plan(plan: KVPlan) -> str:
    """The plan as text tables (one per pipeline stage)."""
    mode = f"fixed max_cache_len={plan.max_cache_len}" if plan.max_cache_len else "growable full layers"
    lines = [
        f"context {plan.context_length} tokens (prompt {plan.prompt_length}), batch {plan.batch_size}, "
        f"{str(plan.dtype).removeprefix('torch.')}, {mode}, rollback_margin {plan.rollback_margin}, "
        f"TP {plan.tp_size}, PP {plan.pp_size}"
    ]
    for stage, (caches, layers) in enumerate(zip(plan.stages, plan.stage_layers)):
        title = "KV bytes per process" if plan.pp_size == 1 else f"stage {stage} (layers {layers[0]}..{layers[-1]})"
        lines.append(f"{title}:")
        header = f"  {'layer type':<18}{'layers':>7}" + "".join(f"{CACHE_LABELS[n]:>17}" for n in CACHE_LABELS)
        lines.append(header)
        ring = caches["ring"]
        for kind in ring.layers_by_type:
            row = f"  {kind:<18}{ring.layers_by_type[kind]:>7}"
            row += "".join(f"{_size(caches[name].bytes_by_type[kind]):>17}" for name in CACHE_LABELS)
            lines.append(row)
        row = f"  {'total':<18}{sum(ring.layers_by_type.values()):>7}"
        lines.append(row + "".join(f"{_size(caches[name].total_bytes):>17}" for name in CACHE_LABELS))
        slots = ", ".join(f"{kind} {'/'.join(map(str, s))}" for kind, s in ring.slots_by_type.items() if any(s))
        lines.append(f"  HybridRingCache slots per layer: {slots}")
    if plan.prompt_length == plan.context_length:
        lines.append(
            "Right after a prompt of the whole context: DynamicCache's sliding layers still hold the prompt's storage "
            "(until the next step); pass --prompt to see a generation."
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-cache-plan",
        description="KV-cache bytes per process for HybridRingCache, DynamicCache, StaticCache and a full cache.",
    )
    parser.add_argument("model", nargs="?", help=f"preset ({', '.join(PRESETS)}), config.json or model directory")
    parser.add_argument("--context", type=int, default=None, help="tokens held (default: max_position_embeddings)")
    parser.add_argument("--prompt", type=int, default=None, help="tokens of the first step (default: the context)")
    parser.add_argument("--batch", type=int, default=1, help="sequences (x beams)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    storage = parser.add_mutually_exclusive_group()
    storage.add_argument("--fixed", action="store_true", help="fixed capacity: max_cache_len = the context")
    storage.add_argument("--max-cache-len", type=int, default=None, help="fixed capacity of this many tokens")
    parser.add_argument("--rollback-margin", type=int, default=0)
    parser.add_argument("--initial-capacity", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    parser.add_argument("--budget", type=parse_bytes, default=None, help="KV memory per process, e.g. 24GiB")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--list-presets", action="store_true", help="list the presets and their sources")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_presets:
        for preset in PRESETS.values():
            print(f"{preset.name}: {preset.model_type} {preset.values}\n    source: {preset.source}")
        return 0
    if args.model is None:
        parser.error("give a preset, a config.json or a model directory (or --list-presets)")
    try:
        config = load_config(args.model)
        text = text_config(config)
        context = args.context or text.max_position_embeddings
        max_cache_len = context if args.fixed else args.max_cache_len
        options = dict(
            batch_size=args.batch,
            dtype=args.dtype,
            rollback_margin=args.rollback_margin,
            initial_capacity=args.initial_capacity,
            tp_size=args.tp,
            pp_size=args.pp,
        )
        plan = plan_kv_memory(config, context, prompt_length=args.prompt, max_cache_len=max_cache_len, **options)
        fits = {}
        if args.budget is not None:
            fixed = max_cache_len is not None
            new_tokens = 0 if args.prompt is None else context - args.prompt
            for name in CACHE_LABELS:
                fits[name] = max_context_length(
                    config, args.budget, name, fixed=fixed, new_tokens=new_tokens, **options
                )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        output = {"model": args.model, **plan.to_dict()}
        if args.budget is not None:
            output["budget_bytes"] = args.budget
            output["max_context_length"] = fits
        print(json.dumps(output, indent=2))
        return 0
    print(f"{args.model}: {_describe(config, args.tp)}")
    print(format_plan(plan))
    if args.budget is not None:
        limit = text.max_position_embeddings
        scenario = f", {context - args.prompt} of them generated" if args.prompt is not None else ""
        print(f"Longest context within {_size(args.budget)} of KV per process{scenario} (the model allows {limit}):")
        for name, tokens in fits.items():
            shown = "any length (nothing grows with the context)" if tokens is None else f"{tokens} tokens"
            note = " (beyond max_position_embeddings)" if tokens is None or tokens > limit else ""
            print(f"  {CACHE_LABELS[name]:<17}{shown}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
