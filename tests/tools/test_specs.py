"""One reading of the config (`hybrid_cache.specs`): the tools' geometry (`layer_kv_geometry`), the benchmark's bytes
(`live_kv_bytes`, `random_prefill`), the planner's full cache and the container's allocated storage all agree with
`layer_specs`, over the planner's presets and tiny Gemma 3 / Gemma 4 models (Gemma 4: different KV heads and head
sizes per layer type, KV-shared layers); and no module of the package but `specs.py` (and `compat.py`'s
release-dependent `kv_sharing_modes`) reads the layer-structure fields of a config.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from builders import VOCAB, tiny_gemma3, tiny_gemma4
from transformers import AutoModelForCausalLM

from hybrid_cache import HybridRingCache
from hybrid_cache.compat import cache_kwargs
from hybrid_cache.ring import RingSlidingLayer
from hybrid_cache.specs import CHUNKED, FULL, SHARED, SLIDING, layer_specs
from hybrid_cache.tools.bench.workload import exact_kv_bytes, live_kv_bytes, random_prefill
from hybrid_cache.tools.compare import full_cache_bytes_per_token, kv_bytes_held, layer_kv_geometry
from hybrid_cache.tools.perplexity import has_sliding_layers
from hybrid_cache.tools.planner import PRESETS, plan_kv_memory

PACKAGE = Path(__file__).resolve().parents[2] / "hybrid_cache"

TINY_MODELS = {
    "tiny-gemma3": lambda: tiny_gemma3(window=4, layers=6),
    "tiny-gemma4-shared": lambda: tiny_gemma4(window=4, layers=8, shared=3),  # head sizes 8 / 16, KV heads 2 / 1
    "tiny-gemma4-unshared": lambda: tiny_gemma4(window=4, layers=6, shared=0, per_layer_input=0, global_kv_heads=2),
}


def _config(name: str):
    return PRESETS[name].config() if name in PRESETS else TINY_MODELS[name]().config


def _expected_geometry(specs) -> list[tuple[int, int] | None]:
    return [(spec.kv_heads, spec.head_dim) if spec.stores else None for spec in specs]


@pytest.mark.parametrize("name", [*PRESETS, *TINY_MODELS])
def test_tools_geometry_and_bytes_follow_layer_specs(name):
    config = _config(name)
    specs = layer_specs(config)
    assert len(specs) == config.get_text_config(decoder=True).num_hidden_layers
    for spec in specs:
        if spec.stores:
            assert spec.kv_heads >= 1 and spec.head_dim >= 1, spec
        assert (spec.window is not None) == (spec.kind in (SLIDING, CHUNKED)), spec  # the window, or the chunk
    assert layer_kv_geometry(config) == _expected_geometry(specs)
    assert has_sliding_layers(config) == any(spec.kind == SLIDING for spec in specs)

    for dtype, element in ((torch.bfloat16, 2), (torch.float32, 4)):
        per_token = [2 * spec.kv_heads * spec.head_dim * element for spec in specs if spec.stores]
        assert full_cache_bytes_per_token(config, dtype) == sum(per_token)
        for length in (1, 5, 700, 100_000):
            expected = sum(
                3 * 2 * spec.kv_heads * spec.head_dim * element * (min(length, spec.window) if spec.window else length)
                for spec in specs
                if spec.stores
            )
            assert live_kv_bytes(config, 3, length, dtype) == expected, (dtype, length)
            assert exact_kv_bytes(config, 3, length, dtype) == expected

    plan = plan_kv_memory(config, 40, batch_size=2, dtype=torch.float32).stages[0]
    assert plan["full"].total_bytes == 2 * 40 * full_cache_bytes_per_token(config, torch.float32)
    layers_by_type = {}
    for spec in specs:
        layers_by_type[spec.kind] = layers_by_type.get(spec.kind, 0) + 1
    assert plan["ring"].layers_by_type == layers_by_type


def test_gemma4_specs_as_declared():
    """Gemma 4: full layers declare their own KV heads and head size (`global_*`), the last `num_kv_shared_layers`
    reuse the last storing layer of their type."""
    specs = layer_specs(_config("tiny-gemma4-shared"))
    assert [spec.kind for spec in specs] == [SLIDING, SLIDING, FULL, SLIDING, SLIDING, SHARED, SHARED, SHARED]
    assert {(spec.kv_heads, spec.head_dim) for spec in specs if spec.kind == SLIDING} == {(2, 8)}
    assert {(spec.kv_heads, spec.head_dim) for spec in specs if spec.kind == FULL} == {(1, 16)}
    assert [spec.shares_from for spec in specs[5:]] == [2, 4, 2]  # layer types 5..7: full, sliding, full
    assert layer_kv_geometry(_config("tiny-gemma4-shared"))[5:] == [None] * 3


def _check_storage(cache: HybridRingCache, specs, batch: int) -> None:
    """Each layer of the container holds what its spec says: its KV heads and head size, a ring of the window for a
    sliding layer, nothing for a KV-shared one."""
    assert cache.layer_kinds == [spec.kind for spec in specs]
    for spec, layer in zip(specs, cache.layers):
        if not spec.stores:
            assert getattr(layer, "keys", None) is None, spec
            continue
        assert tuple(layer.keys.shape) == (batch, spec.kv_heads, layer.capacity, spec.head_dim), spec
        assert tuple(layer.values.shape) == (batch, spec.kv_heads, layer.capacity, spec.head_dim), spec
        assert isinstance(layer, RingSlidingLayer) == (spec.kind == SLIDING), spec
        if spec.kind == SLIDING:
            assert layer.sliding_window == spec.window


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_container_storage_and_bench_prefill_follow_layer_specs(name):
    """A real forward decides the K/V shapes the cache allocates: they are the specs', and so are the bench's."""
    model = TINY_MODELS[name]()
    specs = layer_specs(model.config)
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (2, 9)), **cache_kwargs(cache), use_cache=True)
        model(input_ids=torch.randint(3, VOCAB, (2, 1)), **cache_kwargs(cache), use_cache=True)
    _check_storage(cache, specs, batch=2)
    element = torch.empty((), dtype=torch.float32).element_size()
    held = sum(
        2 * 2 * spec.kv_heads * spec.head_dim * element * layer.capacity
        for spec, layer in zip(specs, cache.layers)
        if spec.stores
    )
    assert kv_bytes_held(cache) == held

    source = random_prefill(model, 2, 5, torch.float32)
    assert sorted(source) == [spec.index for spec in specs if spec.stores]
    for index, (keys, values) in source.items():
        assert keys.shape == values.shape == (2, specs[index].kv_heads, 5, specs[index].head_dim)


@pytest.mark.parametrize("name", ["gemma-3-1b", "gemma-4-e2b", "gemma-4-31b"])
def test_container_storage_follows_layer_specs_on_meta(name):
    """The full-size presets, built on the meta device (no memory): the shapes the model hands the cache are the
    specs'."""
    config = PRESETS[name].config()
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).eval()
    cache = HybridRingCache(model.config)
    with torch.no_grad():
        ids = torch.zeros((2, 8), dtype=torch.long, device="meta")
        model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    _check_storage(cache, layer_specs(config), batch=2)


# --- the structural check -----------------------------------------------------------------------------------------
#: Config fields that shape the cache: only `specs.py` reads them (attribute reads, or `getattr` / `hasattr`).
CONFIG_FIELDS = {
    "layer_types",
    "sliding_window",
    "per_layer_config",
    "kv_sharing_modes",
    "num_kv_shared_layers",
    "num_key_value_heads",
    "num_global_key_value_heads",
    "global_head_dim",
}
#: Also refused through `getattr` / `hasattr` (as an attribute, `head_dim` is also a property of other objects).
GETATTR_FIELDS = CONFIG_FIELDS | {"head_dim"}
#: The reader, and the release-dependent primitive it uses (`compat.kv_sharing_modes`).
READERS = {"specs.py", "compat.py"}
#: Reads of an attribute of the same name on something that is not a config.
NOT_A_CONFIG = {
    ("tools/planner.py", "layer.sliding_window"),  # transformers' DynamicSlidingWindowLayer's own window
}


def _config_reads(path: Path, root: Path = PACKAGE) -> list[str]:
    reads = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        text = None
        if isinstance(node, ast.Attribute) and node.attr in CONFIG_FIELDS and isinstance(node.ctx, ast.Load):
            is_self = isinstance(node.value, ast.Name) and node.value.id == "self"  # a class's own attribute
            text = None if is_self else ast.unparse(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id in ("getattr", "hasattr") and len(args) >= 2 and isinstance(args[1], ast.Constant):
                text = ast.unparse(node) if args[1].value in GETATTR_FIELDS else None
            elif node.func.id == "kv_sharing_modes":
                text = ast.unparse(node)
        if text is not None:
            reads.append((node.lineno, f"{path.relative_to(root).as_posix()}:{node.lineno}: {text}"))
    return [read for _, read in sorted(reads)]


def test_only_specs_reads_the_layer_structure():
    """No module of `hybrid_cache/` but `specs.py` (and `compat.py`'s `kv_sharing_modes`) reads `layer_types`,
    `sliding_window`, the per-layer configs, the KV-sharing fields, or the declared KV heads and head sizes of a config
    (building a config with those keywords, or setting them, is not reading)."""
    reads = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in READERS:
            continue
        reads += [read for read in _config_reads(path) if (relative, read.split(": ", 1)[1]) not in NOT_A_CONFIG]
    assert reads == [], "read these through hybrid_cache.specs:\n" + "\n".join(reads)


def test_the_structural_check_finds_reads(tmp_path):
    """The check is not vacuous: it finds each form of read, and lets constructing and assigning pass."""
    source = (
        "def f(config, text, model, compat):\n"
        "    a = config.layer_types\n"
        "    b = getattr(text, 'sliding_window', None)\n"
        "    c = model.config.per_layer_config\n"
        "    d = kv_sharing_modes(config)\n"
        "    e = compat.kv_sharing_modes(config)\n"
        "    g = hasattr(config, 'head_dim')\n"
        "    config.sliding_window = 3\n"
        "    return Config(layer_types=a, sliding_window=4)\n"
    )
    path = tmp_path / "tools" / "probe.py"
    path.parent.mkdir()
    path.write_text(source)
    found = _config_reads(path, root=tmp_path)
    assert [read.split(": ", 1)[0] for read in found] == [f"tools/probe.py:{line}" for line in range(2, 8)]
