"""htree backward (``HTreeBackwardTileLang``): the gradient of the forward (``golden.htree``) with its selections held
constant, deterministic (no floating-point atomics).

The forward's output is one softmax over the merged candidates of all layers, so with P = exp(s - lse) (lse: the
forward's final log-sum-exp per query head), D = rowsum(dO * O) and dS = P (dO . v - D): dq = scale sum R_q^T dS
k_rot, and every merged candidate node gets dK += scale R_c^T dS q_rot, dV += P dO, with R_q the query's rotation at
its layer's position n - 1 and R_c the candidate's at its buffer position. A node above the tokens then passes its
dK, dV to its existing children, divided by their count. Kernels (``ops/htree/kernels/bwd_*.py``; the design and its
costs: docs/design/htree.md):
  - ``htree_pool_kernel`` / ``htree_rope_kernel`` (the forward's): the tree and the rotated top layer, rebuilt;
  - ``htree_bwd_delta_kernel``: D;
  - per slab of queries, from the slab's index structures (``bwd_index``: the selections as nodes, winner flags,
    candidate counts, and per layer below the top the lists parent -> queries that selected it):
    ``htree_bwd_top_dq_kernel`` (the top layer's part of dq, GEMMs over query blocks),
    ``htree_bwd_top_dkv_kernel`` (the top layer's dK, dV, GEMMs over node blocks),
    ``htree_bwd_rows_kernel`` (the lower layers' part of dq, one CTA per row; writes dq; r >= 16:
    ``htree_bwd_rows16_kernel`` (16-bit) or ``htree_bwd_rows32_kernel`` (fp32) from register fragments, with the
    lower layers' K rotated at their child index by the forward's ``htree_rope_kernel``),
    ``htree_bwd_nodes_kernel`` once per lower layer (its nodes' dK, dV, one CTA per parent's children; fp32 with
    r >= 16: ``htree_bwd_nodes32_kernel`` from register fragments);
  - ``htree_bwd_unpool_kernel``: the push-down from the top layer to the tokens, writing dk, dv.
Every accumulator element is written by one CTA per launch, in a fixed order, so dq, dk and dv are bitwise
reproducible.

Memory: fp32 accumulators for dK and dV of every layer, (T + sum_{l >= 1} N_l) x Hkv x (K + V) x 4 bytes per batch
row (~(K + V) x Hkv x 4.27 bytes per token at r = 16), D [B, T, H] fp32, the rebuilt tree (r >= 16: and
the lower layers' K rotated at the child index, ~k's size), and per slab of queries
the index structures (about 12 (L-1) Hkv top_k + (L-1) Hkv nbuf + 4 H K bytes per query, plus one layer's sort of
B S Hkv top_k pairs); the slab is sized so that these stay under 4 GiB (~10K queries at the bench's (b)).
"""

from __future__ import annotations

import math

import torch

from ..common.protocol import Op
from ..common.runtime import NO_WARP_SPECIALIZATION, WARP_OWN_SHARED, compile_kernels, resolve_config
from ..common.validate import check_bool, check_choice, check_tensor, check_values
from .bwd_index import parent_lists, slab_index
from .forward import set_spec
from .kernels.bwd_nodes import LIST_SLOT_BITS, children_tile, htree_bwd_nodes_kernel
from .kernels.bwd_nodes32 import htree_bwd_nodes32_kernel
from .kernels.bwd_rows import htree_bwd_rows_kernel
from .kernels.bwd_rows16 import htree_bwd_rows16_kernel, uses_rows16
from .kernels.bwd_rows32 import htree_bwd_rows32_kernel
from .kernels.bwd_common import FLAG_PAD, FP32_PRECISIONS, LN2, unrotate, uses_fp32_fragments
from .kernels.bwd_top import (htree_bwd_top_dkv_kernel, htree_bwd_top_dq_kernel, htree_bwd_top_rows_kernel,
                               operand_parts)
from .kernels.bwd_tree import htree_bwd_delta_kernel, htree_bwd_unpool_kernel
from .kernels.pool_rope import htree_pool_kernel, htree_rope_kernel
from .tree import build_tree, layer_sizes, pack_bits, rope_tables

_SMEM = 200 * 1024  # what the tile choices below let a CTA's operand tiles take
_SMEM_WS = 216 * 1024  # a warp-specialized top kernel's tiles (one CTA per SM)


def _operand_bytes(dtype: str, fp32_precision: str = "highest") -> int:
    """Shared bytes of one operand element: its planes (``operand_parts``) of 4 (fp32) or 2 bytes."""
    return operand_parts(dtype, fp32_precision) * (4 if dtype == "float32" else 2)


def top_operands(top_k: torch.Tensor, top_v: torch.Tensor, top_off: int, dtype: torch.dtype,
                 fp32_precision: str = "highest"):
    """The top layer's rotated K [B, Hkv, NT, K] and V (rows top_off .. top_off + NT - 1 of [B, NV, Hkv, V]) as
    [P, B, Hkv, NT, .] operand planes: fp32 at "highest" the TF32 high part, bitwise as the kernels' ``tf32_hi``,
    and the remainder; at "high" one plane rounded to TF32 as the kernels' ``tf32_round``. Not the forward's
    ``split_tf32``: the backward's operand tiles are fp32, stored as is and truncated by the products, where the
    forward's are TF32-typed, whose stores round (its +0x1000)."""
    nt = top_k.shape[2]
    v = top_v[:, top_off:top_off + nt].transpose(1, 2)
    if dtype != torch.float32:
        return top_k.unsqueeze(0), v.contiguous().unsqueeze(0)

    def bits(x):
        return x.contiguous().view(torch.int32)

    def planes(x):
        if fp32_precision != "highest":
            return ((bits(x) + 4096) & -8192).view(torch.float32).unsqueeze(0)
        hi = (bits(x) & -8192).view(torch.float32)
        return torch.stack((hi, x - hi))

    return planes(top_k), planes(v)


def _transposed(planes: torch.Tensor) -> torch.Tensor:
    """Operand planes [P, B, Hkv, rows, dims] as [P, B, Hkv, dims, rows'] (rows' padded to a multiple of 4: the TMA
    copies' 16-byte strides): the fp32 top dq kernel's B operand (a TF32 wgmma takes B K-major only)."""
    P, B, Hkv, n, d = planes.shape
    out = planes.new_zeros(P, B, Hkv, d, -(-n // 4) * 4)
    out[..., :n] = planes.transpose(-1, -2)
    return out


def top_dk_finish(acc_k: torch.Tensor, acc_off: int, num_nodes: int, cos: torch.Tensor, sin: torch.Tensor):
    """The top layer's accumulated dK rows (``htree_bwd_top_dkv_kernel``: the node's rotated frame, log2 domain)
    rotated back at the node's index and scaled by ln(2), in place."""
    a = acc_k[:, acc_off:acc_off + num_nodes]
    half = a.shape[-1] // 2
    c, s = cos[:num_nodes, None, :], sin[:num_nodes, None, :]
    x, y = a[..., :half].clone(), a[..., half:].clone()
    lo, hi = unrotate(x, y, c, s)
    a[..., :half] = lo * LN2
    a[..., half:] = hi * LN2


class HTreeBackwardTileLang(Op):
    """``op(do, q, k, v, o, lse, selections, validate=True) -> (dq, dk, dv)`` in the inputs' dtype: the gradient of
    ``HTreeForwardTileLang`` (same specification arguments) at (q, k, v) for the output gradient do [B, T, H, V],
    given what ``HTreeForwardTileLang.forward_for_backward`` returns: o [B, T, H, V], lse [B, T, H] fp32 and the
    selections [L-1, B, T, Hkv, top_k] int16 (the winners' candidate-buffer positions). ``validate`` checks the
    selections' values against the forward's rules (one host sync per slab of queries); False skips that.
    Deterministic: the same inputs give bitwise the same gradients. ``fp32_precision`` (fp32 inputs only, torch's
    names): "highest" multiplies split-TF32 halves (three TF32 products, close to fp32 accuracy), "high" operands
    rounded to TF32 (one product: fp16's 10-bit mantissa, as torch's matmuls at that precision and Triton's default
    fp32 dot). The differentiable functional form: ``ops.htree.htree_attention``, which follows
    ``torch.get_float32_matmul_precision()``."""

    op_name = "htree_bwd"
    warm_specs = (
        dict(num_heads=64, num_kv_heads=4, head_dim=32, dtype=torch.float32),
        dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
    )
    _SLAB_BYTES = 1 << 32  # the per-slab index structures and workspaces

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        """Tile sizes from a shared-memory model (the largest that fit, see ``_SMEM``):
        the top layer's rows and nodes per block and pipeline stages (both products), the rows kernel's chunk, the
        nodes kernel's rows per block."""
        K, V, e = spec["head_dim"], spec["v_head_dim"], _operand_bytes(spec["dtype"], spec["fp32_precision"])
        # the top layer's two products: a row (dq) or node (dK/dV) tile, the other side streamed through a software
        # pipeline; 16-bit: two consumer warpgroups beside a producer (TMA, two stages), fp32: one warpgroup that
        # copies and computes, two CTAs per SM
        def dq_bytes(bm, bn, stages):  # q, dO, the node stages, dS, the fp32 result
            return (bm + stages * bn) * (K + V) * e + bm * bn * e + 4 * bm * K

        def dkv_bytes(bn, bm, stages):  # K, V, the row stages, P and dS
            return (bn + stages * bm) * (K + V) * e + 2 * bn * bm * e

        if e == 2 and dq_bytes(128, 64, 2) <= _SMEM_WS and dkv_bytes(128, 64, 2) <= _SMEM_WS:
            top = dict(top_dq_block_m=128, top_dq_block_n=64, top_dkv_block_n=128, top_dkv_block_m=64, top_stages=2,
                       top_threads=256)
        else:
            bm, bn = next(((bm, bn) for bm, bn in ((64, 64), (64, 32), (32, 32), (32, 16))
                           if max(dq_bytes(bm, bn, 1), dkv_bytes(bn, bm, 1)) <= _SMEM // 2), (16, 16))
            top = dict(top_dq_block_m=bm, top_dq_block_n=bn, top_dkv_block_n=bn, top_dkv_block_m=bm, top_stages=1,
                       top_threads=128)
            if spec["dtype"] == "float32":
                # dq on TF32 warpgroup products: one 64-row warpgroup tile, the top layer's K also transposed
                top["top_dq_block_m"] = 64
                top["top_dq_block_n"] = next((n for n in (64, 32) if dq_bytes(64, n, 1) + K * n * e <= _SMEM // 2), 16)
        rows = next((bn for bn in (64, 32) if ((16 + bn) * (K + V) + 16 * bn) * e + 8 * 16 * K <= _SMEM // 2), 32)
        ct = children_tile(spec["compression_rate"])
        # The nodes kernel's rows are staged twice: as gathered (the pipeline's copy) and as operands. 32 rows
        # per block, not the 64 that fit: more CTAs per SM overlap one block's gathers with another's products
        # (H200: 4-5% faster at (a) and (b) 131072 than 64, see docs/design/htree.md).
        nodes = next(bm for bm in (32, 16)
                     if ((ct + 2 * bm) * (K + V) + 2 * ct * bm) * e + 4 * ct * K + 28 * bm <= _SMEM)
        return {**top, "rows_block_n": rows, "nodes_block_m": nodes}

    def __init__(self, num_heads, num_kv_heads, head_dim, v_head_dim=None, compression_rate=16,
                 top_k_per_layer=512, max_top_nodes=8192, rope_base=10000.0, dtype=torch.bfloat16,
                 scale=None, fp32_precision="highest", config=None):
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        tl_dtype = set_spec(self, num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate, top_k_per_layer,
                            max_top_nodes, rope_base, dtype, scale)
        check_choice("fp32_precision", fp32_precision, FP32_PRECISIONS)
        self.fp32_precision = fp32_precision
        self.spec = {**self.spec, "fp32_precision": fp32_precision}
        prec = dict(fp32_precision=fp32_precision)
        self.nbuf = 1 << pack_bits(compression_rate, top_k_per_layer, max_top_nodes)
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(self.spec))
        c = self.config
        H, Hkv, K, V, r = num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate
        # r >= 16 (fp32: K, V <= 64, G <= 16): the rows and nodes kernels' products from register fragments, the
        # rows kernel's K rotated at the child index (the forward's htree_rope_kernel with period r)
        fp32_frag = uses_fp32_fragments(tl_dtype, K, V, H // Hkv, r)
        if uses_rows16(tl_dtype, r):
            rows = htree_bwd_rows16_kernel(H, Hkv, K, V, r, top_k_per_layer, self.scale, tl_dtype)
        elif fp32_frag:
            rows = (htree_bwd_rows32_kernel(H, Hkv, K, V, r, top_k_per_layer, self.scale, **prec), WARP_OWN_SHARED)
        else:
            rows = htree_bwd_rows_kernel(H, Hkv, K, V, r, top_k_per_layer, max_top_nodes, self.scale, tl_dtype,
                                         block_n=c["rows_block_n"], **prec)
        child_frame = uses_rows16(tl_dtype, r) or fp32_frag
        nodes = ((htree_bwd_nodes32_kernel(H, Hkv, K, V, r, top_k_per_layer, self.scale, **prec), WARP_OWN_SHARED)
                 if fp32_frag else
                 htree_bwd_nodes_kernel(H, Hkv, K, V, r, top_k_per_layer, self.scale, tl_dtype,
                                        block_m=c["nodes_block_m"], **prec))
        top = dict(num_stages=c["top_stages"], threads=c["top_threads"], **prec)
        # more than one stage runs warp-specialized (TileLang 0.1.15 builds no multi-stage pipeline with a dynamic
        # trip count without it), one stage with every warp computing
        top_cfg = None if c["top_stages"] > 1 else NO_WARP_SPECIALIZATION
        (self.pool, self.rope, self.delta, self.top_rows, self.top_dq, self.top_dkv, self.rows, self.nodes,
         self.unpool, self.unpool_out, *rope_child) = compile_kernels(
            htree_pool_kernel(Hkv, K, V, r, tl_dtype),
            htree_rope_kernel(Hkv, K, tl_dtype),
            htree_bwd_delta_kernel(H, V, tl_dtype),
            htree_bwd_top_rows_kernel(H, Hkv, K, V, self.scale, tl_dtype, **prec),
            (htree_bwd_top_dq_kernel(H, Hkv, K, V, self.scale, tl_dtype, block_m=c["top_dq_block_m"],
                                     block_n=c["top_dq_block_n"], **top), top_cfg),
            (htree_bwd_top_dkv_kernel(H, Hkv, K, V, tl_dtype, block_m=c["top_dkv_block_m"],
                                      block_n=c["top_dkv_block_n"], **top), top_cfg),
            rows,
            nodes,
            htree_bwd_unpool_kernel(Hkv, K, V, r, tl_dtype, final=False),
            htree_bwd_unpool_kernel(Hkv, K, V, r, tl_dtype, final=True),
            *([htree_rope_kernel(Hkv, K, tl_dtype, period=r)] if child_frame else []))
        self.rope_child = rope_child[0] if rope_child else None
        self._tables = {}

    # ----------------------------------------------------------------------------- call
    def _rope(self, device):
        if device not in self._tables:
            self._tables[device] = rope_tables(self.head_dim, self.nbuf, self.rope_base, torch.float32, device)
        return self._tables[device]

    def _check(self, do, q, k, v, o, lse, selections):
        if isinstance(q, torch.Tensor) and q.dim() == 4 and 0 in q.shape[:2]:
            raise ValueError(f"q: expected B >= 1 and T >= 1, got shape {list(q.shape)}")
        H, Hkv, K, V = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        check_tensor("q", q, self.dtype, (None, None, H, K))
        B, T = q.shape[:2]
        check_tensor("k", k, self.dtype, (B, T, Hkv, K), q.device)
        check_tensor("v", v, self.dtype, (B, T, Hkv, V), q.device)
        check_tensor("do", do, self.dtype, (B, T, H, V), q.device)
        check_tensor("o", o, self.dtype, (B, T, H, V), q.device)
        check_tensor("lse", lse, torch.float32, (B, T, H), q.device)
        L = len(layer_sizes(T, self.compression_rate, self.max_top_nodes)[0])
        check_tensor("selections", selections, torch.int16, (L - 1, B, T, Hkv, self.top_k_per_layer), q.device)

    def _slab_rows(self, B: int, L: int) -> int:
        """Queries per slab: the index structures and workspaces of one slab stay under _SLAB_BYTES."""
        Hkv, top_k = self.num_kv_heads, self.top_k_per_layer
        H, K, V = self.num_heads, self.head_dim, self.v_head_dim
        # the top kernels' staged rows
        rows = H * ((K + V) * _operand_bytes(self.spec["dtype"], self.fp32_precision) + 8)
        per_row = B * ((L - 1) * Hkv * (top_k * 12 + self.nbuf + FLAG_PAD) + 40 * Hkv * top_k + 4 * H * K + rows)
        return max(64, min(self._SLAB_BYTES // per_row, (1 << (31 - LIST_SLOT_BITS)) - 1) // 64 * 64)

    def __call__(self, do, q, k, v, o, lse, selections, validate=True):
        check_bool("validate", validate)
        self._check(do, q, k, v, o, lse, selections)
        B, T = q.shape[:2]
        H, Hkv, K, V, r = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim, self.compression_rate
        top_k_sel, nbuf = self.top_k_per_layer, self.nbuf
        dev = q.device
        cos, sin = self._rope(dev)
        nodes_k, nodes_v, top, layer_off, offs, sizes = build_tree(self.pool, self.rope, k, v, r, self.max_top_nodes,
                                                                   cos, sin)
        L = len(sizes)
        f32 = dict(dtype=torch.float32, device=dev)
        dl = torch.empty(B, T, H, **f32)
        self.delta(do, o, dl)
        # fp32 accumulators of dK, dV: layer 0 at rows [0, T), layer l >= 1 at T + offs[l]
        acc_off = [0] + [T + offs[l] for l in range(1, L)]
        n_all = T + sum(sizes[1:])
        acc_k = torch.zeros(B, n_all, Hkv, K, **f32)
        acc_v = torch.zeros(B, n_all, Hkv, V, **f32)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        shift = (L - 1) * int(math.log2(r))
        top_v, top_off = (nodes_v, offs[-1]) if L > 1 else (v, 0)
        rows_k = self._rows_keys(k, nodes_k, cos, sin, offs, sizes)
        top_ks, top_vs = top_operands(top, top_v, top_off, self.dtype, self.fp32_precision)
        top_kt = _transposed(top_ks) if self.dtype == torch.float32 else top_ks.new_zeros(1, 1, 1, 1, 1)
        slab = self._slab_rows(B, L)
        P, G = operand_parts(self.spec["dtype"], self.fp32_precision), H // Hkv
        for t0 in range(0, T, slab):
            S = min(slab, T - t0)
            if L > 1:
                idx = slab_index(selections[:, :, t0:t0 + S], t0, r, top_k_sel, nbuf, checks=validate)
                if validate:
                    check_values(idx.checks)
                par, ncand, flags = idx.par, idx.ncand, idx.flags
                flags_top = flags[L - 2]
            else:  # one layer: no selections (one-row placeholders)
                par = torch.zeros(1, 1, 1, Hkv, top_k_sel, dtype=torch.int32, device=dev)
                ncand = torch.zeros(1, 1, 1, Hkv, dtype=torch.int32, device=dev)
                flags = torch.zeros(1, 1, 1, Hkv, FLAG_PAD, dtype=torch.int8, device=dev)
                flags_top = flags[0]
            q_rows = q.new_empty(P, B, Hkv, S * G, K)
            do_rows = q.new_empty(P, B, Hkv, S * G, V)
            rp = -(-S * G // 4) * 4  # 16-byte strides for the TMA copies
            lse_rows, dl_rows = torch.empty(B, Hkv, rp, **f32), torch.empty(B, Hkv, rp, **f32)
            self.top_rows(q, do, lse, dl, cos, sin, q_rows, do_rows, lse_rows, dl_rows, shift, t0)
            dq_top = torch.empty(B, S, H, K, **f32)
            self.top_dq(q_rows, do_rows, lse_rows, dl_rows, top_ks, top_vs, top_kt, cos, sin, flags_top, dq_top, shift,
                        t0, int(L > 1))
            self.top_dkv(q_rows, do_rows, lse_rows, dl_rows, top_ks, top_vs, flags_top, acc_k, acc_v, shift,
                         acc_off[-1], t0, int(L > 1))
            del q_rows, do_rows, lse_rows, dl_rows
            self.rows(q, do, rows_k[0], v, rows_k[1], nodes_v, cos, sin, lse, dl, par, ncand, flags, layer_off, dq_top,
                      dq, L - 1, t0)
            for l in range(L - 2, -1, -1):  # the nodes of layer l, children of the parents at l + 1
                start, entries = parent_lists(par[l], sizes[l + 1])
                self.nodes(q, do, k, v, nodes_k, nodes_v, cos, sin, lse, dl, ncand, flags, start, entries, layer_off,
                           acc_k, acc_v, sizes[l], l, acc_off[l], t0)
        top_dk_finish(acc_k, acc_off[-1], sizes[-1], cos, sin)
        for l in range(L - 1, 1, -1):  # the mean pooling's gradient, down to layer 1
            self.unpool(acc_k, acc_v, acc_off[l - 1], sizes[l - 1], acc_off[l])
        self.unpool_out(acc_k, acc_v, dk, dv, acc_off[1] if L > 1 else 0, int(L > 1))
        return dq, dk, dv

    def _rows_keys(self, k, nodes_k, cos, sin, offs, sizes):
        """The rows kernel's K of the tokens and of the nodes below the top (at their offs): as they are, or (the
        fragment kernels, r >= 16) rotated at their child index, [B, Hkv, nodes, K] (a one-row placeholder without
        middle layers)."""
        if self.rope_child is None:
            return k, nodes_k
        B, T, Hkv, K = k.shape
        rot = []
        for l in range(max(len(sizes) - 1, 1)):
            rot.append(k.new_empty(B, Hkv, sizes[l], K))
            self.rope_child(k if l == 0 else nodes_k, cos, sin, rot[l], offs[l])
        return rot[0], torch.cat(rot[1:], dim=2) if len(rot) > 1 else k.new_empty(B, Hkv, 1, K)

    def kernels(self) -> dict:
        """The compiled kernels by name (for compile-only tests and the bench's accounting)."""
        names = {"pool": self.pool, "rope": self.rope, "delta": self.delta, "top_rows": self.top_rows,
                 "top_dq": self.top_dq, "top_dkv": self.top_dkv, "rows": self.rows, "nodes": self.nodes,
                 "unpool": self.unpool, "unpool_out": self.unpool_out}
        if self.rope_child is not None:
            names["rope_child"] = self.rope_child
        return names

