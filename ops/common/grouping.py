"""Entry lists grouped by key on the device, no host sync, in a stable order: the index that node-major kernels
walk where the order within a group matters (htree backward's parents, summed in order). HSA extend's page lists,
whose order does not matter, come from its own counting sort (`ops/hsa/kernels/extend_entries.py`)."""

from __future__ import annotations

import torch


def group_by_key(key: torch.Tensor, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """key: any shape, integers in [0, n_keys] (n_keys: the entry belongs to no group). Returns (bounds [n_keys + 1]
    int32, order): group g holds the flattened entries order[bounds[g]:bounds[g + 1]], in their flattened order (a
    stable sort); the ungrouped entries come last."""
    sorted_keys, order = torch.sort(key.flatten(), stable=True)
    bounds = torch.searchsorted(sorted_keys, torch.arange(n_keys + 1, device=key.device, dtype=key.dtype),
                                out_int32=True)
    return bounds, order
