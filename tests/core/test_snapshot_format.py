"""The on-disk format of `HybridRingCache.save` (version 3) is the one `snapshot.py` documents: a file written by hand
field by field from that description loads into the same state, saving it again writes the same header and tensors,
and the digests are what make a hand edit of any part damage."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Gemma3TextConfig

from hybrid_cache import HybridRingCache
from hybrid_cache.options import CacheOptions
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


def sha256_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def sha256_tensor(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def layer_entry(length, oldest, capacity, slots) -> dict:
    return {
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


@pytest.fixture
def version_3_file(tmp_path):
    """A cache file written field by field as format version 3 describes it."""
    config = tiny_config()
    ring_keys = positions_tensor([4, 5, 2, 3])
    full_keys = positions_tensor(list(range(LENGTH)))
    tensors = {
        "layers.0.keys": ring_keys,
        "layers.0.values": ring_keys + 1000,
        "layers.1.keys": full_keys,
        "layers.1.values": full_keys + 1000,
    }
    ring = {**layer_entry(LENGTH, 2, W, W), "kind": "sliding_attention"}
    full = {**layer_entry(LENGTH, 0, LENGTH, LENGTH), "kind": "full_attention"}
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
    options = {field.name: field.default for field in dataclasses.fields(CacheOptions)}
    options["full_layer_rotation"] = False  # resolved on construction: always a bool in a file
    user = {"user.note": "kept"}
    digest = {"options": sha256_json(options), "model": sha256_json(model), "config": sha256_json(entries)}
    digest |= {"metadata": sha256_json(user), "layers.0": sha256_json(ring), "layers.1": sha256_json(full)}
    digest |= {name: sha256_tensor(tensor) for name, tensor in tensors.items()}
    header = {
        "hybrid_cache.format": "HybridRingCache",
        "hybrid_cache.format_version": "3",
        "hybrid_cache.version": "0.1.0",
        "hybrid_cache.state": json.dumps({"options": options, "layers": [ring, full]}),
        "hybrid_cache.model": json.dumps(model),
        "hybrid_cache.config": json.dumps(entries, sort_keys=True),
        "hybrid_cache.digest": json.dumps(digest, sort_keys=True),
        **user,
    }
    path = tmp_path / "v3.safetensors"
    save_file(tensors, path, metadata=header)
    return path, config, header, tensors


def test_version_3_file_loads_into_the_same_state(version_3_file):
    """ring W=4 after 6 tokens: slots [4, 5, 2, 3], oldest 2; full layer: positions 0..5."""
    path, config, _, _ = version_3_file
    cache = HybridRingCache.load(path, config)
    ring, full = cache.layers
    assert cache.get_seq_length() == LENGTH
    assert ring.meta_state()["oldest"] == 2 and ring.meta_state()["slots"] == W
    assert ring.keys[0, 0, :, 0].tolist() == [4, 5, 2, 3]
    assert ring.get_mask_sizes(1)[1].positions.tolist() == [4, 5, 6, 3]  # the next token goes to slot 6 % 4
    assert full.keys[0, 0, :LENGTH, 0].tolist() == list(range(LENGTH))
    assert (full.values[0, 0, :LENGTH, 0] - 1000).tolist() == list(range(LENGTH))


def test_saving_again_writes_the_same_file(version_3_file, tmp_path):
    path, config, header, tensors = version_3_file
    again = tmp_path / "again.safetensors"
    HybridRingCache.load(path, config).save(again, metadata={"user.note": "kept"})
    with safe_open(str(again), framework="pt") as handle:
        saved_header = handle.metadata()
        assert set(handle.keys()) == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor), name
    for key in ("hybrid_cache.format", "hybrid_cache.format_version", "user.note"):
        assert saved_header[key] == header[key]
    for key in ("hybrid_cache.state", "hybrid_cache.model", "hybrid_cache.config", "hybrid_cache.digest"):
        assert json.loads(saved_header[key]) == json.loads(header[key]), key


@pytest.mark.parametrize(
    ("edit", "part"),
    [
        (lambda state, user: state["options"].update(full_layer_rotation=True), "the cache options"),
        (lambda state, user: state["options"].update(rollback_margin=1), "the cache options"),
        (lambda state, user: state["layers"][0].update(oldest=3), "layer 0's counters and settings"),
        (lambda state, user: [e.update(length=e["length"] + 1) for e in state["layers"]], "layer 0's counters"),
        (lambda state, user: user.update({"user.note": "edited"}), "the user metadata"),
    ],
    ids=["option", "margin", "ring-oldest", "all-lengths", "user-metadata"],
)
def test_a_hand_edited_header_is_damage(version_3_file, edit, part):
    """Edits that keep the header consistent (an option, a ring's `oldest`, every layer's length, the user's own
    metadata) are refused at load as damage naming the part, before anything is built from them."""
    path, config, header, tensors = version_3_file
    state, user = json.loads(header["hybrid_cache.state"]), {"user.note": header["user.note"]}
    edit(state, user)
    save_file(tensors, path, metadata={**header, "hybrid_cache.state": json.dumps(state), **user})
    with pytest.raises(ValueError, match=f"{path} is damaged: {part}"):
        HybridRingCache.load(path, config)


def test_a_consistent_forgery_still_meets_the_counter_checks(version_3_file):
    """Digests recomputed over an edited ring (`oldest` past what its slots can hold): the counters are checked
    against each other and the ring's capacity, as the digests would not catch a deliberate rewrite."""
    path, config, header, tensors = version_3_file
    state, digest = json.loads(header["hybrid_cache.state"]), json.loads(header["hybrid_cache.digest"])
    state["layers"][0]["oldest"] = 0  # 6 tokens in 4 slots, yet "in time order"
    digest["layers.0"] = sha256_json(state["layers"][0])
    forged = {**header, "hybrid_cache.state": json.dumps(state), "hybrid_cache.digest": json.dumps(digest)}
    save_file(tensors, path, metadata=forged)
    with pytest.raises(ValueError, match="layer 0: its counters are inconsistent"):
        HybridRingCache.load(path, config)
