"""Golden htree forward (hierarchical tree sparse attention, seed 000).

Tree: layer 0 is the tokens; layer l+1 has N_{l+1} = ceil(N_l / r) nodes, each the mean of its existing
children (fewer than r at the tail), until the top layer L-1 has N_{L-1} <= max_top_nodes nodes.

For every (b, t, kv head), from the top layer down:
  - candidates: top layer nodes 0..floor(t / r^(L-1)); lower layers the r children of each parent
    selected one layer up (ascending), the rightmost parent's children cut at floor(t / r^l).
    The candidate at buffer position p is rotated at position p, the query at n - 1 (candidate-local RoPE).
  - scores s_{g,p} = scale * <RoPE(q_g, n-1), RoPE(k_p, p)> for the G query heads of the kv head.
  - layers l > 0: importance imp_p = sum_g exp(s_{g,p} - lse_g) in fp32 (subnormal terms flushed to 0),
    the rightmost candidate's set to 1e3; stable top-k by bit-packing: the low LOG_N bits of the fp32
    importance are replaced by ~p, LOG_N = log2(max(max_top_nodes, top_k * r)), sorted descending.
    The min(top_k, n) winners are expanded into layer l-1; the others are merged into the per-head
    online softmax (m, S, U).
  - layer 0: every candidate is merged. Output O = U / S.

Computes in fp32 (fp64 for fp64 inputs); tree nodes are stored in the input dtype, like the kernel's.
Queries are processed in tiles, so memory stays bounded as T grows.

Backward: the forward is differentiable through torch autograd as it is, with the selections held constant
(integers): the gradient flows through the one softmax over the merged candidates of all layers, the
candidate-local RoPE and the mean pooling of the tree. ``selection=`` forces given selections, ``return_lse``
gives the final log-sum-exp per query head (what the compiled backward takes).
"""

from __future__ import annotations

import math

import torch

# (ops/htree/tree.py keeps its own copies of these definitions; tests/test_htree.py checks that both agree)
RIGHTMOST_IMPORTANCE = 1e3


def num_layers(seq_len: int, compression_rate: int, max_top_nodes: int) -> int:
    n, layers = seq_len, 1
    while n > max_top_nodes:
        n = -(-n // compression_rate)
        layers += 1
    return layers


def pack_bits(compression_rate: int, top_k_per_layer: int, max_top_nodes: int) -> int:
    """LOG_N: how many low bits of the fp32 importance carry the candidate's buffer position."""
    return int(math.log2(max(max_top_nodes, top_k_per_layer * compression_rate)))


def rope_tables(head_dim: int, num_positions: int, rope_base: float, dtype=torch.float32, device=None):
    """cos, sin [num_positions, head_dim // 2] for rotate-half RoPE, frequency base^(-2i/K)."""
    inv_freq = rope_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(num_positions, dtype=dtype, device=device), inv_freq.to(dtype))
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    lo, hi = x.chunk(2, dim=-1)
    return torch.cat([lo * cos - hi * sin, lo * sin + hi * cos], dim=-1)


def round_straight_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x's values rounded to ``dtype`` and kept in x's dtype; the gradient passes unchanged (straight through), so a
    tree stored in 16 bits is differentiated in x's precision."""
    if dtype == x.dtype:
        return x
    return x + (x.to(dtype).to(x.dtype) - x).detach()


def build_tree(k: torch.Tensor, v: torch.Tensor, compression_rate: int, max_top_nodes: int, node_dtype=None):
    """[(K_l, V_l)] for l = 0..L-1, K_l [B, N_l, Hkv, K] in k's dtype (means taken in fp32 or fp64). With
    ``node_dtype`` the nodes above the tokens are rounded to it but kept in k's dtype (``round_straight_through``)."""
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    layers = [(k, v)]
    while layers[-1][0].shape[1] > max_top_nodes:
        ks, vs = layers[-1]
        n = ks.shape[1]
        m = -(-n // compression_rate)
        pad = m * compression_rate - n
        count = torch.full((m,), float(compression_rate), dtype=acc, device=k.device)
        count[-1] -= pad

        def pool(x):
            x = torch.nn.functional.pad(x.to(acc), (0, 0, 0, 0, 0, pad))
            x = x.view(x.shape[0], m, compression_rate, *x.shape[2:]).sum(dim=2) / count[None, :, None, None]
            return x.to(k.dtype) if node_dtype is None else round_straight_through(x, node_dtype).to(k.dtype)

        layers.append((pool(ks), pool(vs)))
    return layers


def _pack_importance(imp: torch.Tensor, pos: torch.Tensor, log_n: int) -> torch.Tensor:
    """fp32 importance (>= 0) with its low LOG_N bits replaced by ~pos, as a sortable int64."""
    mask = (1 << log_n) - 1
    bits = imp.contiguous().view(torch.int32).to(torch.int64)
    return (bits & ~mask) | (~pos & mask)


def htree_forward(q, k, v, compression_rate=16, top_k_per_layer=512, max_top_nodes=8192,
                  rope_base=10000.0, scale=None, return_selection=False, rows_per_tile=None, selection=None,
                  return_lse=False, node_dtype=None):
    """q [B,T,H,K], k [B,T,Hkv,K], v [B,T,Hkv,V] -> o [B,T,H,V] in q's dtype, differentiable in q, k and v through
    torch autograd (the selections are integers, hence constants of the gradient).

    ``return_selection``: also a list whose entry l-1 holds, for layer l >= 1, the nodes selected there (the
    parents expanded into layer l-1) [B,T,Hkv,top_k] int32, ascending, -1 padded.
    ``selection``: such a list, forced instead of the top-k (so that gradients of the compiled op and of the
    golden compare like with like where 16-bit near-ties flip); every row's entries must be distinct candidates of
    their layer, ascending, -1 padded at the end, and include the rightmost candidate (the node holding the query).
    ``return_lse``: also every query head's final log-sum-exp (natural log) over its merged candidates [B,T,H],
    fp32 (fp64 for fp64 inputs).
    ``node_dtype``: the dtype the tree (the tokens and the nodes above them) is stored in, q's dtype by default;
    e.g. fp32 leaves holding bf16 values with node_dtype=torch.bfloat16 give the bf16 forward's values with
    gradients accumulated in fp32.
    Returns o, then the selections, then lse, as requested."""
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[3]
    G, r, top_k = H // Hkv, compression_rate, top_k_per_layer
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    node_dtype = q.dtype if node_dtype is None else node_dtype
    qa = q.to(acc)
    layers = build_tree(round_straight_through(k.to(acc), node_dtype), round_straight_through(v.to(acc), node_dtype),
                        r, max_top_nodes, node_dtype)
    L = len(layers)
    if selection is not None:
        selection = _check_selection(selection, L, (B, T, Hkv, top_k))
    log_n = pack_bits(r, top_k, max_top_nodes)
    n_buf = max(layers[-1][0].shape[1], top_k * r)  # candidate buffer length of any layer
    cos, sin = rope_tables(K, n_buf, rope_base, acc, dev)
    if rows_per_tile is None:  # bounds the gathered candidates to ~2^24 elements per tile
        rows_per_tile = max(1, (1 << 24) // (n_buf * (K + V + 2 * G)))

    sel = [torch.full((B, T, Hkv, top_k), -1, dtype=torch.int32, device=dev) for _ in range(L - 1)]
    outs, lses = [], []
    for b in range(B):
        o_b, lse_b = [], []
        for h in range(Hkv):
            o_h, lse_h = [], []
            for t0 in range(0, T, rows_per_tile):
                t = torch.arange(t0, min(T, t0 + rows_per_tile), device=dev)
                qg = qa[b, t0:t0 + len(t), h * G:(h + 1) * G]  # [R, G, K]
                forced = None if selection is None else [s[b, t0:t0 + len(t), h] for s in selection]
                o, lse = _forward_rows(qg, t, [(lk[b, :, h], lv[b, :, h]) for lk, lv in layers], r, top_k,
                                       log_n, scale, cos, sin, [s[b, t0:t0 + len(t), h] for s in sel], forced)
                o_h.append(o)
                lse_h.append(lse)
            o_b.append(torch.cat(o_h))  # [T, G, V]
            lse_b.append(torch.cat(lse_h))
        outs.append(torch.stack(o_b, dim=1).reshape(T, H, V))
        lses.append(torch.stack(lse_b, dim=1).reshape(T, H))
    out = torch.stack(outs).to(q.dtype)
    result = (out,) + ((sel,) if return_selection else ()) + ((torch.stack(lses),) if return_lse else ())
    return result if len(result) > 1 else out


def _check_selection(selection, L: int, shape) -> list:
    """The forced selections as int64 tensors; a ValueError / TypeError naming what is wrong."""
    if not isinstance(selection, (list, tuple)) or len(selection) != L - 1:
        length = len(selection) if hasattr(selection, "__len__") else "?"
        raise ValueError(f"selection: expected a list of {L - 1} tensors (one per layer above the tokens), got "
                         f"{type(selection).__name__} of length {length}")
    out = []
    for i, s in enumerate(selection):
        if not isinstance(s, torch.Tensor) or s.dtype.is_floating_point or s.dtype == torch.bool:
            raise TypeError(f"selection[{i}]: expected an integer tensor")
        if tuple(s.shape) != tuple(shape):
            raise ValueError(f"selection[{i}]: expected shape {list(shape)}, got {list(s.shape)}")
        out.append(s.long())
    return out


def _forward_rows(qg, t, layers, r, top_k, log_n, scale, cos, sin, sel_out, forced=None):
    """All layers for R query rows of one (b, kv head); layers[l] = (K_l [N_l, K], V_l [N_l, V]). Returns the
    output [R, G, V] and the final log-sum-exp [R, G]. ``forced``: per layer l >= 1 the selected nodes [R, top_k]
    to use instead of the top-k."""
    R, G, _ = qg.shape
    acc, dev = qg.dtype, qg.device
    L = len(layers)
    m = torch.full((R, G), -math.inf, dtype=acc, device=dev)
    S = torch.zeros(R, G, dtype=acc, device=dev)
    U = torch.zeros(R, G, layers[0][1].shape[1], dtype=acc, device=dev)
    parents = None
    for l in range(L - 1, -1, -1):
        lk, lv = layers[l]
        rightmost = torch.div(t, r ** l, rounding_mode="floor")  # node containing t
        if parents is None:  # top layer: nodes 0..rightmost
            n = rightmost + 1
            pos = torch.arange(lk.shape[0], device=dev)
            node = pos.expand(R, -1)
        else:  # children of the selected parents, the rightmost parent cut at the rightmost child
            n = ((parents >= 0).sum(1) - 1) * r + rightmost % r + 1
            pos = torch.arange(parents.shape[1] * r, device=dev)
            node = parents[:, pos // r].clamp_min(0) * r + pos % r
        valid = pos[None, :] < n[:, None]
        node = torch.where(valid, node, 0)
        kr = apply_rope(lk[node].to(acc), cos[pos], sin[pos])  # [R, C, K]
        qr = apply_rope(qg, cos[n - 1][:, None], sin[n - 1][:, None])  # [R, G, K]
        s = scale * torch.einsum("rgk,rck->rgc", qr, kr)
        s = s.masked_fill(~valid[:, None, :], -math.inf)
        merge = valid
        if l > 0 and forced is not None:
            parents = forced[l - 1]
            win = _forced_winners(parents, node, valid, n, l)
            merge = valid & ~win
            sel_out[l - 1].copy_(parents)
        elif l > 0:
            p = torch.exp(s - torch.logsumexp(s, dim=2, keepdim=True)).detach().float()
            p = torch.where(p < torch.finfo(torch.float32).tiny, 0.0, p)
            imp = p.sum(dim=1)
            imp = torch.where(pos[None, :] == (n - 1)[:, None], RIGHTMOST_IMPORTANCE, imp)
            key = torch.where(valid, _pack_importance(imp, pos[None, :], log_n), -1)
            top = key.topk(min(top_k, key.shape[1]), dim=1)
            win = torch.zeros_like(valid).scatter_(1, top.indices, top.values >= 0)
            merge = valid & ~win
            chosen = torch.where(top.values >= 0, node.gather(1, top.indices), torch.iinfo(torch.int64).max)
            chosen = chosen.sort(dim=1).values
            parents = torch.full((R, top_k), -1, dtype=torch.int64, device=dev)
            parents[:, :chosen.shape[1]] = torch.where(chosen == torch.iinfo(torch.int64).max, -1, chosen)
            sel_out[l - 1].copy_(parents)
        s = s.masked_fill(~merge[:, None, :], -math.inf)
        # the running maximum is only a reference (the result does not depend on it): a constant of the gradient
        m_new = torch.maximum(m, s.amax(dim=2)).detach()
        ref = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing merged yet
        alpha = torch.exp(m - ref)
        p = torch.exp(s - ref[..., None])
        S = S * alpha + p.sum(dim=2)
        U = U * alpha[..., None] + torch.einsum("rgc,rcv->rgv", p, lv[node].to(acc))
        m = m_new
    return U / S[..., None], m + torch.log(S)


def _forced_winners(chosen, node, valid, n, l: int):
    """The candidates of a layer whose nodes are in the forced rows ``chosen`` [R, top_k] (-1 padded); checks that
    every row's entries are distinct candidates, ascending, padded at the end, and include the rightmost one."""
    present = chosen >= 0
    big = torch.iinfo(torch.int64).max
    keys = torch.where(present, chosen, big)
    if (present[:, 1:] & ~present[:, :-1]).any() or (keys[:, 1:] <= keys[:, :-1])[present[:, 1:]].any():
        raise ValueError(f"selection[{l - 1}]: expected every row ascending, distinct, -1 padded at the end")
    idx = torch.searchsorted(keys, node).clamp_max(chosen.shape[1] - 1)
    win = valid & (keys.gather(1, idx) == node)
    if (win.sum(1) != present.sum(1)).any():
        raise ValueError(f"selection[{l - 1}]: a selected node is not a candidate of its row at layer {l}")
    if not win.gather(1, (n - 1)[:, None]).all():
        raise ValueError(f"selection[{l - 1}]: every row must select its rightmost candidate (the node holding the "
                         "query) at layer {l}")
    return win
