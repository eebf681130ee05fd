"""htree forward (``HTreeForwardTileLang``): hierarchical tree sparse attention, defined by ``golden.htree``.

Kernels (``ops/htree/kernels``; the design and its measurements: docs/design/htree.md):
  - ``htree_pool_kernel`` builds one tree layer (mean of each node's existing children), once per layer;
    ``htree_rope_kernel`` rotates the top layer's K once (its candidates are the same nodes at the same buffer
    positions for every query), so the top-layer kernels read them as contiguous rows;
  - the top layer (for L > 1) by GEMMs over blocks of queries: ``htree_top_lse_kernel`` (every query head's
    log-sum-exp over it), ``htree_top_keys_kernel`` (every query's packed importance keys) and, after the walk,
    ``htree_top_merge_kernel`` (the top layer's non-winners merged, O written);
  - ``htree_fwd_kernel``, the walk: one CTA per (b, t, kv head) row selects the top layer's top-k from its keys
    and goes on down every lower layer, fused, so the selected parents of a layer live in shared memory;
  - ``htree_layer0_kernel`` (fp32 with K, V in {32, 64}): layer 0 of the walk's rows, from the parents the walk
    hands over; ``htree_layer16_kernel`` (fp16 / bf16 with r >= 16): the same for layer 0 and, one launch per
    layer, every middle layer 0 < l < L - 1 (the walk then stops after the top layer's selection). Without the
    walk's shared tiles they run more CTAs per SM, and their operands go from the gathers straight into
    mma.sync register fragments. Other cases stay in the walk.

fp32 inputs use split-TF32 products (hi*hi + hi*lo + lo*hi), close to fp32 accuracy so selections match
an fp32 reference; fp16/bf16 inputs use one 16-bit product with fp32 accumulation.

Memory: the tree above layer 0, sum_{l>=1} N_l ~ T / (r - 1) nodes of K and V per (batch, kv head) in
the input dtype, the rotated top layer (<= max_top_nodes rows of K per (batch, kv head); fp32 also its K
and V in TF32 halves, 2 (K + V) x 4 bytes per node), RoPE tables of
max(max_top_nodes, top_k * r) x K/2 fp32 pairs and the top layer's lse [B, T, H] fp32. The queries go
through the top-layer kernels and the walk in slabs, sized so that a slab's packed keys
[B, slab, Hkv, N_top] int32 take at most 256 MiB; per slab also the walk's state [B, slab, H, V + 2]
fp32, and for the layer kernels the parents [B, slab, Hkv, top_k] int32; the 16-bit layer kernel also takes
rotated copies of k ([B, Hkv, T, K], k's size) and of the middle layers' K nodes, and with L > 2 a scratch of
scores [B, slab, Hkv, G, max(max_top_nodes, top_k * r)] fp32, at most 1 GiB (the slab shrinks to fit).
Nothing else scales with T x candidates; the output and, on request, the selections [L-1, B, T, Hkv, top_k]
int32; with ``return_lse`` / ``forward_for_backward`` (the ``for_backward`` kernel variants) the final lse [B, T, H]
fp32 and the selections as int16 positions [L-1, B, T, Hkv, top_k] instead.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ..common.protocol import Op
from ..common.runtime import compile_kernels, resolve_config
from ..common.hw import LOG2E
from ..common.validate import check_bool, check_choice, check_float, check_int, check_scale, check_tensor, dtype_name
from .kernels.fragments import uses_layer_kernels
from .kernels.layer0 import htree_layer0_kernel
from .kernels.layer16 import htree_layer16_kernel
from .kernels.pool_rope import htree_pool_kernel, htree_rope_kernel
from .kernels.top import htree_top_keys_kernel, htree_top_lse_kernel, htree_top_merge_kernel
from .kernels.walk import htree_fwd_kernel
from .tree import MAX_BUFFER, build_tree, pack_bits, positions_to_nodes, rope_tables, split_tf32

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LN2 = 1.0 / LOG2E
WALK_KEYS = ("block_n", "threads", "min_blocks", "chunk_rope")  # the config keys htree_fwd_kernel takes

# Nodes per chunk of each top-layer kernel, for fp32 (True) and 16-bit inputs: smaller chunks let more CTAs
# share an SM (an fp32 chunk takes 4x the shared memory of a 16-bit one: TF32 halves), larger ones
# amortize the per-chunk work. Same-process H100 A/Bs of 64 vs 32 (ms): fp32 (a) lse 42.0 / 38.5, keys
# 44.9 / 51.2, merge 127.4 / 110.0 (3 CTAs per SM instead of 2); bf16 (b) 128K lse 21.4 / 18.7, keys
# 36.3 / 25.5, merge 51.3 / 61.9.
_TOP_CHUNK = {True: dict(lse=32, keys=64, merge=32), False: dict(lse=32, keys=32, merge=64)}


def set_spec(op, num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate, top_k_per_layer, max_top_nodes,
             rope_base, dtype, scale) -> str:
    """Check the htree specification and set it on ``op`` (forward and backward alike): its attributes and
    ``op.spec``, which is the walk's builder arguments (``tunable_kernel(spec)(**spec, **walk config)``). Returns
    the TileLang dtype name."""
    check_int("num_heads", num_heads, lo=1)
    check_int("num_kv_heads", num_kv_heads, lo=1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}")
    check_int("num_heads // num_kv_heads", num_heads // num_kv_heads, hi=16)
    check_int("head_dim", head_dim, multiple_of=2)
    check_choice("head_dim", head_dim, (32, 64, 128))
    check_int("v_head_dim", v_head_dim)
    check_choice("v_head_dim", v_head_dim, (32, 64, 128))
    check_int("compression_rate", compression_rate, lo=2, power_of_two=True)
    check_int("top_k_per_layer", top_k_per_layer, lo=1, power_of_two=True)
    check_int("max_top_nodes", max_top_nodes, lo=1, power_of_two=True)
    check_int("max(max_top_nodes, top_k_per_layer * compression_rate)",
              max(max_top_nodes, top_k_per_layer * compression_rate), hi=MAX_BUFFER)
    op.rope_base = check_float("rope_base", rope_base, positive=True)
    op.scale = check_scale(scale, head_dim)
    tl_dtype = dtype_name(dtype, DTYPES)
    op.num_heads, op.num_kv_heads = num_heads, num_kv_heads
    op.head_dim, op.v_head_dim = head_dim, v_head_dim
    op.compression_rate, op.top_k_per_layer, op.max_top_nodes = compression_rate, top_k_per_layer, max_top_nodes
    op.dtype = dtype
    op.spec = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "v_head_dim": v_head_dim,
               "compression_rate": compression_rate, "top_k_per_layer": top_k_per_layer,
               "max_top_nodes": max_top_nodes, "scale": op.scale, "dtype": tl_dtype}
    return tl_dtype


class HTreeForwardTileLang(Op):
    """``op(q, k, v, return_selection=False, out=None, return_lse=False)``: q [B,T,H,K], k [B,T,Hkv,K], v [B,T,Hkv,V]
    -> o [B,T,H,V] (q's dtype); with ``return_selection`` also the list of layer l >= 1 selections (entry l-1),
    [B,T,Hkv,top_k] int32 ascending, -1 padded; with ``return_lse`` also the final log-sum-exp (natural log) per
    query head [B,T,H] fp32. Built for one specialization (heads, head dims, tree parameters, scale, dtype); any B
    and T. See the module docstring for the memory needed. ``forward_for_backward`` returns what
    ``HTreeBackwardTileLang`` takes.

    16-bit selections: the 16-bit kernels score with one 16-bit product (fp32 accumulation) from 16-bit rotated
    operands, so near-ties can select differently from the golden's fp32 scores on the same inputs (a row that
    differs has an O(1) different output). ``tests/test_htree_bwd_gpu.py::test_16bit_selection_agreement`` measures
    the agreeing fraction of (token, kv head) rows at 3 layers over three shapes and asserts >= 95% (bf16) / 99%
    (fp16); the golden with 16-bit rotated operands (the kernels' rounding) agrees on 97.3-99.5% (bf16) and
    99.68-99.93% (fp16) there, lowest where most candidates compete (top_k 16 of ~190). fp32 (split TF32) agrees on
    >= 99.9% of rows.

    The functional form, a ``torch.library`` custom op: ``ops.htree.htree_attention``."""

    op_name = "htree"
    warm_specs = (
        # the bench rows: (a) the seed's speed-test configuration, fp32; (b) bf16 long context
        dict(num_heads=64, num_kv_heads=4, head_dim=32, dtype=torch.float32),
        dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16),
        # the demo's cases (3 layers in fp32, 2 in bf16)
        dict(num_heads=32, num_kv_heads=2, head_dim=64, v_head_dim=32, compression_rate=8, top_k_per_layer=16,
             max_top_nodes=64, dtype=torch.float32),
        dict(num_heads=2, num_kv_heads=2, head_dim=128, v_head_dim=128, compression_rate=16, top_k_per_layer=32,
             max_top_nodes=512, dtype=torch.bfloat16),
    )
    _KEYS_BYTES = 1 << 28  # the top layer's packed keys of one slab of queries
    _SCRATCH_BYTES = 1 << 30  # a middle layer's scores of one slab (16-bit, r >= 16)

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        """The walk's (``htree_fwd_kernel``) block_n, threads, min_blocks, chunk_rope, and the layer kernels'
        tiles0, min_blocks0.

        A chunk's gathers sit in registers (96 per thread at K = 128, bf16, block_n = 64: 2 CTAs per SM and
        spills), so K > 32 takes chunks of 32 and 3 CTAs per SM (H200, (b) T=32768: 434 vs 600 ms); at
        K = 32 (fp32: ~32 registers, 72 KB of shared memory) chunks of 64 fit 3 CTAs per SM. chunk_rope
        (16-bit only) measured 2-9% faster (H100, (b) T=32768 382 -> 349 ms, 131072 1816 -> 1781 ms).
        tiles0, min_blocks0: the layer kernels' 8-candidate tiles per warp step (fp32 only) and CTAs per SM: fp32
        measured at (a) (2 and 4: 127 registers, no spills), 16-bit at (b) (3: 166 registers, no spills; 4
        spills). Not in the autotuned space (``config_space`` tunes the walk)."""
        if spec["head_dim"] <= 32:
            return {"block_n": 64, "threads": 128, "min_blocks": 3, "chunk_rope": True, "tiles0": 2, "min_blocks0": 4}
        return {"block_n": 32, "threads": 128, "min_blocks": 3, "chunk_rope": True, "tiles0": 2, "min_blocks0": 3}

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        """The walk's configs (``tunable_kernel``; the layer kernels' tiles0 / min_blocks0 keep their defaults)."""
        return [{"block_n": bn, "threads": 128, "min_blocks": mb, "chunk_rope": True}
                for bn in (32, 64, 128) for mb in (2, 3, 4)]

    @classmethod
    def tunable_kernel(cls, spec: dict):
        """The walk, ``htree_fwd_kernel(**spec, **config)`` for a config of ``config_space``."""
        return htree_fwd_kernel

    def __init__(self, num_heads, num_kv_heads, head_dim, v_head_dim=None, compression_rate=16,
                 top_k_per_layer=512, max_top_nodes=8192, rope_base=10000.0, dtype=torch.bfloat16,
                 scale=None, config=None):
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        tl_dtype = set_spec(self, num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate, top_k_per_layer,
                            max_top_nodes, rope_base, dtype, scale)
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(self.spec))
        chunk = _TOP_CHUNK[dtype == torch.float32]
        walk = {key: value for key, value in self.config.items() if key in WALK_KEYS}
        funcs = [htree_pool_kernel(num_kv_heads, head_dim, v_head_dim, compression_rate, tl_dtype),
                 htree_rope_kernel(num_kv_heads, head_dim, tl_dtype),
                 htree_top_lse_kernel(num_heads, num_kv_heads, head_dim, self.scale, tl_dtype, block_n=chunk["lse"]),
                 htree_top_keys_kernel(num_heads, num_kv_heads, head_dim, compression_rate, top_k_per_layer,
                                       max_top_nodes, self.scale, tl_dtype, block_n=chunk["keys"]),
                 htree_top_merge_kernel(num_heads, num_kv_heads, head_dim, v_head_dim, self.scale, tl_dtype,
                                        block_n=chunk["merge"]),
                 htree_fwd_kernel(**self.spec, **walk)]
        self.layer0 = self.middle = self.rope0 = None
        layered = uses_layer_kernels(tl_dtype, head_dim, v_head_dim, num_heads // num_kv_heads, compression_rate)
        if layered:
            shape = (num_heads, num_kv_heads, head_dim, v_head_dim, compression_rate, top_k_per_layer, max_top_nodes,
                     self.scale)
            if dtype == torch.float32:
                funcs.append(htree_layer0_kernel(*shape, tiles0=self.config["tiles0"],
                                                 min_blocks=self.config["min_blocks0"]))
            else:  # the nodes below the top pre-rotated at their child index
                funcs += [htree_rope_kernel(num_kv_heads, head_dim, tl_dtype, period=compression_rate)] + [
                    htree_layer16_kernel(*shape, tl_dtype, middle=middle, min_blocks=self.config["min_blocks0"])
                    for middle in (False, True)]
        self.pool, self.rope, self.top_lse, self.top_keys, self.top_merge, self.kernel, *layers = \
            compile_kernels(*funcs)
        if layered and dtype == torch.float32:
            (self.layer0,) = layers
        elif layered:
            self.rope0, self.layer0, self.middle = layers
        self._tables = {}
        self._saved = None  # the differentiable forward's kernel variants (_saved_kernels)

    # ----------------------------------------------------------------------------- call
    def __call__(self, q, k, v, return_selection=False, out=None, return_lse=False):
        """o, with ``return_selection`` also the selections (list of L - 1 [B, T, Hkv, top_k] int32 node ids), with
        ``return_lse`` also every query head's final log-sum-exp (natural log) [B, T, H] fp32, in that order."""
        check_bool("return_selection", return_selection)
        check_bool("return_lse", return_lse)
        self._check(q, k, v, out)
        if not return_lse:
            run = self._run(q, k, v, out, return_selection, saved=False)
            if not return_selection:
                return run.out
            return run.out, list(run.sel.unbind(0)) if run.write_sel else []
        run = self._run(q, k, v, out, return_selection, saved=True)
        if not return_selection:
            return run.out, run.lse_out
        sel = positions_to_nodes(run.sel, self.compression_rate) if run.write_sel else None
        return run.out, list(sel.unbind(0)) if sel is not None else [], run.lse_out

    def forward_for_backward(self, q, k, v, out=None):
        """(o, lse, selections): what the differentiable forward keeps for ``HTreeBackwardTileLang`` besides q, k, v:
        o [B, T, H, V] in q's dtype, lse [B, T, H] fp32 (natural log), and the selections as the winners'
        candidate-buffer positions [L - 1, B, T, Hkv, top_k] int16, ascending, -1 padded (a position is below
        max(max_top_nodes, top_k * r) <= 16384 whatever T; the nodes follow from them: ``tree.positions_to_nodes``).
        Bytes kept per token beyond q, k, v: H * V * q.element_size() + 4 * H + 2 * (L - 1) * Hkv * top_k (at the
        bench's (b), 1M tokens, L = 3: 8192 + 128 + 16384)."""
        self._check(q, k, v, out)
        run = self._run(q, k, v, out, True, saved=True)
        sel = run.sel if run.write_sel else run.sel.new_empty((0,) + tuple(q.shape[:2]) + tuple(run.sel.shape[-2:]))
        return run.out, run.lse_out, sel

    def _saved_kernels(self):
        """The kernels the differentiable forward runs instead of the defaults (``for_backward`` variants: int16
        positions into Sel, the final lse), built on first use."""
        if self._saved is None:
            tl_dtype, chunk = self.spec["dtype"], _TOP_CHUNK[self.dtype == torch.float32]
            walk = {key: value for key, value in self.config.items() if key in WALK_KEYS}
            funcs = [htree_fwd_kernel(**self.spec, **walk, for_backward=True),
                     htree_top_merge_kernel(self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim,
                                            self.scale, tl_dtype, block_n=chunk["merge"], for_backward=True)]
            if self.middle is not None:
                funcs.append(htree_layer16_kernel(
                    self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim, self.compression_rate,
                    self.top_k_per_layer, self.max_top_nodes, self.scale, tl_dtype, middle=True,
                    min_blocks=self.config["min_blocks0"], for_backward=True))
            kernel, top_merge, *middle = compile_kernels(*funcs)
            kernels = SimpleNamespace(kernel=kernel, top_merge=top_merge, middle=middle[0] if middle else None)
            self._saved = kernels
        return self._saved

    def _run(self, q, k, v, out, return_selection, saved):
        """One call's launches; ``saved``: the for_backward variants (int16 positions, lse_out set)."""
        kern = self._saved_kernels() if saved else self
        run = self._prepare(q, k, v, out, return_selection, saved)
        if run.L == 1:  # one layer: the walk merges everything and writes O (no top-layer workspaces)
            args = self._one_layer_args(run)
            kern.kernel(*args)
            if saved:  # the rows' (m, S) in the walk's PartML (log2 domain)
                part_ml = args[13]
                run.lse_out = (part_ml[..., 0] + part_ml[..., 1].log2()) * LN2
            return run
        # htree_layer16_kernel at layer 0 never writes selections: an int32 placeholder where Sel is int16
        sel0 = torch.empty(1, 1, 1, self.num_kv_heads, self.top_k_per_layer, dtype=torch.int32, device=q.device) \
            if saved and self.rope0 is not None else run.sel
        for t0 in range(0, q.shape[1], run.slab):
            s = self._slab(run, t0)
            kern.kernel(*s.walk_args)
            for l in range(run.l_lo, 0, -1):
                kern.middle(q, run.rot[l], run.nodes_v, run.cos, run.sin, s.par, s.n0, s.part_o, s.part_ml, s.scr,
                            run.sel, t0, run.offs[l], l, int(run.write_sel))
            if self.rope0 is not None:
                self.layer0(q, run.rot[0], v, run.cos, run.sin, s.par, s.n0, s.part_o, s.part_ml, s.scr, sel0, t0,
                            0, 0, 0)
            elif self.layer0 is not None:
                self.layer0(q, k, v, run.cos, run.sin, s.par, s.n0, s.part_o, s.part_ml, t0)
            kern.top_merge(q, run.top_k, run.top_v, run.cos, run.sin, run.lse, s.keys, s.thr, s.part_o, s.part_ml,
                           run.out, run.shift, t0, run.top_off)
        if saved:  # htree_top_merge_kernel replaced the top layer's lse by the final one
            run.lse_out = run.lse
        return run

    def tune_args(self, q, k, v) -> tuple:
        """The walk's arguments for the call ``op(q, k, v)`` (its first slab of queries, with the tree, the top
        layer's lse and the slab's keys computed), for ``scripts/autotune.py``."""
        self._check(q, k, v, None)
        run = self._prepare(q, k, v, None, False)
        return self._one_layer_args(run) if run.L == 1 else self._slab(run, 0).walk_args

    def _check(self, q, k, v, out):
        if isinstance(q, torch.Tensor) and q.dim() == 4 and 0 in q.shape[:2]:
            raise ValueError(f"q: expected B >= 1 and T >= 1, got shape {list(q.shape)}")
        check_tensor("q", q, self.dtype, (None, None, self.num_heads, self.head_dim))
        B, T = q.shape[:2]
        check_tensor("k", k, self.dtype, (B, T, self.num_kv_heads, self.head_dim), q.device)
        check_tensor("v", v, self.dtype, (B, T, self.num_kv_heads, self.v_head_dim), q.device)
        if out is not None:
            check_tensor("out", out, self.dtype, (B, T, self.num_heads, self.v_head_dim), q.device)

    def _rope(self, device):
        if device not in self._tables:
            nbuf = 1 << pack_bits(self.compression_rate, self.top_k_per_layer, self.max_top_nodes)
            self._tables[device] = rope_tables(self.head_dim, nbuf, self.rope_base, torch.float32, device)
        return self._tables[device]

    def _prepare(self, q, k, v, out, return_selection, saved=False):
        """One call's tree, tables, top-layer lse and workspaces (the work before the slabs of queries)."""
        B, T = q.shape[:2]
        H, Hkv, V = self.num_heads, self.num_kv_heads, self.v_head_dim
        cos, sin = self._rope(q.device)
        nodes_k, nodes_v, top, layer_off, offs, sizes = build_tree(self.pool, self.rope, k, v, self.compression_rate,
                                                                   self.max_top_nodes, cos, sin)
        L = len(sizes)
        if out is None:
            out = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
        write_sel = return_selection and L > 1
        sel = q.new_empty(((L - 1, B, T) if write_sel else (1, 1, 1)) + (Hkv, self.top_k_per_layer),
                          dtype=torch.int16 if saved else torch.int32)
        run = SimpleNamespace(q=q, k=k, v=v, out=out, sel=sel, write_sel=write_sel, cos=cos, sin=sin, L=L, offs=offs,
                              sizes=sizes, nodes_k=nodes_k, nodes_v=nodes_v, top=top, layer_off=layer_off, saved=saved)
        if L == 1:
            return run
        f32, i32 = dict(dtype=torch.float32, device=q.device), dict(dtype=torch.int32, device=q.device)
        run.top_off = offs[-1]
        run.shift = (L - 1) * int(math.log2(self.compression_rate))
        run.lse = torch.empty(B, T, H, **f32)
        n_top = top.shape[2]
        run.top_k, run.top_v = top, nodes_v
        if q.dtype == torch.float32:  # the top kernels' operands in TF32 halves, split once per call
            chunk = _TOP_CHUNK[True]["merge"]
            top_v = torch.zeros(B, Hkv, V, -(-n_top // chunk) * chunk, **f32)
            top_v[..., :n_top] = nodes_v[:, run.top_off:run.top_off + n_top].permute(0, 2, 3, 1)
            run.top_k, run.top_v = split_tf32(top), split_tf32(top_v)
        self.top_lse(q, run.top_k, cos, sin, run.lse, run.shift)
        # htree_layer16_kernel takes the middle layers (16-bit, r >= 16), with their scores in a per-slab scratch
        run.l_lo = L - 2 if self.middle is not None and L > 2 else 0
        run.nbuf = 1 << pack_bits(self.compression_rate, self.top_k_per_layer, self.max_top_nodes)
        scr_row = 4 * B * H * run.nbuf if run.l_lo else 0  # scratch bytes per query row
        slab = max(1, min(T, self._KEYS_BYTES // (4 * B * Hkv * n_top), self._SCRATCH_BYTES // max(scr_row, 1)))
        run.slab = slab - slab % 64 if slab >= 64 else slab  # whole CTAs of the top kernels
        run.scr_buf = torch.empty(run.slab * scr_row // 4 if run.l_lo else 1, **f32)
        run.keys_buf = torch.empty(B * run.slab * Hkv * n_top, **i32)
        run.thr_buf = torch.empty(B * run.slab * Hkv, **i32)
        run.part_o_buf = torch.empty(B * run.slab * H * V, **f32)
        run.part_ml_buf = torch.empty(B * run.slab * H * 2, **f32)
        # the parents and candidate counts the walk hands over to the layer kernels (else one-row placeholders)
        run.par_rows = run.slab if self.layer0 is not None else 1
        run.par_buf = torch.empty(B * run.par_rows * Hkv * self.top_k_per_layer, **i32)
        run.n0_buf = torch.empty(B * run.par_rows * Hkv, **i32)
        # htree_layer16_kernel's K: the tokens and the middle layers' nodes rotated at their child index
        run.rot = []
        if self.rope0 is not None:
            for l in range(run.l_lo + 1):
                run.rot.append(k.new_empty(B, Hkv, sizes[l], self.head_dim))
                self.rope0(k if l == 0 else nodes_k, cos, sin, run.rot[l], offs[l])
        return run

    def _one_layer_args(self, run):
        """The walk's arguments for T <= max_top_nodes (one-row placeholders for the top layer's workspaces)."""
        B, T = run.q.shape[:2]
        H, Hkv, V = self.num_heads, self.num_kv_heads, self.v_head_dim
        f32, i32 = dict(dtype=torch.float32, device=run.q.device), dict(dtype=torch.int32, device=run.q.device)
        tp = T if run.saved else 1  # the for_backward walk leaves the rows' softmax states in PartML
        return (run.q, run.k, run.v, run.nodes_k, run.nodes_v, run.top, torch.empty(B, 1, Hkv, 1, **i32), run.cos,
                run.sin, run.layer_off, run.out, torch.empty(B, T, Hkv, **i32), torch.empty(B, tp, H, V, **f32),
                torch.empty(B, tp, H, 2, **f32), run.sel, torch.empty(B, 1, Hkv, self.top_k_per_layer, **i32),
                torch.empty(B, 1, Hkv, **i32), run.L, 0, 0, 0)

    def _slab(self, run, t0):
        """The slab of queries from t0: its views of the workspaces, its top-layer keys (launched here) and the
        walk's arguments."""
        B, T = run.q.shape[:2]
        H, Hkv, V = self.num_heads, self.num_kv_heads, self.v_head_dim
        ts = min(run.slab, T - t0)
        nk = ((t0 + ts - 1) >> run.shift) + 1  # the slab's last query has the most top-layer candidates

        def carve(buf, *shape):  # a contiguous view of the slab's part of a workspace
            return buf[:math.prod(shape)].view(shape)

        s = SimpleNamespace(keys=carve(run.keys_buf, B, ts, Hkv, nk), thr=carve(run.thr_buf, B, ts, Hkv),
                            part_o=carve(run.part_o_buf, B, ts, H, V), part_ml=carve(run.part_ml_buf, B, ts, H, 2),
                            par=carve(run.par_buf, B, min(ts, run.par_rows), Hkv, self.top_k_per_layer),
                            n0=carve(run.n0_buf, B, min(ts, run.par_rows), Hkv))
        s.scr = carve(run.scr_buf, B, ts, Hkv, H // Hkv, run.nbuf) if run.l_lo else run.scr_buf.view(1, 1, 1, 1, 1)
        self.top_keys(run.q, run.top_k, run.cos, run.sin, run.lse, s.keys, run.shift, t0)
        s.walk_args = (run.q, run.k, run.v, run.nodes_k, run.nodes_v, run.top, s.keys, run.cos, run.sin,
                       run.layer_off, run.out, s.thr, s.part_o, s.part_ml, run.sel, s.par, s.n0, run.L,
                       int(run.write_sel), t0, run.l_lo)
        return s
