"""Where a decode step's time goes in a `.pte`: ExecuTorch's ETDump, per operator (docs/export.md, issue 43 item 2).

The program is loaded with ETDump on (`Runtime.load_program(..., enable_etdump=True)`), fed a prompt of `--context`
tokens in one call (or in calls of `--piece` tokens) through `forward(tokens, start_pos)`, as `TextLLMRunner` feeds
it, then `--steps` decode steps of one token; the first step is left out as warm-up. Printed per event name, summed
over the steps and divided by their number: calls per step, microseconds per step and share of the step
(`Method::execute`). Portable / optimized kernels appear as `native_call_<op>`, ExecuTorch's LLM ops as
`llama::...`, work inside XNNPACK's delegate under XNNPACK's own operator names (e.g. `Fully Connected (NC, F32)
GEMM`, its instances summed), each delegate call as `DELEGATE_CALL` (its time includes the XNNPACK operators listed
under it); `OPERATOR_CALL` (the wrapper around every kernel call) is omitted.

    python benchmarks/profile_step.py gemma3.pte [--context 1210] [--piece N] [--steps 33] [--top 25] [--json out.json]

Works on any `.pte` with that interface (optimum-executorch's too: `--piece 511` feeds their Gemma 3 its prompt in
calls it takes). Needs ExecuTorch (the `export` extra); the timed process imports no hybrid_cache code.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import tempfile

import torch

WRAPPERS = ("OPERATOR_CALL", "Method::execute")


def profile(path: str, context: int, steps: int, piece: int) -> tuple[list[dict], float]:
    """Per-event rows (name, calls and microseconds per step) and the mean step time in microseconds."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama:: ops)
    import executorch.kernels.quantized  # noqa: F401  (embedding_byte)
    from executorch.devtools.etdump.serialize import deserialize_from_etdump_flatcc
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(path, enable_etdump=True, debug_buffer_size=0)
    forward = program.load_method("forward")
    vocab = 1000  # the token ids do not change a step's work; below every vocabulary's size unless it says less
    if "get_vocab_size" in program.method_names:
        vocab = min(vocab, int(program.load_method("get_vocab_size").execute([])[0]))
    generator = torch.Generator().manual_seed(0)
    for start in range(0, context, piece):
        size = min(piece, context - start)
        forward.execute([torch.randint(3, vocab, (1, size), generator=generator), torch.tensor([start])])
    for step in range(steps):
        forward.execute([torch.randint(3, vocab, (1, 1), generator=generator), torch.tensor([context + step])])
    with tempfile.TemporaryDirectory() as scratch:
        etdump = os.path.join(scratch, "run.etdp")
        program.write_etdump_result_to_file(etdump, os.path.join(scratch, "debug.bin"))
        with open(etdump, "rb") as file:
            runs = deserialize_from_etdump_flatcc(file.read()).run_data
    decode = [run for run in runs if any(_name(e) == "Method::execute" for e in run.events)][-(steps - 1) :]
    calls: collections.Counter = collections.Counter()
    ticks: collections.Counter = collections.Counter()
    for run in decode:
        for event in run.events:
            name = _name(event)
            if name is not None:
                calls[name] += 1
                ticks[name] += event.profile_event.end_time - event.profile_event.start_time
    count = len(decode)
    step_us = ticks["Method::execute"] / count / 1000
    rows = [
        {"event": name, "calls_per_step": calls[name] / count, "us_per_step": ticks[name] / count / 1000}
        for name in ticks
        if name not in WRAPPERS
    ]
    rows.sort(key=lambda row: -row["us_per_step"])
    return rows, step_us


def _name(event) -> str | None:
    profile_event = event.profile_event
    if profile_event is None:
        return None
    name = profile_event.name or profile_event.delegate_debug_id_str
    return re.sub(r" #\d+$", "", name) if name else None  # XNNPACK numbers each instance of an operator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", help="a .pte with forward(tokens [1, n], start_pos [1])")
    parser.add_argument("--context", type=int, default=1210, help="prompt tokens fed in one call first")
    parser.add_argument("--piece", type=int, default=None, help="feed the prompt in calls of at most this many")
    parser.add_argument("--steps", type=int, default=33, help="decode steps (the first is warm-up)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows, step_us = profile(args.program, args.context, args.steps, args.piece or args.context)
    print(
        f"{args.program}: decode step at positions {args.context + 1}-{args.context + args.steps - 1}, "
        f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}: {step_us / 1000:.2f} ms per step"
    )
    print("| event | calls / step | us / step | share of the step |\n| --- | ---: | ---: | ---: |")
    for row in rows[: args.top]:
        share = row["us_per_step"] / step_us
        print(f"| `{row['event']}` | {row['calls_per_step']:g} | {row['us_per_step']:.0f} | {share:.1%} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"program": args.program, "step_us": step_us, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
