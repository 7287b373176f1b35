"""A quantized `.pte` against its reference, teacher-forced (docs/export.md, issue 43 item 4).

The reference is the same quantized model in eager PyTorch without a cache (`quantize_model`, the function
`export_program(..., quantize=...)` runs): one forward of the whole sequence. The sequence is the README's workload:
the first 5,000 characters of the default text (1,210 tokens, BOS first), then the fp32 model's 128 greedy tokens
(eager, `DynamicCache`). The program (`load_program`, ExecuTorch's runtime) is fed the prompt in one call and then
the 128 tokens one step at a time; at every position past the prompt the two predicted tokens are compared and the
largest |logit difference| is printed. Also printed, for the docs only: how many of its first 32 greedy tokens the
program shares with fp32's (4-bit weights diverge from fp32 within a few tokens in every peer).

    python benchmarks/quantized_agreement.py gemma3-8da4w.pte [--model DIR] [--new 128] [--eager-stepped] [--json F]

Needs the `export` extra.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", help="a .pte written by export_program(..., quantize=...)")
    parser.add_argument("--model", default=None, help="the checkpoint it was exported from (default: embedded)")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument(
        "--eager-stepped",
        action="store_true",
        help="also the reference against itself fed step by step with DynamicCache (the noise floor of the measure)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import DynamicCache

    from hybrid_cache.export import load_program
    from hybrid_cache.export.quantize import quantize_model
    from hybrid_cache.tools.models import load_model
    from hybrid_cache.tools.text import load_text

    program = load_program(args.program)
    quantization = program.metadata.quantization
    if quantization is None:
        raise SystemExit(f"{args.program}: an fp32 program; this compares a quantized one with its reference.")
    model, tokenizer = load_model(args.model, attn_implementation="sdpa")
    prompt = tokenizer(load_text()[0][:5000], return_tensors="pt").input_ids
    with torch.inference_mode():
        fp32 = model.generate(
            prompt, past_key_values=DynamicCache(config=model.config), max_new_tokens=args.new, do_sample=False
        )
        quantize_model(model, quantization)
        reference = model(input_ids=fp32, use_cache=False).logits[0, prompt.shape[1] - 1 : -1].float()
        floor = _eager_stepped(model, prompt, fp32, reference) if args.eager_stepped else None
    steps = [program.logits(prompt)]
    for end in range(prompt.shape[1] + 1, fp32.shape[1]):
        steps.append(program.logits(fp32[:, :end]))
    ours = torch.cat(steps).float()
    agree = int((ours.argmax(-1) == reference.argmax(-1)).sum())
    largest = float((ours - reference).abs().max())
    program.reset()
    greedy = program.generate(prompt, max_new_tokens=32)[0, prompt.shape[1] :]
    shared = int((greedy == fp32[0, prompt.shape[1] : prompt.shape[1] + 32]).sum())
    first_divergence = next((i for i, same in enumerate(greedy == fp32[0, prompt.shape[1] :][:32]) if not same), 32)
    result = {
        "program": args.program,
        "quantization": quantization,
        "prompt_tokens": prompt.shape[1],
        "positions": len(steps),
        "agreement": agree,
        "max_abs_logit_difference": largest,
        "greedy_shared_with_fp32_of_32": shared,
        "greedy_first_divergence": first_divergence,
        "eager_stepped": floor,
    }
    print(
        f"{quantization} program against the same quantized model in eager PyTorch, teacher-forced on "
        f"{prompt.shape[1]} + {len(steps)} tokens: predicted tokens agree at {agree}/{len(steps)} positions, "
        f"largest |logit difference| {largest:.4f}; greedy: {shared} of its first 32 tokens equal fp32's "
        f"(first difference at token {first_divergence})"
    )
    if floor is not None:
        print(
            f"the reference against itself fed step by step with DynamicCache: agree at {floor['agreement']}/"
            f"{len(steps)} positions, largest |logit difference| {floor['max_abs_logit_difference']:.4f}; "
            f"{floor['margins_under_half']} positions have their top two reference logits within 0.5 "
            f"(the closest {floor['smallest_margin']:.3f})"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


def _eager_stepped(model, prompt, sequence, reference) -> dict:
    """The quantized model fed the prompt, then one token per step, with `DynamicCache`, against its own no-cache
    forward (`reference`): how far another summation order alone moves the predictions."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    steps = [model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[0, -1:]]
    for position in range(prompt.shape[1], sequence.shape[1] - 1):
        token = sequence[:, position : position + 1]
        steps.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1:])
    stepped = torch.cat(steps).float()
    top2 = reference.topk(2, -1).values
    margins = top2[:, 0] - top2[:, 1]
    return {
        "agreement": int((stepped.argmax(-1) == reference.argmax(-1)).sum()),
        "max_abs_logit_difference": float((stepped - reference).abs().max()),
        "margins_under_half": int((margins < 0.5).sum()),
        "smallest_margin": float(margins.min()),
    }


if __name__ == "__main__":
    main()
