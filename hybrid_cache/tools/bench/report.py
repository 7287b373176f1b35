"""Tables and plots of benchmark results: decode (eager and compiled), K/V memory, chunked prefill, time to first token.

Every table has two views: the full one (``full=True``, the default of these functions; the JSON always keeps it and
``hybrid-cache-bench --full-table`` prints it), and a compact one (``full=False``, what the command prints by default,
about 110 characters for the three exact caches): one median per cache and the ratios between caches, without the
min / cache ms / copy MiB / compile columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import compare
from .compiled import COMPILEABLE_CACHES
from .decode import BenchResult
from .prefill import PrefillResult, TtftResult

__all__ = [
    "LLAMA_CPP_REPORTED",
    "format_compiled_table",
    "format_memory_table",
    "format_prefill_table",
    "format_table",
    "format_ttft_table",
    "plot_results",
    "plot_ttft",
]

BUSY_MARK = "!"
BUSY_NOTE = (
    f"{BUSY_MARK} = other processes kept more of this process' CPUs busy than the benchmark leaves free while "
    "the row was measured\n(JSON competing_load): its timings are not trustworthy; re-run on a quiet machine."
)


def _ratio(a: float | None, b: float | None, digits: int = 2) -> str:
    return f"{a / b:.{digits}f}x" if a is not None and b else "-"


def _point_key(k: tuple) -> tuple:
    return tuple(x if x is not None else 0 for x in k)


def _comparison_table(
    rows: dict[tuple, dict[str, Any]],
    caches: Sequence[str],
    point_header: str,
    point: Callable[[tuple], str],
    cell_header: Callable[[str], str],
    cell: Callable[[Any], str],
    metric: Callable[[Any], float],
    ratios: Sequence[tuple[str, str]],
) -> str:
    """One line per point: a cell per cache, the ratios of `metric` between pairs of caches, and ``!`` where any of the
    point's rows was measured while other work competed for the CPUs (with a note under the table)."""
    # A column is as wide as its header or its cells, whichever is wider (a long cache name widens its column).
    width = {c: max(len(cell_header(c)), len(cell(None))) for c in caches}
    header = point_header + "".join(f" | {cell_header(c):>{width[c]}}" for c in caches)
    ratio_names = [(a, b) for a, b in ratios if a in caches and b in caches]
    header += "".join(f" | {a + '/' + b:>12}" for a, b in ratio_names) + " | load"
    lines = [header, "-" * len(header)]
    busy = False
    for key in sorted(rows, key=_point_key):
        by_cache = rows[key]
        line = point(key) + "".join(f" | {cell(by_cache[c]) if c in by_cache else '':>{width[c]}}" for c in caches)
        for a, b in ratio_names:
            ra, rb = by_cache.get(a), by_cache.get(b)
            line += f" | {_ratio(ra and metric(ra), rb and metric(rb)):>12}"
        row_busy = any(r.competing_load for r in by_cache.values())
        busy |= row_busy
        lines.append(line + f" | {BUSY_MARK if row_busy else ''}")
    if busy:
        lines.append(BUSY_NOTE)
    return "\n".join(lines)


# Compressed caches printed as a ratio to the exact ring (attention on the codes, and the dequantizing path).
COMPRESSED_RATIO_CACHES = ("ring-int8", "ring-int4", "ring-int8-deq", "ring-int4-deq")


def format_table(results: Sequence[BenchResult], caches: Sequence[str], full: bool = True) -> str:
    """One row per (model, window, dtype, context, batch); per cache ms/token median/min, cache ms/step, KV MiB, copy
    MiB (compact, ``full=False``: the median ms/token only); ring/static and ring/dynamic ratios of the medians; ``!``
    where other work competed for the CPUs."""
    rows: dict[tuple, dict[str, BenchResult]] = {}
    for r in results:
        rows.setdefault((r.model, r.window, r.dtype, r.context, r.batch), {})[r.cache] = r

    def compact_cell(r: BenchResult | None) -> str:
        return f"{'-':>11}" if r is None else f"{r.ms_per_token_median:>11.2f}"

    def cell(r: BenchResult | None) -> str:
        if r is None:
            return f"{'-':>22}{'-':>9}{'-':>9}{'-':>9}"
        cache_ms = f"{r.cache_ms_per_step_median:>9.3f}" if r.cache_ms_per_step_median is not None else f"{'-':>9}"
        return (
            f"{r.ms_per_token_median:>13.2f} / {r.ms_per_token_min:>6.2f}{cache_ms}"
            f"{r.kv_bytes / 2**20:>9.1f}{r.copy_bytes_per_step / 2**20:>9.3f}"
        )

    return _comparison_table(
        rows,
        caches,
        f"{'model':<8}{'win':>5} {'dtype':<9}{'ctx':>6}{'B':>3}",
        lambda k: f"{k[0]:<8}{k[1] or 0:>5} {k[2]:<9}{k[3]:>6}{k[4]:>3}",
        (lambda c: f"{c + ' ms/tok med/min':>22}{'cache ms':>9}{'KV MiB':>9}{'copy MiB':>9}")
        if full
        else (lambda c: f"{c + ' ms/tok':>11}"),
        cell if full else compact_cell,
        lambda r: r.ms_per_token_median,
        (("ring", "static"), ("ring", "dynamic"), *((name, "ring") for name in COMPRESSED_RATIO_CACHES)),
    )


def format_memory_table(results: Sequence[BenchResult], caches: Sequence[str], full: bool = True) -> str:
    """K/V bytes held during the decode runs: per (point, cache) the bytes held at the end, the most held at any point
    (after the prefill or any decode step) and the largest ratio to an exactly sized cache for the same tokens
    (`workload.exact_kv_bytes`; compact, ``full=False``: the bytes at the end only); then ring vs static at the end and
    ring vs dynamic, at the end and at its worst point (the traces of both follow the same schedule, so point i holds
    the same tokens in both)."""
    rows: dict[tuple, dict[str, BenchResult]] = {}
    for r in results:
        if not r.compiled:
            rows.setdefault((r.model, r.window, r.dtype, r.context, r.batch), {})[r.cache] = r
    header = f"{'model':<8}{'win':>5} {'dtype':<9}{'ctx':>6}{'B':>3}"
    for c in caches:
        header += f" | {c + ' MiB end/peak':>22}{'/exact':>8}" if full else f" | {c + ' MiB':>{max(11, len(c) + 4)}}"
    has = {c: c in caches for c in ("ring", "static", "dynamic")}
    if has["ring"] and has["static"]:
        header += f" | {'ring/static':>11}"
    if has["ring"] and has["dynamic"]:
        header += f" | {'ring/dynamic end, max':>21}"
    lines = [header, "-" * len(header)]
    for key in sorted(rows, key=_point_key):
        model, window, dtype, context, batch = key
        by_cache = rows[key]
        line = f"{model:<8}{window or 0:>5} {dtype:<9}{context:>6}{batch:>3}"
        for c in caches:
            r = by_cache.get(c)
            if r is None:
                line += f" | {'-':>22}{'-':>8}" if full else f" | {'-':>{max(11, len(c) + 4)}}"
            elif not full:
                line += f" | {r.kv_bytes / 2**20:>{max(11, len(c) + 4)}.1f}"
            else:
                line += (
                    f" | {r.kv_bytes / 2**20:>12.1f} / {(r.kv_bytes_peak or 0) / 2**20:>7.1f}"
                    f"{_ratio(r.kv_ratio_to_exact_max, 1.0, 3):>8}"
                )
        ring, static, dynamic = (by_cache.get(c) for c in ("ring", "static", "dynamic"))
        if has["ring"] and has["static"]:
            line += f" | {_ratio(ring and ring.kv_bytes, static and static.kv_bytes, 3):>11}"
        if has["ring"] and has["dynamic"]:
            if ring and dynamic and len(ring.kv_trace) == len(dynamic.kv_trace):
                worst = max(b / d for (_, b), (_, d) in zip(ring.kv_trace, dynamic.kv_trace))
                text = f"{ring.kv_bytes / dynamic.kv_bytes:.3f}x, {worst:.3f}x"
            else:
                text = "-"
            line += f" | {text:>21}"
        lines.append(line)
    return "\n".join(lines)


def format_compiled_table(results: Sequence[BenchResult], full: bool = True) -> str:
    """Compiled rows: per cache ms/token median/min, compile seconds (first call), graphs, eager check (compact,
    ``full=False``: the median ms/token, and ``NO`` after it where the compiled steps did not match eager); ratio
    ring/static (compiled), and compiled/eager per cache when eager rows of the same point are in `results`."""
    compiled_rows: dict[tuple, dict[str, BenchResult]] = {}
    eager: dict[tuple, dict[str, BenchResult]] = {}
    for r in results:
        point = (r.model, r.window, r.dtype, r.context, r.batch)
        if r.compiled:
            compiled_rows.setdefault(point + (r.compile_mask,), {})[r.cache] = r
        else:
            eager.setdefault(point, {})[r.cache] = r
    caches = [c for c in COMPILEABLE_CACHES if any(c in v for v in compiled_rows.values())]
    header = f"{'model':<8}{'win':>5} {'dtype':<9}{'ctx':>6}{'B':>3} {'masks':<8}"
    for c in caches:
        header += (
            f" | {c + ' ms/tok med/min':>22}{'compile s':>10}{'graphs':>7}{'eager=':>7}"
            if full
            else f" | {c + ' ms/tok':>{max(14, len(c) + 7)}}"
        )
    header += f" | {'ring/static':>11}"
    for c in caches:
        header += f" | {c + ' c/eager':>14}"
    lines = [header, "-" * len(header)]
    for key in sorted(compiled_rows, key=_point_key):
        model, window, dtype, context, batch, mask = key
        by_cache = compiled_rows[key]
        line = f"{model:<8}{window or 0:>5} {dtype:<9}{context:>6}{batch:>3} {mask or '-':<8}"
        for c in caches:
            r = by_cache.get(c)
            if r is None:
                line += f" | {'-':>22}{'-':>10}{'-':>7}{'-':>7}" if full else f" | {'-':>{max(14, len(c) + 7)}}"
            elif not full:
                flag = " NO" if r.compiled_matches_eager is False else ""
                line += f" | {r.ms_per_token_median:>{max(14, len(c) + 7) - 3}.2f}{flag:<3}"
            else:
                match = {True: "yes", False: "NO", None: "-"}[r.compiled_matches_eager]
                line += (
                    f" | {r.ms_per_token_median:>13.2f} / {r.ms_per_token_min:>6.2f}{r.compile_seconds or 0:>10.1f}"
                    f"{r.graphs:>7}{match:>7}"
                )
        ring, static = by_cache.get("ring"), by_cache.get("static")
        line += f" | {_ratio(ring and ring.ms_per_token_median, static and static.ms_per_token_median):>11}"
        for c in caches:
            r, e = by_cache.get(c), eager.get(key[:5], {}).get(c)
            line += f" | {_ratio(r and r.ms_per_token_median, e and e.ms_per_token_median):>14}"
        lines.append(line)
    return "\n".join(lines)


def format_prefill_table(results: Sequence[PrefillResult], caches: Sequence[str], full: bool = True) -> str:
    """One row per (model, window, dtype, context, chunk): per cache prefill seconds median/min and peak K/V MiB
    (compact, ``full=False``: the median seconds only); ring/dynamic and ring/static ratios of the medians; ``!`` where
    other work competed for the CPUs."""
    rows: dict[tuple, dict[str, PrefillResult]] = {}
    for r in results:
        rows.setdefault((r.model, r.window, r.dtype, r.context, r.chunk), {})[r.cache] = r

    def cell(r: PrefillResult | None) -> str:
        if r is None:
            return f"{'-':>19}{'-':>12}"
        return f"{r.prefill_ms_median / 1e3:>10.2f} / {r.prefill_ms_min / 1e3:>6.2f}{r.peak_kv_bytes / 2**20:>12.1f}"

    def compact_cell(r: PrefillResult | None) -> str:
        return f"{'-':>11}" if r is None else f"{r.prefill_ms_median / 1e3:>11.2f}"

    return _comparison_table(
        rows,
        caches,
        f"{'model':<8}{'win':>5} {'dtype':<9}{'ctx':>6}{'chunk':>6}",
        lambda k: f"{k[0]:<8}{k[1] or 0:>5} {k[2]:<9}{k[3]:>6}{k[4]:>6}",
        (lambda c: f"{c + ' s med/min':>19}{'peak KV MiB':>12}") if full else (lambda c: f"{c + ' s':>11}"),
        cell if full else compact_cell,
        lambda r: r.prefill_ms_median,
        (("ring", "dynamic"), ("ring", "static")),
    )


#: llama.cpp on the same prompt, as reported in issue 37 (not measured by this benchmark): llama-cpp-python 0.3.36, the
#: embedded model's GGUF with its 4-bit weights, ubatch 512, 2 threads, 8192 tokens: seconds to evaluate the prompt.
LLAMA_CPP_REPORTED = {8192: {"flash attention": 26.2, "no flash attention": 27.2}}


def format_ttft_table(results: Sequence[TtftResult], variants: Sequence[str]) -> str:
    """One row per (dtype, context): per variant the median seconds to the first token and the peak RSS rise (MiB);
    the ratios of ``ring-banded`` to the others; whether every variant's first token equals the first variant's;
    ``!`` where other work competed for the CPUs. A last line gives llama.cpp's reported time where there is one."""
    rows: dict[tuple, dict[str, TtftResult]] = {}
    for r in results:
        rows.setdefault((r.dtype, r.context), {})[r.variant] = r
    focus = "ring-banded"
    ratios = [(focus, other) for other in variants if other != focus]
    table = _comparison_table(
        rows,
        variants,
        f"{'dtype':<9}{'ctx':>6}",
        lambda k: f"{k[0]:<9}{k[1]:>6}",
        lambda c: f"{c + ' s':>17}{'MiB':>8}",
        lambda r: (
            f"{'-':>17}{'-':>8}" if r is None else f"{r.ttft_s_median:>17.2f}{r.peak_rss_delta_bytes / 2**20:>8.0f}"
        ),
        lambda r: r.ttft_s_median,
        ratios,
    )
    lines = table.splitlines()
    lines[0] += f" | {focus + '/best chunk':>22} | tokens"
    lines[1] += "-" * 34
    for index, key in enumerate(sorted(rows, key=_point_key)):
        by_variant = rows[key]
        chunked = [r.ttft_s_median for v, r in by_variant.items() if "chunk" in v]
        best = _ratio(by_variant[focus].ttft_s_median, min(chunked)) if chunked and focus in by_variant else "-"
        same = all(r.same_token for r in by_variant.values())
        lines[2 + index] += f" | {best:>22} | " + ("equal" if same else "DIFFER")
    for context, reported in LLAMA_CPP_REPORTED.items():
        if any(r.context == context for r in results):
            shown = ", ".join(f"{name} {seconds} s" for name, seconds in reported.items())
            lines.append(
                f"llama.cpp at {context} tokens (4-bit GGUF, ubatch 512, 2 threads; reported in issue 37): {shown}"
            )
    return "\n".join(lines)


def plot_ttft(results: Sequence[TtftResult], path: str) -> None:
    """PNG: time to first token and peak RSS rise vs prompt length, one line per variant (llama.cpp's reported
    point added)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r.variant for r in results))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for variant in variants:
        points = sorted((r.context, r.ttft_s_median, r.peak_rss_delta_bytes) for r in results if r.variant == variant)
        contexts = [p[0] for p in points]
        left.plot(contexts, [p[1] for p in points], marker="o", label=variant)
        right.plot(contexts, [p[2] / 2**30 for p in points], marker="o", label=variant)
    for context, reported in LLAMA_CPP_REPORTED.items():
        if any(r.context == context for r in results):
            left.plot([context], [min(reported.values())], "k*", markersize=10, label="llama.cpp 4-bit (reported)")
    dtype = results[0].dtype if results else ""
    threads = results[0].threads if results else 0
    for ax, label in ((left, "seconds to first token"), (right, "peak RSS rise (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.set_title(f"one whole-prompt generate, {dtype}, {threads} threads", fontsize=9)
    right.set_title("memory", fontsize=9)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_results(results: Sequence[BenchResult], path: str) -> None:
    """PNG of ms/token vs context per cache, one panel per (model/window, dtype, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(compare.CACHE_NAMES)
    panels = sorted({(r.model, r.window, r.dtype, r.batch) for r in results}, key=_point_key)
    cols = min(len(panels), 4) or 1
    rows = (len(panels) + cols - 1) // cols or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        series = sorted(
            {(r.cache, r.compiled, r.compile_mask) for r in results},
            key=lambda k: (names.index(k[0]) if k[0] in names else 99, k[1], k[2] or ""),
        )
        many_masks = len({r.compile_mask for r in results if r.compiled}) > 1
        for cache, compiled, mask in series:
            points = sorted(
                (r.context, r.ms_per_token_median)
                for r in results
                if (r.model, r.window, r.dtype, r.batch) == panel
                and r.cache == cache
                and r.compiled == compiled
                and r.compile_mask == mask
            )
            label = cache + ((" compiled" + (f" ({mask})" if many_masks else "")) if compiled else "")
            if points:
                ax.plot(
                    [p[0] for p in points],
                    [p[1] for p in points],
                    marker="o",
                    label=label,
                    linestyle="--" if compiled else "-",
                )
        model, window, dtype, batch = panel
        ax.set_title(f"{model} (window {window}) {dtype} B={batch}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms / decode step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
