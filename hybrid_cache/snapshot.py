"""Persistence of a `HybridRingCache`: one safetensors file (`save` / `load`); in-memory checkpoints (`checkpoint` /
`restore`) live in `checkpoints.py`.

What a cache needs to continue exactly is small and explicit, and every storage layer exports it itself through the
surface of `storage.py` (`meta_state()`: counters, geometry and storage settings; `state()`: named tensors;
`load_state(meta, **tensors)`). A sliding layer's ring keeps position `p` in slot `p % max_slots` and holds positions
`[oldest, length)`: its slots are saved as they are, in slot order, with the two counters, so a loaded ring is the
same ring (same slots, same stale slots, same next write), before or after the wrap. An exact full layer is saved as
its `length` tokens; a compressed one (`full_layer_quantization`) as the codes and scales of its `length` tokens and
its key calibration, never dequantized; a bounded one (`full_layer_window`) as its sink and window slots with its two
counters, like a ring. KV-shared layers hold nothing. The file also records the cache's constructor arguments and what
identifies the model config it belongs to, so that a file is never loaded into a model whose layers it does not fit.

File layout (format version 3; all metadata values are strings, as safetensors requires):

- tensors `layers.<i>.<name>` for every layer holding tokens, `<name>` from its `state()`: `keys` / `values`
  (`[batch, kv_heads, slots, head_dim]`) for exact storage and bounded layers; `key_codes`, `key_scales`,
  `value_codes`, `value_scales` (and `key_shift` / `key_scale` with key calibration) for compressed layers;
- `hybrid_cache.format` = `HybridRingCache`, `hybrid_cache.format_version` = `3`, `hybrid_cache.version`;
- `hybrid_cache.state`: JSON, `{"options": <every field of CacheOptions>, "layers": [<LayerState as JSON> or null]}`
  (a layer's counters, `COUNTER_FIELDS`, then its storage settings);
- `hybrid_cache.model`: JSON, the layer structure (layer types, KV sharing, windows, KV heads, head sizes per layer)
  and the SHA-256 fingerprint of `hybrid_cache.config`, the model config (without volatile entries) as JSON;
- `hybrid_cache.digest`: JSON, the SHA-256 of every part of the saved state: `options`, `model`, `config`,
  `metadata` (the user's), `layers.<i>` (a layer's counters and settings) and `layers.<i>.<name>` (each tensor's
  bytes). `load` checks every part before it trusts any, so any change after `save` (a flipped byte, a hand-edited
  header) is refused as damage, naming the part;
- every other key: the user's metadata, verbatim.

Files of earlier format versions (development versions of this package, never released) are refused with the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import typing
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .checkpoints import read_layer_state, refuse_stateless_layers
from .options import CacheOptions
from .specs import FULL, SLIDING, declared_structure
from .state import COUNTER_FIELDS, LayerState, StateHolder
from .storage import writable
from .version import __version__

__all__ = ["RESERVED_PREFIX", "load_cache", "load_into", "read_metadata", "save_cache"]

HolderT = TypeVar("HolderT", bound=StateHolder)
#: Metadata keys starting with this prefix belong to hybrid_cache; user metadata may not use it.
RESERVED_PREFIX = "hybrid_cache."
FORMAT_KEY, FORMAT_NAME = RESERVED_PREFIX + "format", "HybridRingCache"
VERSION_KEY, FORMAT_VERSION = RESERVED_PREFIX + "format_version", "3"
STATE_KEY, MODEL_KEY, CONFIG_KEY = RESERVED_PREFIX + "state", RESERVED_PREFIX + "model", RESERVED_PREFIX + "config"
DIGEST_KEY, LIBRARY_KEY = RESERVED_PREFIX + "digest", RESERVED_PREFIX + "version"

# Config entries that do not change what the cache holds (names, bookkeeping, token ids, output switches).
# Entries starting with "_" are dropped as well (`_name_or_path`, `_attn_implementation`, ...).
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "architectures",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "unk_token_id",
        "tie_word_embeddings",
        "initializer_range",
        "torchscript",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
    }
)
# The structural fields, in the order a mismatch is reported (the first differing one is named).
_MODEL_FIELDS = (
    "num_hidden_layers",
    "layer_types",
    "kv_sharing_modes",
    "sliding_window",
    "num_key_value_heads",
    "head_dim",
    "model_type",
)
# How a per-layer difference confined to full-attention layers is named (Gemma 4's global attention has its own).
_GLOBAL_NAMES = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}
_DTYPES = {
    str(dtype): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
    )
}


# --- model identity -----------------------------------------------------------------------------------------------
def _canonical(value: Any) -> Any:
    """`value` as plain JSON data (tuples become lists, unknown objects their string), for exact comparison."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def config_entries(cache: StateHolder) -> dict[str, Any]:
    """The text config as JSON data, without the entries that do not change what the cache holds."""
    entries = cache.config.to_dict()
    return _canonical({k: v for k, v in entries.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS})


def model_identity(cache: StateHolder) -> dict[str, Any]:
    """What identifies the model a cache belongs to: its layer structure per field, and a config fingerprint."""
    entries = config_entries(cache)
    fingerprint = hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()
    return _canonical({**declared_structure(cache.config), "fingerprint": fingerprint})


def _describe(field: str, saved: Any, current: Any, layer_types: list[str] | None) -> str:
    """A readable difference of one identity field; per-layer lists name the layers that differ."""
    if not (isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current)):
        return f"{field}: file {saved}, config {current}"
    layers = [i for i, (a, b) in enumerate(zip(saved, current)) if a != b]
    if field in ("layer_types", "kv_sharing_modes"):
        return f"{field}: file {saved}, config {current} (layers {layers} differ)"
    saved_values = sorted({str(saved[i]) for i in layers})
    current_values = sorted({str(current[i]) for i in layers})
    kinds = {layer_types[i] for i in layers} if layer_types else set()
    name = field
    if kinds == {FULL} and field in _GLOBAL_NAMES and layer_types and SLIDING in layer_types:
        name = f"{field} of the full_attention layers ({_GLOBAL_NAMES[field]} in Gemma 4)"
    return f"{name}: file {'/'.join(saved_values)}, config {'/'.join(current_values)} (layers {layers})"


def check_model(path: Path, saved: Mapping[str, Any], saved_config: Mapping[str, Any], cache: StateHolder) -> None:
    """Raise `ValueError` naming the first field in which the file's model differs from `cache`'s config."""
    current = model_identity(cache)
    for field in _MODEL_FIELDS:
        if saved.get(field) != current[field]:
            difference = _describe(field, saved.get(field), current[field], current["layer_types"])
            raise ValueError(
                f"{path} holds a cache for another model: {difference}. Load it with the config of the model that "
                f"saved it."
            )
    if saved.get("fingerprint") != current["fingerprint"]:
        entries = config_entries(cache)
        differing = sorted(k for k in set(saved_config) | set(entries) if saved_config.get(k) != entries.get(k))
        details = ", ".join(f"{k}: file {saved_config.get(k)!r}, config {entries.get(k)!r}" for k in differing[:5])
        raise ValueError(
            f"{path} holds a cache for another model config (fingerprint differs): {details or 'config entries'}. "
            f"Load it with the config of the model that saved it."
        )


# --- save -------------------------------------------------------------------------------------------------------
def _json_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(
        tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data
    ).hexdigest()


def _user_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"`metadata` must be a dict[str, str], got {type(metadata).__name__}.")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"`metadata` must map str to str (safetensors header metadata), got {key!r}: {type(value).__name__}. "
                f"Convert values with str() or json.dumps()."
            )
        if key.startswith(RESERVED_PREFIX):
            raise ValueError(f"metadata key {key!r} uses the reserved prefix {RESERVED_PREFIX!r}; rename it.")
    return dict(metadata)


def save_cache(cache: StateHolder, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
    """Write `cache` to one safetensors file at `path` (see `HybridRingCache.save`)."""
    refuse_stateless_layers(cache, "save")
    path = Path(os.fspath(path))
    user = _user_metadata(metadata)
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any] | None] = []
    for index, layer in enumerate(cache.layers):
        state = read_layer_state(layer)
        layers.append(None if state is None else state.to_json())
        if state is not None:
            for name, tensor in layer.state().items():
                tensors[f"layers.{index}.{name}"] = tensor.detach().to("cpu").contiguous()
    options = dataclasses.asdict(cache.options)
    model, config = model_identity(cache), config_entries(cache)
    digest = {"options": _json_digest(options), "model": _json_digest(model), "config": _json_digest(config)}
    digest["metadata"] = _json_digest(user)
    digest.update({f"layers.{i}": _json_digest(entry) for i, entry in enumerate(layers) if entry is not None})
    digest.update({name: _tensor_digest(tensor) for name, tensor in tensors.items()})
    header = {
        **user,
        FORMAT_KEY: FORMAT_NAME,
        VERSION_KEY: FORMAT_VERSION,
        LIBRARY_KEY: __version__,
        STATE_KEY: json.dumps({"options": options, "layers": layers}),
        MODEL_KEY: json.dumps(model),
        CONFIG_KEY: json.dumps(config, sort_keys=True),
        DIGEST_KEY: json.dumps(digest, sort_keys=True),
    }
    _write_atomically(path, tensors, header)


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor], header: dict[str, str]) -> None:
    """Write to a temporary file next to `path`, then rename it over `path`: readers never see a partial file."""
    if path.is_dir():
        raise IsADirectoryError(f"Cannot save the cache to {path}: it is a directory. Pass a file path.")
    directory = path.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"Cannot save the cache to {path}: directory {directory} does not exist.")
    temporary = directory / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        save_file(tensors, temporary, metadata=header)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


# --- load -------------------------------------------------------------------------------------------------------
class _Reader:
    """A safetensors file opened for reading, with every low-level error turned into a ValueError naming the path."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stack = contextlib.ExitStack()
        try:
            self._file = self._stack.enter_context(safe_open(os.fspath(path), framework="pt", device="cpu"))
        except SafetensorError as error:
            raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupted?): {error}") from None
        self.header = self._file.metadata() or {}
        self.names = set(self._file.keys())
        self.digests: dict[str, Any] = {}  # read by `checked_parts`

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def invalid(self, problem: str) -> ValueError:
        return ValueError(f"{self.path} is not a valid HybridRingCache file: {problem}.")

    def check_format(self) -> None:
        if self.header.get(FORMAT_KEY) != FORMAT_NAME:
            raise ValueError(
                f"{self.path} is a safetensors file but not a saved HybridRingCache (its metadata has no "
                f"{FORMAT_KEY!r} = {FORMAT_NAME!r}). Save caches with `cache.save(path)`."
            )
        if self.header.get(VERSION_KEY) != FORMAT_VERSION:
            raise ValueError(
                f"{self.path} has HybridRingCache format version {self.header.get(VERSION_KEY)!r}; this version of "
                f"hybrid_cache reads version {FORMAT_VERSION}. Re-create the file with this version (`cache.save`)."
            )

    def damaged(self, part: str) -> ValueError:
        return ValueError(
            f"{self.path} is damaged: {part} does not match the digest saved with it (the file was edited or "
            f"corrupted after `save`). Re-create it with `cache.save(path)`."
        )

    def check_digest(self, part: str, digest: str, what: str) -> None:
        """Raise `damaged(what)` unless `digest` is the one the file recorded for `part`."""
        if self.digests.get(part) != digest:
            raise self.damaged(what)

    def json(self, key: str) -> Any:
        try:
            return json.loads(self.header[key])
        except (KeyError, ValueError) as error:
            raise self.invalid(f"metadata {key!r} is missing or not JSON ({error})") from None

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name not in self.names:
            raise self.invalid(f"tensor {name!r} is missing")
        try:
            tensor = self._file.get_tensor(name)
        except SafetensorError as error:
            raise self.invalid(f"tensor {name!r} cannot be read ({error})") from None
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise self.invalid(
                f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, its state says {shape} {dtype}"
            )
        self.check_digest(name, _tensor_digest(tensor), f"tensor {name!r}")
        return tensor

    def checked_parts(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The state, model and config JSON, each checked against the file's digests (the layers' entries too);
        the user metadata as well."""
        self.digests = self.json(DIGEST_KEY)
        if not isinstance(self.digests, dict):
            raise self.invalid(f"metadata {DIGEST_KEY!r} is not a JSON object")
        state, model, config = self.json(STATE_KEY), self.json(MODEL_KEY), self.json(CONFIG_KEY)
        if not isinstance(state, dict) or not isinstance(model, dict) or not isinstance(config, dict):
            raise self.invalid("its state / model / config metadata are not JSON objects")
        self.check_digest("model", _json_digest(model), f"the model identity ({MODEL_KEY!r})")
        self.check_digest("config", _json_digest(config), f"the model config ({CONFIG_KEY!r})")
        self.check_digest("options", _json_digest(state.get("options")), f"the cache options ({STATE_KEY!r})")
        user = {k: v for k, v in self.header.items() if not k.startswith(RESERVED_PREFIX)}
        self.check_digest("metadata", _json_digest(user), "the user metadata")
        layers = state.get("layers")
        if not isinstance(layers, list):
            raise self.invalid("its state has no list of layers")
        for index, entry in enumerate(layers):
            if entry is not None or f"layers.{index}" in self.digests:
                self.check_digest(f"layers.{index}", _json_digest(entry), f"layer {index}'s counters and settings")
        expected = {f"layers.{i}" for i, entry in enumerate(layers) if entry is not None} | {
            "options",
            "model",
            "config",
            "metadata",
            *self.names,
        }
        if set(self.digests) != expected:
            raise self.damaged(f"the list of parts ({sorted(set(self.digests) ^ expected)})")
        return state, model, config


def _integer(entry: Mapping[str, Any], key: str, minimum: int = 0) -> int:
    value = entry.get(key)
    if type(value) is not int or value < minimum:
        raise ValueError(f"{key!r} is {value!r}, not an integer >= {minimum}")
    return value


def _parse_options(options: Any) -> dict[str, Any]:
    """The saved `CacheOptions` fields, each of the type the dataclass declares (the combination is checked by
    `CacheOptions` itself when the cache is built)."""
    if not isinstance(options, dict):
        raise ValueError("the cache options are missing")
    types = typing.get_type_hints(CacheOptions)
    names = [field.name for field in dataclasses.fields(CacheOptions)]
    if sorted(options) != sorted(names):
        raise ValueError(f"its options are {sorted(options)}, this version's are {sorted(names)}")
    for name in names:
        allowed = typing.get_args(types[name]) or (types[name],)
        if not any(type(options[name]) is kind for kind in allowed):
            raise ValueError(f"option {name!r} is {options[name]!r}, not {types[name]}")
    return options


# What each `state_kind` is, in the words of the options that choose it (for mismatch messages).
_STORAGE_NAMES = {
    "sliding_attention": "a sliding-window ring",
    "full_attention": "exact full-attention storage",
    "quantized_full_attention": "compressed full-attention storage (full_layer_quantization)",
    "sink_window_full_attention": "bounded full-attention storage (full_layer_window)",
}


def _mismatch(entry: Any, layer: Any) -> str | None:
    """How the storage a layer's entry was saved from differs from `layer`'s (its kind, then its settings)."""
    kind = getattr(layer, "state_kind", None)
    if not isinstance(entry, dict) or kind is None:
        return None  # not a storage difference: `_parse_layer_state` reports it
    saved = entry.get("kind")
    if saved != kind:
        saved_name = _STORAGE_NAMES.get(saved, repr(saved)) if isinstance(saved, str) else repr(saved)
        return f"it holds the state of {saved_name}, this cache has {_STORAGE_NAMES.get(kind, kind)}"
    return layer.state_mismatch(entry)


def _parse_layer_state(entry: Any, layer: Any) -> LayerState:
    """A layer's saved state (counters and settings from the file), checked against the layer it goes into."""
    kind = getattr(layer, "state_kind", None)
    if not isinstance(entry, dict) or kind is None or entry.get("kind") != kind:
        raise ValueError(f"its state is {entry!r}, expected a {kind or 'storing'} layer")
    if entry.get("dtype") not in _DTYPES:
        raise ValueError(f"dtype {entry.get('dtype')!r} is not supported")
    settings = tuple((name, entry.get(name)) for name in layer.state_settings())
    unknown = set(entry) - set(COUNTER_FIELDS) - {name for name, _ in settings}
    if unknown:
        raise ValueError(f"its state has unknown entries {sorted(unknown)}")
    minimums = {"oldest": 0}
    counters = {
        name: _integer(entry, name, minimums.get(name, 1)) for name in COUNTER_FIELDS if name not in ("kind", "dtype")
    }
    state = LayerState(kind=kind, dtype=_DTYPES[entry["dtype"]], settings=settings, **counters)
    if not layer.accepts_state(state.meta()):
        raise ValueError(f"its counters are inconsistent ({state.to_json()})")
    return state


def _read_states(reader: _Reader, cache: StateHolder, device: torch.device, fix: str | None) -> list[tuple]:
    """Every layer's saved state and tensors (on `device`), checked against `cache`'s layers before anything is
    loaded. A layer whose storage differs raises naming `fix` (loading into a cache built elsewhere), or as an
    invalid file (`fix=None`: the cache was built from the file's own arguments)."""
    state, model, saved_config = reader.checked_parts()
    check_model(reader.path, model, saved_config, cache)
    entries = state.get("layers")
    if not isinstance(entries, list) or len(entries) != len(cache.layers):
        raise reader.invalid(f"it describes {len(entries) if isinstance(entries, list) else 'no'} layers")
    plan: list[tuple[Any, LayerState, int]] = []
    for index, (layer, entry) in enumerate(zip(cache.layers, entries)):
        if entry is None:
            continue
        difference = _mismatch(entry, layer)
        if difference is not None and fix is not None:
            raise ValueError(
                f"{reader.path} was saved from a cache with other storage: layer {index}: {difference}. {fix}"
            )
        try:
            if difference is not None:
                raise ValueError(difference)
            plan.append((layer, _parse_layer_state(entry, layer), index))
        except ValueError as error:
            raise reader.invalid(f"layer {index}: {error}") from None
    layouts = {(s.length, s.batch_size) for _, s, _ in plan}
    if len(layouts) > 1:
        raise reader.invalid(f"its layers disagree on (length, batch size): {sorted(layouts)}")
    try:
        expected = [(layer, s, index, layer.state_layout(s.meta())) for layer, s, index in plan]
    except ValueError as error:
        raise reader.invalid(str(error)) from None
    expected_names = {f"layers.{index}.{name}" for _, _, index, layout in expected for name in layout}
    if reader.names != expected_names:
        raise reader.invalid(f"unexpected tensors {sorted(reader.names ^ expected_names)}")
    loaded = []
    for layer, layer_state, index, layout in expected:
        tensors = {}
        for name, (shape, dtype) in layout.items():
            tensors[name] = reader.tensor(f"layers.{index}.{name}", shape, dtype).to(device)
        loaded.append((layer, layer_state, tensors))
    return loaded


def _open_checked(reader: _Reader) -> dict[str, Any]:
    """The saved cache options of a file whose format, digests and options are valid."""
    reader.check_format()
    state, _, _ = reader.checked_parts()
    try:
        return _parse_options(state.get("options"))
    except ValueError as error:
        raise reader.invalid(str(error)) from None


def load_cache(
    cls: Callable[..., HolderT], path: str | os.PathLike, config: Any, device: torch.device | str | None = None
) -> HolderT:
    """Read a cache written by `save_cache` (see `HybridRingCache.load`): built with the arguments the file records."""
    path = Path(os.fspath(path))
    device = torch.device("cpu" if device is None else device)
    with _Reader(path) as reader:
        options = _open_checked(reader)
        try:
            cache = cls(config, **options)
        except ValueError as error:
            raise reader.invalid(f"its options {options} do not build a cache ({error})") from None
        loaded = _read_states(reader, cache, device, fix=None)
    for layer, layer_state, tensors in loaded:
        layer.load_state(layer_state.meta(), **tensors)
    return cache


def load_into(cache: StateHolder, path: str | os.PathLike, device: torch.device | str | None = None) -> None:
    """Load a file written by `HybridRingCache.save` into `cache`, which must store its layers as the saved cache did
    (same `full_layer_*` storage options, `max_cache_len` and `rollback_margin`); `HybridRingCache.load` instead
    builds that cache from the file. Tensors go to `device` (default: where `cache` holds its tokens, else CPU).

    Raises:
        ValueError: the storage differs (naming the layer, the option and its two values) or the model does; the
            file is not a valid saved cache. Nothing is changed then.
    """
    path = Path(os.fspath(path))
    refuse_stateless_layers(cache, "load into")
    held = [t for layer in cache.layers if getattr(layer, "state_kind", None) for t in layer.storage_tensors()]
    device = torch.device(device if device is not None else held[0].device if held else "cpu")
    with _Reader(path) as reader:
        options = _open_checked(reader)
        current = dataclasses.asdict(cache.options)
        saved = ", ".join(f"{name}={value!r}" for name, value in options.items() if current[name] != value)
        fix = (
            f"Create the cache with the options the file was saved with ({saved or 'the same as this cache'}), or "
            f"load it with `HybridRingCache.load(path, config)`, which builds that cache."
        )
        loaded = _read_states(reader, cache, device, fix=fix)
    with writable(held[0] if held else None):
        cache.reset()
    for layer, layer_state, tensors in loaded:
        layer.load_state(layer_state.meta(), **tensors)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The user metadata of a file written by `HybridRingCache.save`, verbatim (hybrid_cache's own keys removed).

    Raises:
        ValueError: `path` is not a readable safetensors file, or not a saved HybridRingCache.
        OSError: `path` cannot be opened.
    """
    path = Path(os.fspath(path))
    with _Reader(path) as reader:
        reader.check_format()
        return {k: v for k, v in reader.header.items() if not k.startswith(RESERVED_PREFIX)}
