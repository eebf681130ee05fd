"""Host side of the htree forward: the tree's layout, the RoPE tables, the packed keys' position bits, the
rightmost candidate's importance, the fp32 operands' TF32 halves, and the tree's construction on the GPU.

The golden (``golden.htree``) defines the same constants and tables for itself (it is the independent
reference); ``tests/test_htree.py`` checks that both agree."""

from __future__ import annotations

import math

import torch

RIGHTMOST_IMPORTANCE = 1e3  # the importance of a layer's rightmost candidate (the node holding the query)
MAX_LAYERS = 32  # r >= 2 and T < 2^31
MAX_BUFFER = 16384  # candidate buffer (packed keys live in shared memory)


def pack_bits(compression_rate: int, top_k_per_layer: int, max_top_nodes: int) -> int:
    """LOG_N: how many low bits of the fp32 importance carry the candidate's buffer position."""
    return int(math.log2(max(max_top_nodes, top_k_per_layer * compression_rate)))


def rope_tables(head_dim: int, num_positions: int, rope_base: float, dtype=torch.float32, device=None):
    """cos, sin [num_positions, head_dim // 2] for rotate-half RoPE, frequency base^(-2i/K)."""
    inv_freq = rope_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(num_positions, dtype=dtype, device=device), inv_freq.to(dtype))
    return angles.cos(), angles.sin()


def layer_sizes(seq_len: int, compression_rate: int, max_top_nodes: int) -> tuple[list[int], list[int]]:
    """(sizes, offs): N_l of every layer l = 0 .. L-1 (each the ceil of the one below over r, until the top
    layer has at most max_top_nodes nodes), and where each layer l >= 1 starts in the buffer of layers
    1 .. L-1 concatenated along the node axis (offs[0] = offs[1] = 0)."""
    sizes = [seq_len]
    while sizes[-1] > max_top_nodes:
        sizes.append(-(-sizes[-1] // compression_rate))
    offs = [0, 0]
    for s in sizes[1:-1]:
        offs.append(offs[-1] + s)
    return sizes, offs


def build_tree(pool, rope, k: torch.Tensor, v: torch.Tensor, compression_rate: int, max_top_nodes: int, cos, sin):
    """The layers above the tokens and the rotated top layer, with the compiled ``htree_pool`` (``pool``) and
    ``htree_rope`` (``rope``) kernels. Returns (nodes_k, nodes_v: layers 1 .. L-1 concatenated along the node
    axis, top: the top layer [B, Hkv, N_top, K] rotated at its buffer positions (layer 0 itself when
    T <= max_top_nodes), layer_off: [MAX_LAYERS] int32 on k's device, offs, sizes: ``layer_sizes``)."""
    B, T, Hkv, K = k.shape
    sizes, offs = layer_sizes(T, compression_rate, max_top_nodes)
    nn = max(1, sum(sizes[1:]))
    nodes_k = k.new_empty(B, nn, Hkv, K)
    nodes_v = v.new_empty(B, nn, Hkv, v.shape[3])
    for l in range(1, len(sizes)):
        src_k, src_v = (k, v) if l == 1 else (nodes_k, nodes_v)
        pool(src_k, src_v, nodes_k, nodes_v, 0 if l == 1 else offs[l - 1], sizes[l - 1], offs[l], sizes[l])
    layer_off = torch.zeros(MAX_LAYERS, dtype=torch.int32)
    layer_off[:len(sizes)] = torch.tensor(offs[:len(sizes)], dtype=torch.int32)
    top = k.new_empty(B, Hkv, sizes[-1], K)
    rope(k if len(sizes) == 1 else nodes_k, cos, sin, top, 0 if len(sizes) == 1 else offs[-1])
    return nodes_k, nodes_v, top, layer_off.to(k.device), offs, sizes


def split_tf32(x: torch.Tensor) -> torch.Tensor:
    """[2, *x.shape] fp32: x's TF32-exact high part and its remainder, as the bit patterns the kernels'
    TF32 operand stores write (CUTLASS's round_half_ulp_truncate adds half a TF32 ulp, 0x1000, to finite
    values and the tensor cores drop the low 13 bits), so products read them unchanged."""
    hi = (x.view(torch.int32) & -8192).view(torch.float32)
    halves = torch.stack([hi, x - hi])
    bits = halves.view(torch.int32)
    return torch.where(halves.isfinite(), bits + 0x1000, bits).view(torch.float32)


def positions_to_nodes(sel: torch.Tensor, compression_rate: int) -> torch.Tensor:
    """The selections as node ids: ``sel`` [L-1, ..., top_k] holds, for layer l = 1 .. L-1 (entry l - 1), the
    winners' candidate-buffer positions (ascending, -1 padded); the top layer's position is its node, below it
    position p is child p % r of the (p // r)-th winner one layer up. Returns int32 node ids, -1 padded."""
    out = torch.empty(sel.shape, dtype=torch.int32, device=sel.device)
    if sel.shape[0] == 0:
        return out
    r = compression_rate
    above = None
    for l in range(sel.shape[0] - 1, -1, -1):
        pos = sel[l].long()
        if above is None:
            nodes = pos
        else:
            nodes = above.gather(-1, torch.div(pos.clamp_min(0), r, rounding_mode="floor")) * r + pos.clamp_min(0) % r
        nodes = torch.where(pos >= 0, nodes, -1)
        out[l] = nodes
        above = nodes
    return out


def nodes_to_positions(nodes, compression_rate: int) -> torch.Tensor:
    """The inverse of ``positions_to_nodes``: node ids (a list of L - 1 tensors [..., top_k] or one stacked tensor,
    ascending, -1 padded, every winner a child of a winner one layer up) -> int16 positions [L-1, ..., top_k]."""
    nodes = torch.stack(list(nodes)) if isinstance(nodes, (list, tuple)) else nodes
    out = torch.empty(nodes.shape, dtype=torch.int16, device=nodes.device)
    r, big = compression_rate, torch.iinfo(torch.int64).max
    for l in range(nodes.shape[0]):
        node = nodes[l].long()
        if l == nodes.shape[0] - 1:
            pos = node
        else:
            above = nodes[l + 1].long()
            keys = torch.where(above >= 0, above, big)
            slot = torch.searchsorted(keys.contiguous(), torch.div(node.clamp_min(0), r, rounding_mode="floor")
                                      .contiguous())
            pos = slot * r + node.clamp_min(0) % r
        out[l] = torch.where(node >= 0, pos, -1).to(torch.int16)
    return out
