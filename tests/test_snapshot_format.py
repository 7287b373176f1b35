"""The on-disk format of `HybridRingCache.save` (version 1) stays readable: a file written by hand in that format, as
earlier releases wrote it, loads into the same state, and saving it again writes the same header and tensors."""

from __future__ import annotations

import hashlib
import json
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Gemma3TextConfig

from hybrid_cache import HybridRingCache
from hybrid_cache.snapshot import config_entries

W, LENGTH = 4, 6  # ring of 4 slots after 6 tokens: positions 2..5 in slots [4, 5, 2, 3]


def tiny_config() -> Gemma3TextConfig:
    return Gemma3TextConfig(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=W,
        hidden_size=8,
        intermediate_size=8,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=2,
        vocab_size=16,
    )


def positions_tensor(positions: list[int]) -> torch.Tensor:
    """`[1, 1, len, 2]` keys whose values are the token positions (values: `+ 1000`)."""
    return torch.tensor(positions, dtype=torch.float32).view(1, 1, -1, 1).expand(1, 1, -1, 2).contiguous()


def layer_entry(length, oldest, capacity, slots, keys, values) -> dict:
    entry = {
        "kind": None,
        "length": length,
        "oldest": oldest,
        "capacity": capacity,
        "slots": slots,
        "batch_size": 1,
        "num_heads": 1,
        "k_head_dim": 2,
        "v_head_dim": 2,
        "dtype": "torch.float32",
    }
    entry["keys_crc32"] = zlib.crc32(keys.reshape(-1).view(torch.uint8).numpy())
    entry["values_crc32"] = zlib.crc32(values.reshape(-1).view(torch.uint8).numpy())
    return entry


@pytest.fixture
def version_1_file(tmp_path):
    """A cache file written field by field as format version 1 describes it."""
    config = tiny_config()
    ring_keys = positions_tensor([4, 5, 2, 3])
    full_keys = positions_tensor(list(range(LENGTH)))
    tensors = {
        "layers.0.keys": ring_keys,
        "layers.0.values": ring_keys + 1000,
        "layers.1.keys": full_keys,
        "layers.1.values": full_keys + 1000,
    }
    ring = {**layer_entry(LENGTH, 2, W, W, ring_keys, ring_keys + 1000), "kind": "sliding_attention"}
    full = {**layer_entry(LENGTH, 0, LENGTH, LENGTH, full_keys, full_keys + 1000), "kind": "full_attention"}
    entries = config_entries(HybridRingCache(config))
    model = {
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "kv_sharing_modes": None,
        "sliding_window": [W, None],
        "num_key_value_heads": [1, 1],
        "head_dim": [2, 2],
        "model_type": "gemma3_text",
        "fingerprint": hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest(),
    }
    arguments = {"max_cache_len": None, "rollback_margin": 0, "initial_capacity": 0, "dense_decode_mask": None}
    header = {
        "hybrid_cache.format": "HybridRingCache",
        "hybrid_cache.format_version": "1",
        "hybrid_cache.version": "0.1.0",
        "hybrid_cache.state": json.dumps({"arguments": arguments, "layers": [ring, full]}),
        "hybrid_cache.model": json.dumps(model),
        "hybrid_cache.config": json.dumps(entries, sort_keys=True),
        "user.note": "kept",
    }
    path = tmp_path / "v1.safetensors"
    save_file(tensors, path, metadata=header)
    return path, config, header, tensors


def test_version_1_file_loads_into_the_same_state(version_1_file):
    """ring W=4 after 6 tokens: slots [4, 5, 2, 3], oldest 2; full layer: positions 0..5."""
    path, config, _, _ = version_1_file
    cache = HybridRingCache.load(path, config)
    ring, full = cache.layers
    assert cache.get_seq_length() == LENGTH
    assert ring.meta_state()["oldest"] == 2 and ring.meta_state()["slots"] == W
    assert ring.keys[0, 0, :, 0].tolist() == [4, 5, 2, 3]
    assert ring.get_mask_sizes(1)[1].positions.tolist() == [4, 5, 6, 3]  # the next token goes to slot 6 % 4
    assert full.keys[0, 0, :LENGTH, 0].tolist() == list(range(LENGTH))
    assert (full.values[0, 0, :LENGTH, 0] - 1000).tolist() == list(range(LENGTH))


def test_saving_again_writes_the_same_file(version_1_file, tmp_path):
    path, config, header, tensors = version_1_file
    again = tmp_path / "again.safetensors"
    HybridRingCache.load(path, config).save(again, metadata={"user.note": "kept"})
    with safe_open(str(again), framework="pt") as handle:
        saved_header = handle.metadata()
        assert set(handle.keys()) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor), name
    for key in ("hybrid_cache.format", "hybrid_cache.format_version", "user.note"):
        assert saved_header[key] == header[key]
    for key in ("hybrid_cache.state", "hybrid_cache.model", "hybrid_cache.config"):
        assert json.loads(saved_header[key]) == json.loads(header[key]), key
