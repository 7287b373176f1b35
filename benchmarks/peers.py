"""The on-device peers that are not `.pte` programs, on the README's workload, each in a venv of its own (docs/export.md,
issue 43 item 5): ONNX Runtime GenAI (its model builder's int4 model) and llama.cpp (llama-cpp-python, the embedded
Q4_K_M GGUF). Neither is a dependency of this package: pass each one's Python.

The workload is benchmarks/stock_runner.py's: the first 5,000 characters of the default text, BOS first (each peer's
own tokenizer), in one call, then 128 greedy tokens; 2 threads. Per peer and round, in a fresh process: time to first
token (the prompt's call and the first token), decode ms/token (the mean of the 127 steps after it), peak RSS, the
model's size on disk; rounds interleaved, medians, the load average of each row.

    python benchmarks/peers.py --ortgenai /tmp/venv-ortgenai/bin/python:/tmp/gemma3-int4 \
        --llamacpp /tmp/venv-llamacpp/bin/python:~/.cache/hybrid_cache/gguf/gemma-3-270m-q4_k_m.gguf [--rounds 2]

(ONNX Runtime GenAI's int4 model: `python -m onnxruntime_genai.models.builder -i CHECKPOINT -o OUT -p int4 -e cpu`
in its venv; CHECKPOINT is the embedded model's converted directory, `hybrid_cache.tools.models.load_model`'s.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ORTGENAI = """
import json, resource, sys, time
import onnxruntime_genai as og

path, text_file, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
config = og.Config(path)
config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
model = og.Model(config)
tokenizer = og.Tokenizer(model)
ids = tokenizer.encode(open(text_file).read())
params = og.GeneratorParams(model)
params.set_search_options(max_length=len(ids) + new, do_sample=False)
generator = og.Generator(model, params)
began = time.perf_counter()
generator.append_tokens(ids)
generator.generate_next_token()
first = time.perf_counter()
for _ in range(new - 1):
    generator.generate_next_token()
end = time.perf_counter()
print("RESULT " + json.dumps({
    "ttft_ms": 1000 * (first - began), "decode_ms": 1000 * (end - first) / (new - 1), "prompt_tokens": len(ids),
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""

LLAMACPP = """
import json, resource, sys, time
from llama_cpp import Llama

path, text_file, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=2048, n_batch=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
ids = llm.tokenize(open(text_file).read().encode(), add_bos=True, special=False)
began = time.perf_counter()
times = []
for count, token in enumerate(llm.generate(ids, temp=0.0, reset=True)):
    times.append(time.perf_counter())
    if count + 1 == new:
        break
print("RESULT " + json.dumps({
    "ttft_ms": 1000 * (times[0] - began), "decode_ms": 1000 * (times[-1] - times[0]) / (new - 1),
    "prompt_tokens": len(ids), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""

CHILDREN = {"ortgenai": ("ONNX Runtime GenAI int4", ORTGENAI), "llamacpp": ("llama.cpp Q4_K_M GGUF", LLAMACPP)}


def size_mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, (label, _) in CHILDREN.items():
        parser.add_argument(f"--{name}", default=None, metavar="PYTHON:MODEL", help=f"{label}: its Python and model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from stock_runner import median_row  # this folder's: the same table rows

    from hybrid_cache.tools.text import load_text

    peers = {}
    for name in CHILDREN:
        spec = getattr(args, name)
        if spec:
            python, _, model = spec.partition(":")
            peers[name] = (python, Path(os.path.expanduser(model)))
    if not peers:
        parser.error("name at least one peer (--ortgenai, --llamacpp)")
    rows: dict[str, list[dict]] = {name: [] for name in peers}
    with tempfile.TemporaryDirectory() as scratch:
        text_file = Path(scratch) / "prompt.txt"
        text_file.write_text(load_text()[0][:5000])
        for _ in range(args.rounds):
            for name, (python, model) in peers.items():
                load = os.getloadavg()[0]
                command = [
                    python,
                    "-c",
                    CHILDREN[name][1],
                    str(model),
                    str(text_file),
                    str(args.new),
                    str(args.threads),
                ]
                done = subprocess.run(command, capture_output=True, text=True, timeout=900)
                if done.returncode != 0 or "RESULT " not in done.stdout:
                    print(f"{name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                    continue
                result = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
                rows[name].append({**result, "load": load})
    print("| peer | model MiB | prompt tokens | TTFT s | decode ms/token | peak RSS MiB | load |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, results in rows.items():
        if not results:
            continue
        print(median_row(CHILDREN[name][0], size_mib(peers[name][1]), results[0]["prompt_tokens"], results))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
