"""Persistence and snapshots of a `HybridRingCache`: one safetensors file (`save` / `load`) and in-memory checkpoints
(`checkpoint` / `restore`).

What a cache needs to continue exactly is small and explicit. A sliding layer's ring keeps position `p` in slot
`p % max_slots` and holds positions `[oldest, length)`: its slots are saved as they are, in slot order, with the two
counters, so a loaded ring is the same ring (same slots, same stale slots, same next write), before or after the
wrap. A full layer is saved as its `length` tokens. KV-shared layers hold nothing. The file also records the cache's
constructor arguments and what identifies the model config it belongs to, so that a file is never loaded into a model
whose layers it does not fit.

A checkpoint copies the rings only (about `sliding layers x window` slots) and remembers the full layers' lengths:
restoring cuts the full layers back, which is exact as long as their tokens before the checkpoint were not rewritten
since. Every storage layer records the lowest position written since it was last asked (`note_write` /
`write_floor` in `storage.py`); the checkpoints of a cache collect those floors whenever a checkpoint is taken or
restored, and `restore` refuses, naming the fix, when the tokens it would keep have been overwritten.

File layout (all metadata values are strings, as safetensors requires):

- tensors `layers.<i>.keys` / `layers.<i>.values`: `[batch, kv_heads, slots, head_dim]` for every layer holding tokens;
- `hybrid_cache.format` = `HybridRingCache`, `hybrid_cache.format_version` = `1`, `hybrid_cache.version`;
- `hybrid_cache.state`: JSON, the constructor arguments and each layer's counters, shapes, dtype and CRC-32s;
- `hybrid_cache.model`: JSON, the layer structure (layer types, KV sharing, windows, KV heads, head sizes per layer)
  and the SHA-256 fingerprint of `hybrid_cache.config`, the model config (without volatile entries) as JSON;
- every other key: the user's metadata, verbatim.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
import weakref
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .specs import FULL, OTHER_STAGE, SLIDING, declared_structure
from .storage import NOTHING_WRITTEN
from .version import __version__

if TYPE_CHECKING:
    from .cache import HybridRingCache

__all__ = ["RESERVED_PREFIX", "CacheCheckpoint", "read_metadata"]

#: The constructor arguments the format records (`HybridRingCache.options`); the others are not saved.
SAVED_ARGUMENTS = ("max_cache_len", "rollback_margin", "initial_capacity", "dense_decode_mask")
#: Metadata keys starting with this prefix belong to hybrid_cache; user metadata may not use it.
RESERVED_PREFIX = "hybrid_cache."
FORMAT_KEY, FORMAT_NAME = RESERVED_PREFIX + "format", "HybridRingCache"
VERSION_KEY, FORMAT_VERSION = RESERVED_PREFIX + "format_version", "1"
STATE_KEY, MODEL_KEY, CONFIG_KEY = RESERVED_PREFIX + "state", RESERVED_PREFIX + "model", RESERVED_PREFIX + "config"
LIBRARY_KEY = RESERVED_PREFIX + "version"

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


# --- one layer's state ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerState:
    """The counters and geometry of one storing layer; its K/V content is kept beside it.

    `slots` is how many slots (from slot 0) hold content worth keeping: a ring in time order (`oldest == 0`,
    `length <= max_slots`) keeps `length`, a wrapped ring all its `max_slots` (in slot order, not time order); a full
    layer keeps `length`. `capacity` is the allocated slot count, restored so that growth continues as it would have.
    """

    kind: str
    length: int
    oldest: int
    capacity: int
    slots: int
    batch_size: int
    num_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: torch.dtype

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "dtype": str(self.dtype)}

    def shape(self, head_dim: int) -> tuple[int, int, int, int]:
        """`[batch, kv_heads, slots, head_dim]` of the saved keys (`k_head_dim`) or values (`v_head_dim`)."""
        return (self.batch_size, self.num_heads, self.slots, head_dim)

    def meta(self) -> dict[str, Any]:
        """The layer's `meta_state()` this state was read from (what `load_state` takes)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def read_layer_state(layer: Any) -> LayerState | None:
    """The state of one layer of a cache (its `meta_state()`), or `None` when it holds no tokens (KV-shared, never
    used, reset) or stores nothing."""
    meta = layer.meta_state() if getattr(layer, "state_kind", None) is not None else None
    return None if meta is None else LayerState(**meta)


# --- model identity -----------------------------------------------------------------------------------------------
def _canonical(value: Any) -> Any:
    """`value` as plain JSON data (tuples become lists, unknown objects their string), for exact comparison."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def config_entries(cache: HybridRingCache) -> dict[str, Any]:
    """The text config as JSON data, without the entries that do not change what the cache holds."""
    entries = cache.config.to_dict()
    return _canonical({k: v for k, v in entries.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS})


def model_identity(cache: HybridRingCache) -> dict[str, Any]:
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


def check_model(path: Path, saved: Mapping[str, Any], saved_config: Mapping[str, Any], cache: HybridRingCache) -> None:
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
def _crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy())


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


def _check_exact_storage(cache: HybridRingCache, action: str) -> None:
    """Refuse, naming the fix, a cache whose layers this format does not describe: compressed or bounded full layers
    (`full_layer_quantization` / `full_layer_window`) and pipeline-parallel stages (`stage_layers`)."""
    for index, (kind, layer) in enumerate(zip(cache.layer_kinds, cache.layers)):
        if kind == OTHER_STAGE:
            raise ValueError(
                f"Cannot {action} a pipeline-parallel stage's cache (layer {index} runs on another stage): the format "
                f"holds whole caches. Keep each stage's prefix in memory (`copy.deepcopy(cache)`) instead."
            )
        if kind in (SLIDING, FULL) and getattr(layer, "state_kind", None) is None:
            raise ValueError(
                f"Cannot {action} layer {index}: it is a {type(layer).__name__} (full_layer_quantization / "
                f"full_layer_window), which save / load / checkpoint do not support yet. Use exact storage (the "
                f"default) for prefix caches, or `copy.deepcopy(cache)` to keep a copy in memory."
            )


def save_cache(cache: HybridRingCache, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
    """Write `cache` to one safetensors file at `path` (see `HybridRingCache.save`)."""
    _check_exact_storage(cache, "save")
    path = Path(os.fspath(path))
    header = _user_metadata(metadata)
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any] | None] = []
    for index, layer in enumerate(cache.layers):
        state = read_layer_state(layer)
        if state is None:
            layers.append(None)
            continue
        entry = state.to_json()
        for name, tensor in zip(("keys", "values"), layer.state()):
            held = tensor.detach().to("cpu").contiguous()
            tensors[f"layers.{index}.{name}"] = held
            entry[f"{name}_crc32"] = _crc32(held)
        layers.append(entry)
    arguments = {name: getattr(cache.options, name) for name in SAVED_ARGUMENTS}
    header.update(
        {
            FORMAT_KEY: FORMAT_NAME,
            VERSION_KEY: FORMAT_VERSION,
            LIBRARY_KEY: __version__,
            STATE_KEY: json.dumps({"arguments": arguments, "layers": layers}),
            MODEL_KEY: json.dumps(model_identity(cache)),
            CONFIG_KEY: json.dumps(config_entries(cache), sort_keys=True),
        }
    )
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
                f"hybrid_cache reads version {FORMAT_VERSION}. Re-create the file with this version."
            )

    def json(self, key: str) -> Any:
        try:
            return json.loads(self.header[key])
        except (KeyError, ValueError) as error:
            raise self.invalid(f"metadata {key!r} is missing or not JSON ({error})") from None

    def tensor(self, name: str, state: LayerState, head_dim: int) -> torch.Tensor:
        if name not in self.names:
            raise self.invalid(f"tensor {name!r} is missing")
        try:
            tensor = self._file.get_tensor(name)
        except SafetensorError as error:
            raise self.invalid(f"tensor {name!r} cannot be read ({error})") from None
        if tuple(tensor.shape) != state.shape(head_dim) or tensor.dtype != state.dtype:
            raise self.invalid(
                f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, its state says {state.shape(head_dim)} "
                f"{state.dtype}"
            )
        return tensor


def _integer(entry: Mapping[str, Any], key: str, minimum: int = 0) -> int:
    value = entry.get(key)
    if type(value) is not int or value < minimum:
        raise ValueError(f"{key!r} is {value!r}, not an integer >= {minimum}")
    return value


def _parse_arguments(arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, dict):
        raise ValueError("the cache arguments are missing")
    max_cache_len = arguments.get("max_cache_len")
    if max_cache_len is not None:
        _integer(arguments, "max_cache_len", 1)
    dense = arguments.get("dense_decode_mask")
    if dense is not None and not isinstance(dense, bool):
        raise ValueError(f"'dense_decode_mask' is {dense!r}")
    return {
        "max_cache_len": max_cache_len,
        "rollback_margin": _integer(arguments, "rollback_margin"),
        "initial_capacity": _integer(arguments, "initial_capacity"),
        "dense_decode_mask": dense,
    }


def _parse_layer_state(entry: Any, layer: Any) -> LayerState:
    """A layer's saved state, checked against the layer it goes into (the file is not trusted)."""
    kind = getattr(layer, "state_kind", None)
    if not isinstance(entry, dict) or kind is None or entry.get("kind") != kind:
        raise ValueError(f"its state is {entry!r}, expected a {kind or 'storing'} layer")
    if entry.get("dtype") not in _DTYPES:
        raise ValueError(f"dtype {entry.get('dtype')!r} is not supported")
    state = LayerState(
        kind=kind,
        length=_integer(entry, "length", 1),
        oldest=_integer(entry, "oldest"),
        capacity=_integer(entry, "capacity", 1),
        slots=_integer(entry, "slots", 1),
        batch_size=_integer(entry, "batch_size", 1),
        num_heads=_integer(entry, "num_heads", 1),
        k_head_dim=_integer(entry, "k_head_dim", 1),
        v_head_dim=_integer(entry, "v_head_dim", 1),
        dtype=_DTYPES[entry["dtype"]],
    )
    if not layer.accepts_state(state.meta()):
        raise ValueError(f"its counters are inconsistent ({state.to_json()})")
    return state


def load_cache(
    cls: type[HybridRingCache], path: str | os.PathLike, config: Any, device: torch.device | str | None = None
) -> HybridRingCache:
    """Read a cache written by `save_cache` (see `HybridRingCache.load`)."""
    path = Path(os.fspath(path))
    device = torch.device("cpu" if device is None else device)
    with _Reader(path) as reader:
        reader.check_format()
        state, model, saved_config = reader.json(STATE_KEY), reader.json(MODEL_KEY), reader.json(CONFIG_KEY)
        if not isinstance(state, dict) or not isinstance(model, dict) or not isinstance(saved_config, dict):
            raise reader.invalid("its state / model metadata are not JSON objects")
        try:
            arguments = _parse_arguments(state.get("arguments"))
        except ValueError as error:
            raise reader.invalid(str(error)) from None
        cache = cls(config, **arguments)
        check_model(path, model, saved_config, cache)
        entries = state.get("layers")
        if not isinstance(entries, list) or len(entries) != len(cache.layers):
            raise reader.invalid(f"it describes {len(entries) if isinstance(entries, list) else 'no'} layers")
        plan: list[tuple[Any, LayerState, str]] = []
        for index, (layer, entry) in enumerate(zip(cache.layers, entries)):
            if entry is None:
                continue
            try:
                plan.append((layer, _parse_layer_state(entry, layer), str(index)))
            except ValueError as error:
                raise reader.invalid(f"layer {index}: {error}") from None
        layouts = {(s.length, s.batch_size) for _, s, _ in plan}
        if len(layouts) > 1:
            raise reader.invalid(f"its layers disagree on (length, batch size): {sorted(layouts)}")
        expected_names = {f"layers.{index}.{name}" for _, _, index in plan for name in ("keys", "values")}
        if reader.names != expected_names:
            raise reader.invalid(f"unexpected tensors {sorted(reader.names ^ expected_names)}")
        contents = []
        for _layer, layer_state, index in plan:
            tensors = []
            for name, head_dim in (("keys", layer_state.k_head_dim), ("values", layer_state.v_head_dim)):
                tensor = reader.tensor(f"layers.{index}.{name}", layer_state, head_dim)
                if _crc32(tensor) != entries[int(index)].get(f"{name}_crc32"):
                    raise reader.invalid(f"the CRC-32 of tensor 'layers.{index}.{name}' does not match (corrupted)")
                tensors.append(tensor.to(device))
            contents.append(tensors)
    for (layer, layer_state, _), (keys, values) in zip(plan, contents):
        layer.load_state(layer_state.meta(), keys, values)
    return cache


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


# --- checkpoints ------------------------------------------------------------------------------------------------
# Live checkpoints of every cache, so that each one learns about the writes made while another was newer.
_CHECKPOINTS: weakref.WeakKeyDictionary[HybridRingCache, weakref.WeakSet[CacheCheckpoint]] = (
    weakref.WeakKeyDictionary()
)


class CacheCheckpoint:
    """An in-memory snapshot of a `HybridRingCache`, made by `cache.checkpoint()`, used by `cache.restore()`.

    It holds a copy of every ring's slots and counters (at most `window + rollback_margin` slots per sliding layer)
    and, for full-attention layers, their length only: it never keeps their history (or its storage) alive.
    `restore` can be called any number of times, after decoding, cropping or resetting, as long as the batch size
    is the same and the full layers' tokens before the checkpoint were not rewritten since.

    Attributes:
        length (`int`): tokens the cache held when the checkpoint was taken.
    """

    def __init__(
        self, cache: HybridRingCache, states: list[LayerState | None], contents: list[tuple[torch.Tensor, ...] | None]
    ) -> None:
        self._cache = weakref.ref(cache)
        self._states = states
        self._contents = contents
        # Lowest position written in each layer since this checkpoint (collected from the layers' write floors).
        self._floors = [NOTHING_WRITTEN] * len(states)
        self.length = max((s.length for s in states if s is not None), default=0)

    def nbytes(self) -> int:
        """Bytes of K/V content this checkpoint holds (the rings' slots)."""
        return sum(t.numel() * t.element_size() for c in self._contents if c is not None for t in c)

    def __repr__(self) -> str:
        return f"CacheCheckpoint(length={self.length}, nbytes={self.nbytes()})"

    # A checkpoint never changes once taken, and its cache must know every copy of it (to tell it about later
    # writes): copies are the checkpoint itself, and it does not leave the process.
    def __copy__(self) -> CacheCheckpoint:
        return self

    def __deepcopy__(self, memo: dict) -> CacheCheckpoint:
        return self

    def __reduce__(self) -> Any:
        raise TypeError(
            "A CacheCheckpoint lives in memory next to its cache and cannot be pickled; save the cache itself with "
            "`cache.save(path)` and load it with `HybridRingCache.load(path, config)`."
        )


def _full_layers(cache: HybridRingCache) -> Iterator[tuple[int, Any]]:
    return ((i, layer) for i, layer in enumerate(cache.layers) if getattr(layer, "state_kind", None) == FULL)


def _collect_write_floors(cache: HybridRingCache) -> None:
    """Hand the full layers' write floors to every live checkpoint of `cache`, then clear them."""
    live = _CHECKPOINTS.get(cache, ())
    for index, layer in _full_layers(cache):
        floor = layer.take_write_floor()
        for checkpoint in live:
            checkpoint._floors[index] = min(checkpoint._floors[index], floor)


def take_checkpoint(cache: HybridRingCache) -> CacheCheckpoint:
    """See `HybridRingCache.checkpoint`."""
    _check_exact_storage(cache, "checkpoint")
    _collect_write_floors(cache)
    states, contents = [], []
    for layer in cache.layers:
        state = read_layer_state(layer)
        states.append(state)
        if state is not None and state.kind == SLIDING:
            contents.append(tuple(tensor.clone() for tensor in layer.state()))
        else:
            contents.append(None)
    checkpoint = CacheCheckpoint(cache, states, contents)
    _CHECKPOINTS.setdefault(cache, weakref.WeakSet()).add(checkpoint)
    return checkpoint


def _check_restorable(cache: HybridRingCache, checkpoint: CacheCheckpoint) -> None:
    """Raise, naming the fix, unless `checkpoint` can be restored exactly into `cache` (nothing is changed)."""
    for index, (layer, state) in enumerate(zip(cache.layers, checkpoint._states)):
        if state is None:
            continue
        contents = checkpoint._contents[index]
        if not layer.same_state_layout(state.meta()) or (contents is not None and layer.device != contents[0].device):
            held = (
                f"batch_size={layer.batch_size}, kv_heads={layer.num_heads}, {layer.dtype} on {layer.device}"
                if layer.is_initialized
                else "nothing allocated"
            )
            raise ValueError(
                f"Cannot restore the checkpoint: layer {index} now holds {held}, but the checkpoint was taken with "
                f"batch_size={state.batch_size}, kv_heads={state.num_heads}, {state.dtype}. A checkpoint restores "
                f"into the same batch size, dtype and device: take it after `batch_repeat_interleave`, or keep a "
                f"`copy.deepcopy(cache)` instead."
            )
        if state.kind == FULL:
            floor = min(checkpoint._floors[index], int(layer.write_floor))
            if floor < state.length:
                raise ValueError(
                    f"Cannot restore the checkpoint exactly: full-attention layer {index} no longer holds its "
                    f"{state.length} tokens (positions from {floor} on were rewritten since: a crop or reset below "
                    f"the checkpoint followed by new tokens, a beam-search reorder, or a reallocation). A checkpoint "
                    f"keeps only the sliding-window rings; to go back further, keep `copy.deepcopy(cache)` or "
                    f"`cache.save(path)` instead."
                )


def restore_checkpoint(cache: HybridRingCache, checkpoint: CacheCheckpoint) -> None:
    """See `HybridRingCache.restore`."""
    if not isinstance(checkpoint, CacheCheckpoint):
        raise TypeError(
            f"restore() takes a CacheCheckpoint from `cache.checkpoint()`, got {type(checkpoint).__name__}."
        )
    if checkpoint._cache() is not cache:
        raise ValueError(
            "This checkpoint was taken from another cache. Restore it into the cache it came from; to branch a cache "
            "into an independent one, use `copy.deepcopy(cache)`."
        )
    _check_restorable(cache, checkpoint)
    _collect_write_floors(cache)
    for layer, state, contents in zip(cache.layers, checkpoint._states, checkpoint._contents):
        if getattr(layer, "state_kind", None) is None:
            continue
        if state is None:
            if layer.is_initialized:
                layer.clear()
        elif state.kind == SLIDING:
            layer.load_state(state.meta(), *contents)
        else:
            layer.set_length(state.length)
