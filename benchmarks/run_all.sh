#!/usr/bin/env bash
# Every benchmark behind the tables of docs/benchmarks.md and the README's results, one after the other, each logged
# with the load average before and after it. Run it on a quiet machine (nothing else running): about 25 minutes on 2
# CPU cores, of which ~12.5 for the 16384-token prefills (ONLY="decode_real prefill_4096 ..." runs a subset).
# Outputs in $OUT (default out/bench): <name>.log and <name>.json per run; plots in docs/img/.
#
#   bash benchmarks/run_all.sh
set -euo pipefail
source "$(dirname "$0")/../scripts/python_env.sh"
hc_resolve_python --no-create
cd "$(hc_repo_root)"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-out/bench}"
mkdir -p "$OUT"
load() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || uptime; }

run() {  # run NAME COMMAND...: unless ONLY is set and does not name it
    local name=$1 start=$SECONDS
    shift
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    echo "== $name: $* (load average before: $(load))"
    "$@" 2>&1 | tee "$OUT/$name.log"
    echo "== $name: $((SECONDS - start)) s (load average after: $(load))" | tee -a "$OUT/$name.log"
}

bench() { "$PYTHON" -m hybrid_cache.tools.cli.bench "$@"; }

# Decode, real model (Gemma 3 270M), both dtypes.
run decode_real bench --model default --dtypes bfloat16 float32 --contexts 1024 4096 16384 --batch 1 8 --steps 4 \
    --warmup 1 --reps 3 --json "$OUT/decode_real.json" --plot docs/img/decode_real.png
# Decode, realistic windows: a random model with Gemma 3 4B's K/V geometry, window 1024 (its own) and 4096.
run decode_4b bench --model tiny-4b --window 1024 4096 --dtypes bfloat16 --contexts 4096 16384 --batch 1 8 --steps 8 \
    --warmup 2 --reps 3 --json "$OUT/decode_4b.json" --plot docs/img/decode_tiny4b.png
# Cache operations alone, per step (median, and mean = amortized incl. growth steps).
run cache_ops "$PYTHON" benchmarks/cache_ops.py --steps 100 --reps 3
# Chunked prefill, real model: 4096 tokens (2 reps), 16384 tokens (1 rep), chunks 128/512/2048, fp32 and bf16.
run prefill_4096 bench --model default --prefill --dtypes float32 bfloat16 --contexts 4096 --chunk-size 128 512 2048 \
    --reps 2 --json "$OUT/prefill_4096.json"
run prefill_16384 bench --model default --prefill --dtypes float32 bfloat16 --contexts 16384 \
    --chunk-size 128 512 2048 --reps 1 --json "$OUT/prefill_16384.json"
# generate(prefill_chunk_size=2048) of a 32768-token prompt into a HybridRingCache: the bound on a sliding update.
run chunk_check bench --model tiny --prefill-chunk-check --prompt-length 32768 --chunk-size 2048 --window 512 4096 \
    --json "$OUT/chunk_check.json"
