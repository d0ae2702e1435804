"""KV cache groups: which layers share a block table (vLLM's hybrid KV cache, in brisk's terms).

A model whose layers all attend the same way has one group: every layer, one block table per
request, as before. A model with sliding-window layers beside full ones (Gemma 3: five local
layers to one global) splits its layers into groups of equal size, each all-full or all-sliding:

    Gemma 3 270M, 18 layers (L = local, G = global):  L L L L L G  L L L L L G  L L L L L G
    groups of gcd(15, 3) = 3 layers:   full {5, 11, 17}   sliding {0, 1, 2} {3, 4, 6} ... {14, 15, 16}

Every group draws its blocks from one pool. A block id names the same slot range in `size`
layers' KV tensors: layer j of each group (its `slot`) shares one tensor, so a block holds
`size` layers' keys and values whichever group it serves. A full group's table covers the whole
sequence; a sliding group frees the blocks that have left its window (core/kv_cache_manager.py),
so a long context costs the full layers' KV plus about `window` tokens per sliding layer.

A window at least as long as the longest sequence served never slides anything: those layers
count as full here (their attention still applies the window, which then masks nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from brisk.config import ModelConfig


@dataclass(frozen=True)
class KVGroup:
    window: int  # 0: full attention; else each query sees the latest `window` positions
    layers: tuple[int, ...]  # model layer indices, in order; layer layers[j] uses KV slot j


def kv_groups(cfg: ModelConfig, max_model_len: int) -> tuple[KVGroup, ...]:
    """The model's layers as KV groups (see the module docstring)."""
    layers = range(cfg.num_hidden_layers)
    window = cfg.sliding_window if 0 < cfg.sliding_window < max_model_len else 0
    sliding = tuple(i for i in layers if window and cfg.window(i))
    full = tuple(i for i in layers if i not in sliding)
    if not sliding or not full:
        return (KVGroup(window if sliding else 0, tuple(layers)),)
    size = math.gcd(len(full), len(sliding))
    return tuple(KVGroup(w, kind[i:i + size]) for w, kind in ((0, full), (window, sliding))
                 for i in range(0, len(kind), size))


def layer_slots(groups: tuple[KVGroup, ...], num_layers: int) -> tuple[list[int], list[int]]:
    """Per model layer: (its group, its KV slot within the group)."""
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for j, layer in enumerate(group.layers):
            group_of[layer], slot_of[layer] = g, j
    return group_of, slot_of
