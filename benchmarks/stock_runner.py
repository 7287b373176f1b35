"""`.pte` programs under ExecuTorch's stock `TextLLMRunner`, side by side in one run (docs/export.md, issue 43):
this package's programs (fp32 and `--quantize 8da4w`) and any other `.pte` a user would pick instead (e.g.
optimum-executorch's, exported in a venv of its own), each run in a fresh process that imports only ExecuTorch's
runner, ops and kernels.

The workload is the README's: the first 5,000 characters of the default text (1,210 tokens with BOS), then 128 greedy
tokens. Per program and round: time to first token and decode ms/token (the runner's own statistics: decode is the
mean of the 127 steps after the first token), peak RSS of its process, its file size; rounds interleaved, medians
printed with the load average of each row. A program whose prompt must be fed in pieces (`NAME.pte:511`: at most 511
tokens per call, optimum-executorch's Gemma 3) gets `prefill` calls of that many tokens first, and the table says so.

    python benchmarks/stock_runner.py gemma3.pte gemma3-8da4w.pte optimum/model.pte:511 \
        --tokenizer gemma3.tokenizer.json [--rounds 2] [--new 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys, time
import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama:: ops)
import executorch.kernels.quantized  # noqa: F401  (embedding_byte)
from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

pte, tokenizer, pieces_file, new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
pieces = json.load(open(pieces_file))
runner = TextLLMRunner(pte, tokenizer)
stats, began = [], time.perf_counter()
for index, piece in enumerate(pieces[:-1]):
    runner.prefill(piece, GenerationConfig(temperature=0, num_bos=int(index == 0), echo=False))
prefilled = time.perf_counter() - began
config = GenerationConfig(max_new_tokens=new, temperature=0, num_bos=int(len(pieces) == 1), echo=False)
runner.generate(pieces[-1], config, None, stats.append)
s = stats[-1]
print("RESULT " + json.dumps({
    "ttft_ms": 1000 * prefilled + s.first_token_ms - s.inference_start_ms,
    "decode_ms": (s.inference_end_ms - s.first_token_ms) / (new - 1),
    "prompt_tokens": s.num_prompt_tokens,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def median_row(label: str, size_mib: float, calls: object, results: list[dict]) -> str:
    """One table row (benchmarks/peers.py prints its rows with it too): the medians of a program's rounds (time to
    first token, decode ms/token, peak RSS) and each round's load average."""

    def median(key: str) -> float:
        return statistics.median(result[key] for result in results)

    loads = " / ".join(f"{result['load']:.2f}" for result in results)
    return (
        f"| {label} | {size_mib:.1f} | {calls} | {median('ttft_ms') / 1000:.2f} | {median('decode_ms'):.1f} "
        f"| {median('peak_rss_mib'):.0f} | {loads} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("programs", nargs="+", help="PATH.pte, or PATH.pte:N to feed the prompt in pieces of N tokens")
    parser.add_argument("--tokenizer", required=True, help="the model's tokenizer.json")
    parser.add_argument("--python", default=sys.executable, help="a Python with executorch (default: this one)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    from hybrid_cache.tools.text import load_text

    text = load_text()[0][:5000]
    tokenizer = Tokenizer.from_file(args.tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for spec in args.programs:
                path, _, size = spec.partition(":")
                step = int(size) if size else len(ids) + 1
                pieces = [tokenizer.decode(ids[i : i + step]) for i in range(0, len(ids), step)]
                pieces_file = Path(scratch) / "pieces.json"
                pieces_file.write_text(json.dumps(pieces))
                load = os.getloadavg()[0]
                done = subprocess.run(
                    [args.python, "-c", CHILD, path, args.tokenizer, str(pieces_file), str(args.new)],
                    capture_output=True,
                    text=True,
                )
                if done.returncode != 0 or "RESULT " not in done.stdout:
                    tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
                    print(f"  {spec}: failed ({' '.join(tail)})")
                    continue
                result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
                result.update(load=load, pieces=len(pieces), round=round_)
                rows.setdefault(spec, []).append(result)
    print(f"prompt: {len(ids) + 1} tokens with BOS, then {args.new} greedy tokens; {args.rounds} interleaved rounds")
    print("| program | file MiB | prompt calls | TTFT s | decode ms/token | peak RSS MiB | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for spec, results in rows.items():
        path = spec.partition(":")[0]
        print(median_row(path, os.path.getsize(path) / 2**20, results[0]["pieces"], results))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
