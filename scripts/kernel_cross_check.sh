#!/usr/bin/env bash
# Random cases of the native code-attention kernel (hybrid_cache/csrc/code_attention.c) against a reference in plain
# C (tests/kernel/cross_check.c), for one instruction set:
#
#   bash scripts/kernel_cross_check.sh aarch64        # cross-compiled with Debian's gcc-aarch64-linux-gnu, run under
#                                                     # qemu-aarch64 (qemu-user): the NEON + dot-product build on
#                                                     # OpenMP threads on a CPU with the extension (-cpu max), plain
#                                                     # NEON on the library's own pool on one without (-cpu cortex-a57)
#   bash scripts/kernel_cross_check.sh x86-64-avx2    # natively (needs a CPU with AVX2 + FMA + F16C), on the own pool
#                                                     # and on OpenMP teams capped at 2 threads (-fopenmp,
#                                                     # OMP_THREAD_LIMIT=2: a team smaller than the threads asked
#                                                     # for must still take every item)
#   bash scripts/kernel_cross_check.sh x86-64-avx512  # as avx2 where the CPU has AVX-512 VNNI; elsewhere it only
#                                                     # checks that the AVX-512 and AVX-VNNI builds compile (qemu-user
#                                                     # 7.2 emulates neither)
#
# Ends with `<target>: N/N cases match` and exits 0 only when every case matched (at least 20). CASES=n sets the
# number of cases per build (default 40 natively; under qemu 24 with the dot product + 16 without, ~2-3 minutes on a
# shared core). Missing Debian packages are installed when running as root (CI); otherwise it says what to install.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-}"
kernel=hybrid_cache/csrc/code_attention.c
driver=tests/kernel/cross_check.c
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

need() {  # need <command> <debian package>: install the package when the command is missing
    command -v "$1" >/dev/null && return
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "[cross-check] installing $2 (for $1)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
    else
        echo "[cross-check] $1 is missing: install the Debian package $2 (apt-get install -y $2)" >&2
        exit 2
    fi
}

total=0
matched=0
run_build() {  # run_build <label> <cases> <command...>: adds the build's counts from its last line
    local label="$1" cases="$2"
    shift 2
    local line
    line="$("$@" "$label" "$cases" | tail -n 1)" || true  # a mismatch exits 1: counted below
    echo "[cross-check] $line"
    local counts="${line##*: }"
    counts="${counts%% cases match}"
    matched=$((matched + ${counts%%/*}))
    total=$((total + ${counts##*/}))
}

case "$target" in
aarch64)
    need aarch64-linux-gnu-gcc gcc-aarch64-linux-gnu
    need qemu-aarch64 qemu-user
    flags=(-O2 -pthread -static -Wall -Wextra -Werror)
    # (static libgomp makes the linker warn that dlopen needs glibc at run time: true, and harmless under qemu)
    aarch64-linux-gnu-gcc "${flags[@]}" -fopenmp -march=armv8.2-a+dotprod "$driver" "$kernel" -lm -o "$work/dotprod" \
        2> >(grep -v -e "statically linked applications requires" -e "in function" >&2)
    aarch64-linux-gnu-gcc "${flags[@]}" -march=armv8-a "$driver" "$kernel" -lm -o "$work/plain"
    run_build "neon+dotprod on openmp under qemu -cpu max" "${CASES:-24}" qemu-aarch64 -cpu max "$work/dotprod"
    run_build "neon under qemu -cpu cortex-a57" "${CASES:-16}" qemu-aarch64 -cpu cortex-a57 "$work/plain"
    ;;
x86-64-avx2)
    need cc gcc
    grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo ||
        { echo "[cross-check] this CPU lacks AVX2 / FMA / F16C" >&2; exit 2; }
    cc -O2 -pthread -Wall -Wextra -Werror -mavx2 -mfma -mf16c "$driver" "$kernel" -lm -o "$work/avx2"
    run_build "avx2" "${CASES:-40}" "$work/avx2"
    cc -O2 -pthread -fopenmp -Wall -Wextra -Werror -mavx2 -mfma -mf16c "$driver" "$kernel" -lm -o "$work/avx2-openmp"
    run_build "avx2 on openmp, teams of at most 2" "${CASES:-40}" env OMP_THREAD_LIMIT=2 "$work/avx2-openmp"
    if grep -qw avx_vnni /proc/cpuinfo; then
        cc -O2 -pthread -Wall -Wextra -Werror -mavx2 -mfma -mf16c -mavxvnni "$driver" "$kernel" -lm -o "$work/vnni"
        run_build "avx2+avx-vnni" "${CASES:-40}" "$work/vnni"
    else
        cc -O2 -pthread -Wall -Wextra -Werror -mavx2 -mfma -mf16c -mavxvnni -c "$kernel" -o "$work/vnni.o"
        echo "[cross-check] avx2+avx-vnni: compiles (not run: this CPU has no avx_vnni)"
    fi
    ;;
x86-64-avx512)
    need cc gcc
    flags=(-O2 -pthread -Wall -Wextra -Werror -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c -mfma)
    if grep -qw avx512_vnni /proc/cpuinfo && grep -qw avx512bw /proc/cpuinfo && grep -qw avx512vl /proc/cpuinfo; then
        cc "${flags[@]}" "$driver" "$kernel" -lm -o "$work/avx512"
        run_build "avx512" "${CASES:-40}" "$work/avx512"
        cc "${flags[@]}" -fopenmp "$driver" "$kernel" -lm -o "$work/avx512-openmp"
        run_build "avx512 on openmp, teams of at most 2" "${CASES:-40}" env OMP_THREAD_LIMIT=2 "$work/avx512-openmp"
    else
        cc "${flags[@]}" -c "$kernel" -o "$work/avx512.o"
        echo "[cross-check] x86-64-avx512: compiles; no case run (this CPU lacks AVX-512 VNNI)"
        exit 0
    fi
    ;;
*)
    echo "usage: bash scripts/kernel_cross_check.sh aarch64|x86-64-avx2|x86-64-avx512" >&2
    exit 2
    ;;
esac
echo "$target: $matched/$total cases match"
[ "$total" -ge 20 ] && [ "$matched" = "$total" ]
