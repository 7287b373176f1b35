"""Attention weights in time order.

With `output_attentions=True` (eager attention), transformers returns each layer's weights over the keys that layer's
cache returned, in the order returned. After the wrap a sliding layer's one-token step attends over the ring in slot
order: column `j` belongs to position `cache.key_positions(layer_idx)[j]`, not to `j`. This module puts such weights
back on the time axis, which is what attention plots and analyses expect.

Example:

```python
>>> from hybrid_cache import HybridRingCache, attention_in_time_order
>>> cache = HybridRingCache(model.config)  # model loaded with attn_implementation="eager"
>>> out = model(input_ids=prompt, **cache_kwargs(cache))  # from hybrid_cache import cache_kwargs
>>> out = model(input_ids=next_token, **cache_kwargs(cache), output_attentions=True)
>>> weights = attention_in_time_order(out.attentions[0], cache.key_positions(0))
>>> weights.shape  # [batch, heads, 1, tokens so far]; zero where the layer's window does not reach
```
"""

from __future__ import annotations

import torch

__all__ = ["attention_in_time_order"]


def attention_in_time_order(weights: torch.Tensor, positions: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """Scatter attention weights from the cache's key order onto absolute token positions.

    Args:
        weights (`torch.Tensor` of shape `[..., kv_length]`): one layer's attention weights (`outputs.attentions[i]`),
            columns in the order the layer's cache returned its keys.
        positions (`torch.LongTensor` of shape `[kv_length]`): `cache.key_positions(i)` right after that forward;
            `-1` marks an empty slot (always masked, weight 0).
        length (`int`, *optional*): size of the time axis; default: one past the largest position.

    Returns:
        `torch.Tensor` of shape `[..., length]`: `result[..., p]` is the weight on the key at position `p`; positions
        the layer did not return (outside its window) are 0, exactly as in a no-cache forward's weights.
    """
    if weights.shape[-1] != positions.shape[0]:
        raise ValueError(
            f"The weights have {weights.shape[-1]} key columns but `positions` has {positions.shape[0]} entries: pass "
            f"`cache.key_positions(layer_idx)` of the same layer, read right after the forward that produced them."
        )
    positions = positions.to(weights.device)
    held = positions >= 0
    if length is None:
        length = int(positions.max()) + 1 if bool(held.any()) else 0
    result = weights.new_zeros(weights.shape[:-1] + (length,))
    result[..., positions[held]] = weights[..., held]
    return result
