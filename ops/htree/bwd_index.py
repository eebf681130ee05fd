"""Host side of the htree backward (torch only, any device): from the forward's saved selections of one slab of
queries, the index structures the backward kernels read.

The selections are the winners' candidate-buffer positions [L-1, B, S, Hkv, top_k] int16 (entry l - 1: layer l;
ascending, -1 padded). Per slab this builds
  - par [L-1, B, S, Hkv, top_k] int32: the winners as nodes (entry l: the parents of layer l);
  - ncand [L-1, B, S, Hkv] int32: the candidate count n_l of every layer l <= L - 2 below the top;
  - flags [L-1, B, S, Hkv, nbuf + FLAG_PAD] int8: 1 at the winners' positions (entry l - 1: layer l); the columns
    from nbuf on pad;
and, per layer l below the top, ``parent_lists``: for every parent j at layer l + 1, the slab's (query, slot) pairs
that selected it, ordered by query (a stable sort), so that a node's gradient is summed in a fixed order."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ..common.grouping import group_by_key
from .kernels.bwd_common import FLAG_PAD
from .kernels.bwd_nodes import LIST_SLOT_BITS


def candidate_counts(t: torch.Tensor, num_layers: int, compression_rate: int, top_k: int) -> list[torch.Tensor]:
    """n_l(t) for l = 0 .. L-1 as the forward defines them: the top layer has (t >> (L-1) log r) + 1 candidates,
    a layer below min(top_k, n_{l+1}) parents, the last one cut at t's child: (m - 1) r + (t >> l log r) % r + 1."""
    log_r = int(math.log2(compression_rate))
    n = [None] * num_layers
    n[-1] = (t >> ((num_layers - 1) * log_r)) + 1
    for l in range(num_layers - 2, -1, -1):
        n[l] = (n[l + 1].clamp_max(top_k) - 1) * compression_rate + ((t >> (l * log_r)) & (compression_rate - 1)) + 1
    return n


def slab_index(sel: torch.Tensor, t_start: int, compression_rate: int, top_k: int, nbuf: int, checks: bool = False):
    """par, ncand, flags of the slab's selections ``sel`` [L-1, B, S, Hkv, top_k] (int16 positions) whose first query
    is t_start; with ``checks`` also the (message, bool tensor) checks that they are the forward's selections
    (for ``validate.check_values``)."""
    L1, B, S, Hkv, _ = sel.shape
    r = compression_rate
    dev = sel.device
    t = torch.arange(t_start, t_start + S, device=dev)
    n = [x.view(1, S, 1).expand(B, S, Hkv).to(torch.int32) for x in candidate_counts(t, L1 + 1, r, top_k)]
    pos = sel.to(torch.int64)
    valid = pos >= 0
    idx = SimpleNamespace()
    # the winners as nodes, from the top down (the top layer's position is its node)
    par = torch.empty(sel.shape, dtype=torch.int32, device=dev)
    above = None
    for e in range(L1 - 1, -1, -1):
        p = pos[e].clamp(0, nbuf - 1)
        nodes = p if above is None else above.gather(-1, (p // r).clamp_max(top_k - 1)) * r + p % r
        nodes = torch.where(valid[e], nodes, -1)
        par[e] = nodes
        above = nodes.clamp_min(0)
    idx.par = par
    idx.ncand = torch.stack(n[:L1]) if L1 else torch.empty(0, B, S, Hkv, dtype=torch.int32, device=dev)
    flags = torch.zeros(L1, B, S, Hkv, nbuf + FLAG_PAD, dtype=torch.int8, device=dev)
    flags.scatter_(-1, torch.where(valid, pos, nbuf).clamp(0, nbuf), 1)
    idx.flags = flags
    if checks:
        idx.checks = []
        for e in range(L1):
            ne = n[e + 1].to(torch.int64)[..., None]  # layer e + 1's candidates
            count = valid[e].sum(-1, keepdim=True)
            last = pos[e].gather(-1, (count - 1).clamp_min(0))
            idx.checks += [
                (f"selections[{e}]: expected -1 or a candidate position in [0, n) of its row", ((pos[e] >= -1) & (
                    pos[e] < ne)).all()),
                (f"selections[{e}]: expected ascending positions, -1 padded at the end",
                 ((pos[e][..., 1:] > pos[e][..., :-1]) | ~valid[e][..., 1:]).all() & (
                     valid[e][..., 1:] <= valid[e][..., :-1]).all()),
                (f"selections[{e}]: expected min(top_k, n) winners per row, the last the rightmost candidate n - 1 "
                 "(the forward's selections)", ((count == ne.clamp_max(top_k)) & (last == ne - 1)).all()),
            ]
    return idx


def parent_lists(par: torch.Tensor, num_parents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the parents par [B, S, Hkv, top_k] (nodes at layer l + 1, -1 padded) of one layer and slab: (start
    [B, Hkv, num_parents + 1] int32, entries [B * S * Hkv * top_k] int32): parent j of (b, h) was selected by the
    entries start[b, h, j] .. start[b, h, j + 1] - 1, each (query in the slab) << LIST_SLOT_BITS | slot, in
    ascending query order (a stable sort of the row-major pairs)."""
    B, S, Hkv, top_k = par.shape
    dev = par.device
    if S >= 1 << (31 - LIST_SLOT_BITS):
        raise ValueError(f"parent_lists: a slab of at most {(1 << (31 - LIST_SLOT_BITS)) - 1} queries, got {S}")
    n_keys = B * Hkv * num_parents
    key_dtype = torch.int32 if n_keys < 2 ** 31 - 1 else torch.int64
    base = ((torch.arange(B, device=dev) * Hkv).view(B, 1, 1, 1) + torch.arange(Hkv, device=dev).view(1, 1, Hkv, 1)) \
        * num_parents
    bounds, perm = group_by_key(torch.where(par >= 0, base + par, n_keys).to(key_dtype), n_keys)
    start = bounds[(base.view(B, Hkv, 1) + torch.arange(num_parents + 1, device=dev)).clamp_max(n_keys)]
    query = (perm // (Hkv * top_k)) % S
    entries = ((query << LIST_SLOT_BITS) | (perm % top_k)).to(torch.int32)
    return start, entries
