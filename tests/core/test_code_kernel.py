"""The native kernel of attention on the codes (`hybrid_cache.code_kernel`, `csrc/code_attention.c`).

1. Where the CPU can run one of its instruction sets (AVX-512 VNNI, AVX2 + FMA + F16C, NEON) and a C compiler
   exists, it builds, loads and is used; `HYBRID_CACHE_CODE_KERNEL_ISA` picks the set (every set the CPU has is run
   by the tests below; the others skip, and scripts/kernel_cross_check.sh checks aarch64 under qemu).
2. Over random geometries the kernel takes (heads of 64-512 channels, groups of 64-512, int8 / int4, GQA, batch and
   heads fewer or more than the threads, strided views of a layer's storage, float32 / bfloat16 / float16 scales,
   calibration and rotation, masks, one to a few query tokens), its result equals the torch path's and
   `reference_attention`'s, with 1 to 3 threads.
3. The switch (`HYBRID_CACHE_CODE_KERNEL`): off, on (raises where it cannot run), a bad value; a missing compiler
   falls back to the torch path with the same result; the entry points refuse tensors that do not match the codes.
4. `generate` (greedy with padding, beams, assisted) on tiny Gemma 3 / Gemma 4 models with the kernel's geometry
   (heads of 128; Gemma 4's one KV head of 512) gives the tokens and logits of the torch path.
5. Threads: on torch's own GNU OpenMP runtime where torch runs on one (no second runtime in the process), on the
   library's pool otherwise or when forced, with identical results; an OpenMP build that fails falls back to the
   pool; concurrent Python threads and a forked child are safe.
"""

from __future__ import annotations

import copy
import ctypes
import random
import re

import pytest
import torch
from builders import decode_step_mask, prompt, tiny_gemma3, tiny_gemma4

import hybrid_cache.code_kernel as code_kernel
from hybrid_cache import HybridRingCache, cache_kwargs
from hybrid_cache.code_attention import CODE_ATTENTION, code_domain_attention, reference_attention
from hybrid_cache.errors import CodeKernelError
from hybrid_cache.quantized import DequantWorkspace, QuantizedFullLayer

# Hundreds of random geometries of a C kernel that no transformers release changes: the whole suite runs them; the
# quick suite on older releases leaves them out (setup.cfg's `slow` marker).
pytestmark = pytest.mark.slow

AVAILABLE = code_kernel.available_isas()
KERNEL_CAN_RUN = bool(AVAILABLE)
needs_kernel = pytest.mark.skipif(
    not KERNEL_CAN_RUN, reason="the CPU has none of the kernel's instruction sets: the kernel cannot run"
)


@pytest.fixture
def kernel_env(monkeypatch):
    """Set `HYBRID_CACHE_CODE_KERNEL` for one test (restored afterwards)."""

    def set_mode(mode: str) -> None:
        monkeypatch.setenv(code_kernel.KERNEL_ENV, mode)

    set_mode("auto")
    monkeypatch.setenv(code_kernel.ISA_ENV, "auto")
    monkeypatch.setenv(code_kernel.THREADS_ENV, "auto")
    return set_mode


@pytest.fixture(params=list(code_kernel.INSTRUCTION_SETS))
def isa(request, monkeypatch):
    """Each instruction set in turn, forced with `HYBRID_CACHE_CODE_KERNEL_ISA`; a set this CPU lacks skips."""
    missing = code_kernel.missing_features(request.param)
    if missing:
        pytest.skip(f"this CPU cannot run the {request.param} kernel: it lacks {', '.join(missing)}")
    monkeypatch.setenv(code_kernel.ISA_ENV, request.param)
    return request.param


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts of the kernel's two entry points during a test."""
    calls = {"scores": 0, "values": 0}
    for name, entry in (("scores", code_kernel.history_scores), ("values", code_kernel.history_values)):

        def counted(*args, _entry=entry, _name=name, **kwargs):
            calls[_name] += 1
            return _entry(*args, **kwargs)

        monkeypatch.setattr(code_kernel, f"history_{name}", counted)
    return calls


def random_case(seed: int) -> dict:
    rng = random.Random(seed)
    mode = rng.choice(["int8", "int4"])
    head_dim = rng.choice([128, 256, 512] if mode == "int4" else [64, 128, 256, 512])
    return {
        "mode": mode,
        "batch": rng.randint(1, 3),
        "kv_heads": rng.choice([1, 2]),
        "rep": rng.choice([1, 2, 4, 8]),
        "head_dim": head_dim,
        "group": rng.choice([g for g in (64, 128, 256, 512) if g <= head_dim and head_dim % g == 0]),
        "history": rng.randint(1, 1400),
        "query": rng.choice([1, 1, 2, 3]),
        "rotate": rng.random() < 0.3,
        "calibration": rng.random() < 0.7,
        "mask": rng.choice(["bool", "float", "none"]),
        "softcap": rng.choice([None, 30.0]),
        "dtype": rng.choice([torch.float32, torch.bfloat16, torch.float16]),
        "threads": rng.randint(1, 3),
        "parts": rng.choice([1, 2]),
    }


def build_step(case: dict, seed: int):
    """A layer holding `history` random tokens (grown twice, so its codes are views of a larger storage), the step's
    history handle, the query and the mask."""
    generator = torch.Generator().manual_seed(seed)
    b, h, d, dtype = case["batch"], case["kv_heads"], case["head_dim"], case["dtype"]
    layer = QuantizedFullLayer(
        case["mode"], DequantWorkspace(), case["group"], case["rotate"], key_calibration=case["calibration"]
    )
    channel_scale = 1 + 5 * torch.rand(d, generator=generator)
    keys = (torch.randn(b, h, case["history"], d, generator=generator) * channel_scale + 2).to(dtype)
    values = torch.randn(b, h, case["history"], d, generator=generator).to(dtype)
    cut = case["history"] // 2
    if cut:
        layer.update(keys[:, :, :cut], values[:, :, :cut])
    layer.update(keys[:, :, cut:], values[:, :, cut:])
    q = case["query"]
    step_keys = torch.randn(b, h, q, d, generator=generator).to(dtype)
    step_values = torch.randn(b, h, q, d, generator=generator).to(dtype)
    handle_keys, _ = layer.update(step_keys, step_values, return_codes=True)
    query = torch.randn(b, h * case["rep"], q, d, generator=generator).to(dtype)
    mask, _ = decode_step_mask(b, case["history"], q, case["mask"], dtype, padding=5)
    return handle_keys.history, query, mask


# --- 1. it runs where it can ------------------------------------------------------------------------------------------
@needs_kernel
def test_the_kernel_builds_and_loads_on_this_cpu(kernel_env):
    """`auto` takes the best set the CPU has, and the status names it."""
    status = code_kernel.kernel_status()
    assert status.startswith(f"auto: {AVAILABLE[0]}") and " kernel on " in status and ", loaded from " in status, (
        status
    )


# --- 2. it computes what the torch path and the reference compute -----------------------------------------------------
@pytest.mark.parametrize("seed", range(32))
def test_kernel_equals_the_torch_path_and_the_reference(seed, kernel_env, isa, kernel_calls):
    case = random_case(seed)
    history, query, mask = build_step(case, seed)
    arguments = {"scaling": 0.1, "softcap": case["softcap"], "query_parts": case["parts"]}
    previous = torch.get_num_threads()
    torch.set_num_threads(case["threads"])
    try:
        kernel = code_domain_attention(query, history, mask, **arguments)
    finally:
        torch.set_num_threads(previous)
    assert kernel_calls == {"scores": 1, "values": 1}
    kernel_env("off")
    with_torch = code_domain_attention(query, history, mask, **arguments)
    assert kernel_calls == {"scores": 1, "values": 1}
    expected = reference_attention(query, history, mask, **arguments)
    assert kernel.dtype == query.dtype and kernel.shape == expected.shape
    # float32: summation order only. Half types: the output's own rounding (one unit in the last place).
    tolerance = 1e-5 if case["dtype"] == torch.float32 else 1e-2
    scale = expected.float().abs().max()
    torch.testing.assert_close(kernel.float(), expected.float(), rtol=0, atol=tolerance * scale)
    torch.testing.assert_close(kernel.float(), with_torch.float(), rtol=0, atol=tolerance * scale)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("head_dim", [256, 512])
@pytest.mark.parametrize("rep, query", [(4, 1), (8, 1), (4, 2)])
@pytest.mark.parametrize("parts", [1, 2])
def test_the_unrolled_geometries_equal_the_reference(mode, head_dim, rep, query, parts, kernel_env, isa, kernel_calls):
    """The geometries the kernel unrolls (groups of 64 in heads of 256 / 512, as Gemma 3 and Gemma 4 store them;
    4 or 8 query rows per KV head, one or two query parts), which the random cases above rarely draw."""
    case = random_case(head_dim + rep + query + parts) | {"mode": mode, "head_dim": head_dim, "group": 64}
    case |= {"rep": rep, "query": query, "parts": parts, "dtype": torch.float32, "history": 300, "batch": 2}
    history, query_states, mask = build_step(case, head_dim * rep)
    actual = code_domain_attention(query_states, history, mask, softcap=case["softcap"], query_parts=parts)
    assert kernel_calls == {"scores": 1, "values": 1}
    expected = reference_attention(query_states, history, mask, softcap=case["softcap"], query_parts=parts)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * expected.abs().max())


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_scores_of_extreme_codes_are_exact_integer_products(mode, kernel_env, isa):
    """Codes at both ends of their range against a query at +-127 in both parts, in a 512-channel group: each set's
    trick (AVX-512: codes read as c + 128, then 128 * sum(query) taken off; AVX2: |c| times the query with c's sign,
    whose pair sums must stay within int16) must give the signed products."""
    d, length = 512, 70
    layer = QuantizedFullLayer(mode, DequantWorkspace(), group_size=512, key_calibration=False)
    keys = -torch.ones(1, 1, length, d)
    keys[..., 1::2, :] = 1.0
    keys[..., 2::7, ::3] = 0.5
    layer.update(keys, keys.clone())
    handle_keys, _ = layer.update(torch.ones(1, 1, 1, d), torch.ones(1, 1, 1, d), return_codes=True)
    query = torch.full((1, 1, 1, d), 3.0)
    query[..., ::2] = -3.0 + 1.0 / 512
    for parts in (1, 2):
        actual = code_domain_attention(query, handle_keys.history, None, query_parts=parts)
        expected = reference_attention(query, handle_keys.history, None, query_parts=parts)
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_results_do_not_depend_on_the_thread_count_beyond_summation_order(kernel_env, isa):
    case = random_case(3) | {"batch": 1, "kv_heads": 1, "history": 3000, "dtype": torch.float32, "mode": "int8"}
    case |= {"head_dim": 256, "group": 64, "rep": 4, "query": 1}
    history, query, mask = build_step(case, 3)
    previous = torch.get_num_threads()
    outputs = []
    try:
        for threads in (1, 2, 3, 5):  # 1 x 1 heads: the tokens are split among the threads
            torch.set_num_threads(threads)
            outputs.append(code_domain_attention(query, history, mask))
    finally:
        torch.set_num_threads(previous)
    for output in outputs[1:]:
        torch.testing.assert_close(output, outputs[0], rtol=0, atol=1e-5 * outputs[0].abs().max())


@needs_kernel
def test_inference_mode_and_no_grad_both_use_the_kernel(kernel_env, kernel_calls):
    case = random_case(5) | {"dtype": torch.float32, "history": 40, "mode": "int8", "head_dim": 128, "group": 64}
    history, query, mask = build_step(case, 5)
    with torch.inference_mode():
        in_inference = code_domain_attention(query, history, mask)
    with torch.no_grad():
        in_no_grad = code_domain_attention(query, history, mask)
    assert kernel_calls == {"scores": 2, "values": 2}
    torch.testing.assert_close(in_inference, in_no_grad, rtol=0, atol=0)


# --- 3. the switch ---------------------------------------------------------------------------------------------------
def test_off_runs_the_torch_path(kernel_env, kernel_calls):
    kernel_env("off")
    history, query, mask = build_step(random_case(7) | {"mode": "int8", "head_dim": 128, "group": 64}, 7)
    code_domain_attention(query, history, mask)
    assert kernel_calls == {"scores": 0, "values": 0}
    assert code_kernel.kernel_status().startswith("off")


def test_on_raises_where_the_kernel_cannot_run_and_a_bad_setting_raises(kernel_env):
    """`on` promises the kernel: a head of 32 channels (not a multiple of 64) raises with the reason and the fix,
    instead of quietly taking the torch path; a value that is not a setting raises too."""
    history, query, mask = build_step(random_case(8) | {"mode": "int8", "head_dim": 32, "group": 32}, 8)
    kernel_env("on")  # (a layer's update raises too: test_code_kernel_fallback.py)
    with pytest.raises(CodeKernelError, match="multiples of 64.*HYBRID_CACHE_CODE_KERNEL=auto"):
        code_domain_attention(query, history, mask)
    kernel_env("fast")
    with pytest.raises(CodeKernelError, match="not a setting; use auto"):
        code_domain_attention(query, history, mask)


def test_without_a_compiler_the_torch_path_gives_the_same_result(kernel_env, monkeypatch, tmp_path, caplog):
    case = random_case(9) | {"mode": "int4", "head_dim": 256, "group": 64, "dtype": torch.float32}
    history, query, mask = build_step(case, 9)
    expected = reference_attention(query, history, mask)
    monkeypatch.setenv("CC", "no-such-compiler-hybrid-cache")
    monkeypatch.setenv("HYBRID_CACHE_KERNEL_DIR", str(tmp_path))
    code_kernel._load.cache_clear()
    try:
        if KERNEL_CAN_RUN:
            assert "no C compiler" in code_kernel.kernel_status()
        actual = code_domain_attention(query, history, mask)
    finally:
        code_kernel._load.cache_clear()
    assert list(tmp_path.iterdir()) == []  # nothing half built left behind
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * expected.abs().max())


@needs_kernel
def test_a_build_is_reused_and_a_fresh_directory_builds_again(kernel_env, monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRID_CACHE_KERNEL_DIR", str(tmp_path))
    first, name = code_kernel._build(AVAILABLE[0])
    stamp = first.stat().st_mtime_ns
    assert code_kernel._build(AVAILABLE[0]) == (first, name) and first.stat().st_mtime_ns == stamp
    assert name.split("+")[0] == AVAILABLE[0] and name in first.name
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left


def test_deepcopied_histories_read_their_own_codes(kernel_env):
    """The kernel reads raw pointers: a copy of the layer (beam search, snapshots) must be read from its own storage."""
    case = random_case(11) | {"mode": "int8", "head_dim": 128, "group": 64, "dtype": torch.float32, "history": 50}
    history, query, mask = build_step(case, 11)
    copied = copy.deepcopy(history)
    expected = code_domain_attention(query, history, mask)
    history.key_codes.zero_()  # the original's storage changes; the copy's must not be affected
    torch.testing.assert_close(code_domain_attention(query, copied, mask), expected, rtol=0, atol=0)


@needs_kernel
def test_the_entry_points_refuse_tensors_that_do_not_match_the_codes(kernel_env):
    """The kernel reads raw memory: a caller's shape mistake must be a ValueError, never a read out of bounds."""
    case = random_case(12) | {"mode": "int8", "head_dim": 256, "group": 64, "dtype": torch.float32, "history": 30}
    history, _, _ = build_step(case, 12)
    codes, scales = history.key_codes, history.key_scales
    b, h, length, _ = codes.shape
    good = {
        "query_codes": torch.zeros(b, h, 4, 256, dtype=torch.int8),
        "query_weights": torch.ones(b, h, 4, 4),
        "row_constants": torch.zeros(b, h, 4),
        "out": torch.empty(b, h, 4, length),
    }
    code_kernel.history_scores(codes, scales, "int8", *good.values())
    for name, bad in (
        ("query_codes", torch.zeros(b, h, 4, 128, dtype=torch.int8)),
        ("query_weights", torch.ones(b, h, 4, 2)),
        ("out", torch.empty(b, h, 4, length + 1)),
        ("row_constants", torch.zeros(b, h, 3)),
    ):
        with pytest.raises(ValueError, match=name):
            code_kernel.history_scores(codes, scales, "int8", *(good | {name: bad}).values())
    with pytest.raises(ValueError, match="probabilities"):
        code_kernel.history_values(codes, scales, "int8", torch.ones(b, h, 4, length + 5), 1.0)
    with pytest.raises(ValueError, match="does not take"):
        code_kernel.history_values(codes[..., :32], scales, "int8", torch.ones(b, h, 4, length), 1.0)


# --- 3b. the instruction set ------------------------------------------------------------------------------------------
def test_a_set_the_cpu_lacks_falls_back_under_auto_and_raises_under_on(kernel_env, monkeypatch):
    """Forcing a set this CPU lacks (there is always one: x86-64 lacks NEON, aarch64 lacks AVX): `auto` takes the
    torch path with the reference's result and says why in the status; `on` raises, naming the set and what lacks."""
    lacking = next(isa for isa in code_kernel.INSTRUCTION_SETS if code_kernel.missing_features(isa))
    monkeypatch.setenv(code_kernel.ISA_ENV, lacking)
    case = random_case(21) | {"mode": "int8", "head_dim": 256, "group": 64, "dtype": torch.float32}
    history, query, mask = build_step(case, 21)
    status = code_kernel.kernel_status()
    assert f"{code_kernel.ISA_ENV}={lacking}" in status and "needs what this CPU lacks" in status, status
    assert not code_kernel.kernel_usable(history.key_codes, history.key_scales, "int8")
    expected = reference_attention(query, history, mask)
    torch.testing.assert_close(code_domain_attention(query, history, mask), expected, rtol=0, atol=1e-5)
    kernel_env("on")
    missing = code_kernel.missing_features(lacking)[0]
    with pytest.raises(CodeKernelError, match=rf"{code_kernel.ISA_ENV}={lacking} needs.*{re.escape(missing)}"):
        code_domain_attention(query, history, mask)


def test_a_bad_instruction_set_raises(kernel_env, monkeypatch):
    monkeypatch.setenv(code_kernel.ISA_ENV, "sse2")
    with pytest.raises(CodeKernelError, match="not an instruction set; use auto .*avx512, avx2, neon"):
        code_kernel.kernel_status()


@needs_kernel
def test_a_forced_set_is_named_in_the_status(kernel_env, monkeypatch):
    monkeypatch.setenv(code_kernel.ISA_ENV, AVAILABLE[-1])
    status = code_kernel.kernel_status()
    assert status.startswith(f"auto ({code_kernel.ISA_ENV}={AVAILABLE[-1]}): {AVAILABLE[-1]}"), status


@pytest.mark.parametrize(
    "machine, features, expected",
    [
        ("x86_64", {"avx2", "fma", "f16c"}, ["avx2"]),
        ("x86_64", {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, ["avx512", "avx2"]),
        ("x86_64", {"avx2", "fma"}, []),  # no F16C
        ("x86_64", {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"}, ["avx512"]),
        ("aarch64", {"asimd", "asimddp"}, ["neon"]),
        ("aarch64", {"fp"}, []),
        ("riscv64", {"v"}, []),
    ],
)
def test_the_sets_follow_the_cpus_features(machine, features, expected, monkeypatch):
    monkeypatch.setattr(code_kernel, "_machine", lambda: machine)
    monkeypatch.setattr(code_kernel, "cpu_features", lambda: frozenset(features))
    assert code_kernel.available_isas() == expected
    for isa in set(code_kernel.INSTRUCTION_SETS) - set(expected):
        assert code_kernel.missing_features(isa)


@pytest.mark.parametrize(
    "machine, answers, expected",
    [
        ("aarch64", {"hw.optional.arm.FEAT_DotProd": "1"}, {"asimd", "asimddp"}),
        ("aarch64", {}, {"asimd"}),
        (
            "x86_64",
            {"machdep.cpu.features": "FPU SSE F16C FMA", "machdep.cpu.leaf7_features": "AVX2 AVX512F AVX512VNNI"},
            {"fpu", "sse", "f16c", "fma", "avx2", "avx512f", "avx512_vnni"},
        ),
    ],
)
def test_macos_features_are_read_from_sysctl_and_renamed(machine, answers, expected, monkeypatch):
    """macOS is untested on a real machine (docs/limits.md): this checks the reading of `sysctl`'s answers."""
    monkeypatch.setattr(code_kernel, "_machine", lambda: machine)
    monkeypatch.setattr(code_kernel, "_sysctl", lambda name: answers.get(name, ""))
    assert code_kernel._macos_features() == expected


@pytest.mark.skipif("avx2" not in AVAILABLE, reason="the CPU lacks AVX2: the avx2 build cannot be checked")
def test_the_avx_vnni_build_is_made_where_the_cpu_reports_it(monkeypatch, tmp_path):
    """The AVX2 build adds AVX-VNNI where the CPU reports `avx_vnni`, and the library names what it was built for
    (only its name is read here: a CPU without AVX-VNNI cannot run its dot products)."""
    monkeypatch.setenv("HYBRID_CACHE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(code_kernel, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c", "avx_vnni"}))
    path, name = code_kernel._build("avx2")
    library = ctypes.CDLL(str(path))
    library.hc_isa.restype = ctypes.c_char_p
    assert name == "avx2+avx-vnni" == library.hc_isa().decode()


# --- 4. generate through the kernel -----------------------------------------------------------------------------------
def wide_head_model(name: str):
    """A tiny model whose full layers have the geometry the kernel takes: Gemma 3 with heads of 128 (2 KV heads,
    GQA 2), Gemma 4 with Gemma 4's own full-layer geometry (one KV head of 512, K = V, 4 query heads)."""
    if name == "gemma3":
        return tiny_gemma3(window=4, attn=CODE_ATTENTION, seed=3, head_dim=128)
    return tiny_gemma4(window=4, attn=CODE_ATTENTION, seed=3, global_head_dim=512)


@needs_kernel
@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("case", ["greedy_padded", "beams3", "assisted"])
def test_generate_through_the_kernel_equals_the_torch_path(name, mode, case, kernel_env, kernel_calls):
    """`generate` on the codes with the native kernel gives the tokens (and logits to 1e-4) of the same cache on
    torch ops: greedy with left padding, beam search, assisted decoding (several query tokens per step)."""
    if case == "assisted" and name == "gemma4":
        pytest.skip("the tiny assistant is a Gemma 3 model; Gemma 4 is covered by greedy and beams")
    model = wide_head_model(name)
    inputs = prompt(2, pad=5) if case == "greedy_padded" else prompt()
    kwargs = {"do_sample": False}
    if case == "beams3":
        kwargs["num_beams"] = 3
    if case == "assisted":
        kwargs["assistant_model"] = tiny_gemma3(window=4, layers=2, seed=7)

    def run():
        cache = HybridRingCache(model.config, full_layer_quantization=mode)
        with torch.no_grad():
            out = model.generate(
                **inputs,
                **cache_kwargs(cache),
                max_new_tokens=12,
                min_new_tokens=12,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
                **kwargs,
            )
        return out.sequences, torch.stack(out.logits, 1)

    tokens, logits = run()
    assert kernel_calls["scores"] > 0 and kernel_calls["values"] == kernel_calls["scores"]
    kernel_env("off")
    calls = dict(kernel_calls)
    expected_tokens, expected_logits = run()
    assert kernel_calls == calls  # the torch path ran
    assert torch.equal(tokens, expected_tokens)
    if case != "beams3":  # beam logits are per-beam scores, compared through the tokens
        torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-4)


# --- 5. the kernel's threads ------------------------------------------------------------------------------------------
TORCH_OPENMP, WHY_NO_OPENMP = code_kernel.torch_openmp_runtime()


def _loaded_openmp_runtimes() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if any(name in line for name in ("/libgomp", "/libomp", "/libiomp"))}


@needs_kernel
@pytest.mark.skipif(TORCH_OPENMP is None, reason=f"the kernel has no OpenMP build here: {WHY_NO_OPENMP}")
def test_the_kernel_runs_on_torchs_own_openmp_runtime(kernel_env, monkeypatch, tmp_path):
    """Where torch runs on GNU OpenMP, a fresh build of the kernel is linked to that very runtime: the status says
    so, and loading it brings no second OpenMP runtime into the process (which would bring a second set of
    threads), although other packages' libgomps may be loaded beside torch's (scikit-learn's, in this suite)."""
    monkeypatch.setenv("HYBRID_CACHE_KERNEL_DIR", str(tmp_path))
    history, query, mask = build_step(random_case(14) | {"mode": "int8", "head_dim": 128, "group": 64}, 14)
    before = _loaded_openmp_runtimes()
    code_kernel._load.cache_clear()
    try:
        code_domain_attention(query, history, mask)
        status = code_kernel.kernel_status()
    finally:
        code_kernel._load.cache_clear()
    assert "kernel on torch's OpenMP threads, loaded from " + str(tmp_path) in status, status
    assert str(TORCH_OPENMP) in before and _loaded_openmp_runtimes() == before


@needs_kernel
def test_openmp_threads_and_the_own_pool_give_identical_results(kernel_env, isa, monkeypatch):
    """Every item (batch x head, token range) is computed the same way whichever thread takes it: the two thread
    settings agree bit for bit at every thread count, with more threads than heads (token ranges) and fewer."""
    previous = torch.get_num_threads()
    try:
        for seed, heads in ((15, 1), (16, 2)):
            case = random_case(seed) | {"batch": 2, "kv_heads": heads, "history": 2500, "dtype": torch.float32}
            case |= {"mode": "int4", "head_dim": 256, "group": 64, "rep": 4, "query": 1}
            history, query, mask = build_step(case, seed)
            for threads in (1, 2, 3, 5):
                torch.set_num_threads(threads)
                outputs = []
                for setting in ("auto", "pthreads"):
                    monkeypatch.setenv(code_kernel.THREADS_ENV, setting)
                    outputs.append(code_domain_attention(query, history, mask))
                assert torch.equal(outputs[0], outputs[1]), (seed, threads)
    finally:
        torch.set_num_threads(previous)
    assert "on its own threads (HYBRID_CACHE_CODE_KERNEL_THREADS=pthreads)" in code_kernel.kernel_status()
    monkeypatch.setenv(code_kernel.THREADS_ENV, "openmp")
    with pytest.raises(CodeKernelError, match="not a setting; use auto .* or pthreads"):
        code_kernel.kernel_status()


@needs_kernel
def test_an_openmp_build_that_fails_falls_back_to_the_pool(kernel_env, monkeypatch, tmp_path):
    """A runtime the kernel cannot be linked to (here: a path that is no library) leaves the pool build, which the
    status names with the reason; torch on another parallel backend gets the pool without trying."""
    monkeypatch.setenv("HYBRID_CACHE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(code_kernel, "torch_openmp_runtime", lambda: (tmp_path / "no" / "libgomp.so.1", "a test"))
    case = random_case(17) | {"mode": "int8", "head_dim": 256, "group": 64, "dtype": torch.float32}
    history, query, mask = build_step(case, 17)
    code_kernel._load.cache_clear()
    try:
        status = code_kernel.kernel_status()
        actual = code_domain_attention(query, history, mask)
    finally:
        code_kernel._load.cache_clear()
    assert "on its own threads (no OpenMP build: " in status and "could not build" in status, status
    assert [p.name.split("-")[2] for p in tmp_path.iterdir()] == ["pthreads"]  # nothing of the failed build is left
    expected = reference_attention(query, history, mask)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5 * expected.abs().max())
    monkeypatch.undo()
    monkeypatch.setattr(torch.__config__, "parallel_info", lambda: "ATen parallel backend: native thread pool")
    assert code_kernel.torch_openmp_runtime() == (None, "torch's parallel backend is not OpenMP")


def _values_in_forked_child(history, probabilities, expected, results) -> None:
    """In a forked child: torch single-threaded (GNU OpenMP, which torch uses, cannot run a parallel region in a
    child forked after the parent ran one, with or without this package), the kernel on two threads."""
    torch.set_num_threads(1)
    code_kernel._splits = lambda batch_heads, length: (2, 2)
    actual = code_kernel.history_values(history.value_codes, history.value_scales, history.mode, probabilities, 1.0)
    results.put(bool(torch.allclose(actual, expected, rtol=0, atol=1e-5 * expected.abs().max().item())))


@needs_kernel
def test_python_threads_and_a_forked_child_share_the_pool_safely(kernel_env):
    """Calls from several Python threads at once (ctypes releases the GIL) are serialized and give the
    single-threaded result, and a child forked after the kernel ran (on torch's OpenMP team, or the library's pool)
    runs it on a pool of its own instead of waiting forever for the parent's threads (bounded: the child is killed
    after 60 s)."""
    import multiprocessing
    import threading

    case = random_case(13) | {"mode": "int8", "head_dim": 256, "group": 64, "dtype": torch.float32, "history": 2000}
    case |= {"batch": 1, "kv_heads": 1, "rep": 4, "query": 1}
    history, query, mask = build_step(case, 13)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = code_domain_attention(query, history, mask)
        outputs, errors = [], []

        def repeat() -> None:
            try:
                outputs.extend(code_domain_attention(query, history, mask) for _ in range(20))
            except Exception as error:  # surfaced below
                errors.append(error)

        threads = [threading.Thread(target=repeat) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors and len(outputs) == 60
        for output in outputs:
            torch.testing.assert_close(output, expected, rtol=0, atol=1e-5 * expected.abs().max())
        probabilities = torch.softmax(torch.randn(1, 1, 4, history.history_length), -1)
        values = code_kernel.history_values(history.value_codes, history.value_scales, "int8", probabilities, 1.0)
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        child = context.Process(target=_values_in_forked_child, args=(history, probabilities, values, results))
        child.start()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join()
            pytest.fail("the forked child hung in the kernel (a pool inherited from the parent)")
        assert child.exitcode == 0 and results.get(timeout=5)
    finally:
        torch.set_num_threads(previous)
