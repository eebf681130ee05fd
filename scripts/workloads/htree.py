"""htree: demo cases, the forward's and the backward's bench rows (a) and (b), and the walk's autotuning case.

The seed's Triton (github skywong14/htree) is timed beside ours when a copy sits in ``.htree_ref/`` (never
committed): the forward is its src/parallel.py at ``.htree_ref/htree_parallel.py``; the backward is its autograd
function ``htree_forward_triton_autograd`` from src/backward.py at 6514c14, with that commit's ``src/`` directory
copied to ``.htree_ref/src/`` (it imports ``src.parallel``). Dense causal SDPA (RoPE at absolute positions applied
to q and k first, counted in its time) is the dense baseline.
"""

import logging
import pathlib
import sys

import torch
import torch.nn.functional as F

from golden.htree import apply_rope, htree_forward, num_layers, rope_tables
from ops.htree import HTreeBackwardTileLang, HTreeForwardTileLang
from ops.htree.tree import positions_to_nodes
from scripts.workloads import peer_module

_REF = pathlib.Path(__file__).resolve().parents[2] / ".htree_ref"
_SEED = _REF / "htree_parallel.py"


def _seed_forward():
    mod = peer_module(_SEED)
    if mod is None:
        return None
    mod.logger.setLevel(logging.WARNING)
    return mod.htree_forward


def _seed_backward():
    """The seed's differentiable forward (Triton forward and backward), or None without a copy of its src/."""
    if not (_REF / "src" / "backward.py").is_file():
        return None
    if str(_REF) not in sys.path:
        sys.path.insert(0, str(_REF))
    import importlib

    mod = importlib.import_module("src.backward")
    mod.logger.setLevel(logging.WARNING)
    return mod.htree_forward_triton_autograd


def _inputs(B, T, H, Hkv, K, V, dtype, device):
    return (torch.randn(B, T, H, K, dtype=dtype, device=device), torch.randn(B, T, Hkv, K, dtype=dtype, device=device),
            torch.randn(B, T, Hkv, V, dtype=dtype, device=device))


def _compare(ref, out):
    diff = (out.float() - ref.float())
    return diff.abs().max().item(), (diff.norm() / ref.float().norm()).item()


def autotune_case(T=32768, H=32, Hkv=8, K=128, fp32=0):
    """The walk's tuning inputs (``scripts/autotune.py --op htree [--shape T=...,fp32=1,...]``): bench row (b) at
    32K tokens by default, fp32=1 with H=64,Hkv=4,K=32 is row (a)."""
    dtype = torch.float32 if fp32 else torch.bfloat16
    op = HTreeForwardTileLang(H, Hkv, K, dtype=dtype)
    return [(op, _inputs(1, T, H, Hkv, K, K, dtype, "cuda"))]


AUTOTUNE = {"htree": autotune_case}


def demo_cases(device: str) -> list[dict]:
    cases = []
    # the GPU tests' specializations (3 layers in fp32, 2 in bf16)
    for dtype, (H, Hkv, K, V, r, tk, mt, T) in ((torch.float32, (32, 2, 64, 32, 8, 16, 64, 3000)),
                                                (torch.bfloat16, (2, 2, 128, 128, 16, 32, 512, 2000))):
        q, k, v = _inputs(1, T, H, Hkv, K, V, dtype, device)
        op = HTreeForwardTileLang(H, Hkv, K, V, compression_rate=r, top_k_per_layer=tk, max_top_nodes=mt, dtype=dtype)
        cases.append(dict(
            name="HTreeForwardTileLang",
            shape=f"B=1 T={T} H={H} Hkv={Hkv} K={K} V={V} {str(dtype)[6:]} r={r} top_k={tk} max_top={mt}",
            golden=lambda q=q, k=k, v=v, r=r, tk=tk, mt=mt: htree_forward(q, k, v, r, tk, mt),
            compiled=None if device == "cpu" else (lambda op=op, q=q, k=k, v=v: op(q, k, v)),
            compare=_compare))
    # the backward (fp32, 3 layers): dq, dk, dv flattened, the golden's autograd with the kernel's selections
    H, Hkv, K, V, r, tk, mt, T = 32, 2, 64, 32, 8, 16, 64, 1000
    q, k, v = _inputs(1, T, H, Hkv, K, V, torch.float32, device)
    do = torch.randn(1, T, H, V, device=device)
    kw = dict(compression_rate=r, top_k_per_layer=tk, max_top_nodes=mt, dtype=torch.float32)
    fwd, bwd = HTreeForwardTileLang(H, Hkv, K, V, **kw), HTreeBackwardTileLang(H, Hkv, K, V, **kw)

    def golden_bwd():
        sel = None if device == "cpu" else list(positions_to_nodes(fwd.forward_for_backward(q, k, v)[2], r).unbind(0))
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = htree_forward(*xs, r, tk, mt, selection=sel)
        return torch.cat([g.flatten() for g in torch.autograd.grad(o, xs, do)])

    def compiled_bwd():
        o, lse, sel = fwd.forward_for_backward(q, k, v)
        return torch.cat([g.flatten() for g in bwd(do, q, k, v, o, lse, sel)])

    cases.append(dict(name="HTreeBackwardTileLang", shape=f"B=1 T={T} H={H} Hkv={Hkv} K={K} V={V} float32 r={r} "
                      f"top_k={tk} max_top={mt}", golden=golden_bwd, compiled=None if device == "cpu" else compiled_bwd,
                      compare=_compare))
    return cases


def dense_rope_sdpa(q, k, v, cos, sin):
    """Dense causal attention with RoPE at absolute positions (the rotation is part of the timed work);
    k and v are expanded to the query heads so every SDPA backend (also fp32's) applies. Returns [B, T, H, V] like
    ours."""
    T, G = q.shape[1], q.shape[2] // k.shape[2]
    qr = apply_rope(q, cos[:T, None].to(q.dtype), sin[:T, None].to(q.dtype)).transpose(1, 2)
    kr = apply_rope(k, cos[:T, None].to(k.dtype), sin[:T, None].to(k.dtype)).repeat_interleave(G, 2).transpose(1, 2)
    vr = v.repeat_interleave(G, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(qr, kr, vr, is_causal=True).transpose(1, 2)


def _flops_bytes(T, H, Hkv, K, V, r, tk, mt, elem):
    """Upper bounds per call: every (t, kv head) scores at most min(n_l, cap) candidates per layer
    (3 score passes above layer 0, 1 at layer 0, plus P@V), and gathers those nodes' K and V."""
    L = num_layers(T, r, mt)
    cand = [min(-(-T // r ** (L - 1)), mt)] + [tk * r] * (L - 1)  # per layer, top first
    G = H // Hkv
    flops = sum(2 * G * c * ((3 if i < L - 1 else 1) * K + V) for i, c in enumerate(cand)) * T * Hkv
    moved = sum(c * ((3 if i < L - 1 else 1) * K + V) * elem for i, c in enumerate(cand)) * T * Hkv
    return flops // 2, moved // 2  # causal: on average half the top layer / half the buffers


def _time_once(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def bench(b):
    seed = None if b.quick else _seed_forward()
    dev = "cuda"
    # (a) the seed's speed-test configuration
    rows = [("a", torch.float32, 64, 4, 32, [8192 if b.quick else 120000])]
    # (b) bf16 long context, crossover with dense
    rows.append(("b", torch.bfloat16, 32, 8, 128, [32768] if b.quick else [32768, 131072, 524288, 1048576]))
    for tag, dtype, H, Hkv, K, Ts in rows:
        op = HTreeForwardTileLang(H, Hkv, K, dtype=dtype)
        cos, sin = rope_tables(K, max(Ts), 10000.0, torch.float32, dev)
        for T in Ts:
            q, k, v = _inputs(1, T, H, Hkv, K, K, dtype, dev)
            wl = f"({tag}) B=1 T={T} H={H} Hkv={Hkv} K=V={K} {str(dtype)[6:]}"
            flops, moved = _flops_bytes(T, H, Hkv, K, K, 16, 512, 8192, q.element_size())
            # past 128K tokens one call takes seconds to minutes: one timed run after the warm-ups above
            timer = b.time if T <= 131072 else _time_once
            ours = timer(lambda: op(q, k, v))
            b.row("htree", wl, "tilelang", ours, bytes=moved, flops=flops, ours=True)
            dense = timer(lambda: dense_rope_sdpa(q, k, v, cos, sin))
            b.row("htree", wl, "dense causal SDPA", dense, flops=T * T * H * (K + K))  # causal: half of 2*T*T*H*(K+V)
            seed_ms = None
            if seed is not None and (tag == "a" or T <= 131072):
                seed_ms = b.time(lambda: seed(q, k, v, 16, 8192, 512))
                b.row("htree", wl, "seed Triton", seed_ms, bytes=moved, flops=flops)
            if tag == "a" and seed_ms is not None:
                b.target("htree", wl, ">= 2x faster than the seed's Triton", seed_ms >= 2 * ours)
            if tag == "b" and T == 131072 and seed_ms is not None:
                b.target("htree", wl, ">= 5x faster than the seed's Triton", seed_ms >= 5 * ours)
            if tag == "b" and T == 1048576:
                b.target("htree", wl, "faster than dense causal SDPA", ours < dense)
            del q, k, v
        torch.cuda.empty_cache()
    bench_backward(b)


def _bwd_flops_bytes(T, H, Hkv, K, V, r, tk, mt, elem):
    """Upper bounds of the backward's work (the design doc's model): per (t, kv head) the lower layers' candidates are
    gathered once more for dq (K and V rows; products S, dP, dq) and every selected parent's children once per
    (query, parent) entry for dK, dV (q and dO rows of the G heads; products S, dP, dV, dK); the top layer as
    GEMMs over blocks (causal: half of its nodes on average)."""
    L = num_layers(T, r, mt)
    G = H // Hkv
    top = min(-(-T // r ** (L - 1)), mt) / 2
    flops = 2 * G * top * (3 * K + V + 2 * K + 2 * V) * T * Hkv  # top layer: dq side + dK/dV side
    flops += (L - 1) * 2 * G * tk * r * ((2 * K + V) + 2 * (K + V)) * T * Hkv  # lower layers: rows + nodes
    moved = (L - 1) * (tk * r * (K + V) + tk * G * (K + V)) * elem * T * Hkv
    return flops, moved


def _time_backward(b, fn, once):
    return _time_once(fn) if once else b.time(fn)


def bench_backward(b, only=None):
    """The backward's rows: ours (the backward alone, and forward + backward), the seed's Triton backward
    (``o.backward(do)``, which includes its tree rebuild and selection recompute; seconds per call, so one timed run
    after a warm-up) and dense SDPA's backward (its RoPE included), with the issue's targets. ``only``: a subset of
    the (tag, T) pairs, e.g. {("a", 120000), ("b", 32768)}."""
    seed = None if b.quick else _seed_backward()
    dev = "cuda"
    rows = [("a", torch.float32, 64, 4, 32, [8192 if b.quick else 120000])]
    rows.append(("b", torch.bfloat16, 32, 8, 128, [32768] if b.quick else [32768, 131072, 524288, 1048576]))
    if only is not None:
        rows = [(tag, *spec, [T for T in Ts if (tag, T) in only]) for tag, *spec, Ts in rows]
        rows = [row for row in rows if row[-1]]
    for tag, dtype, H, Hkv, K, Ts in rows:
        fwd = HTreeForwardTileLang(H, Hkv, K, dtype=dtype)
        bwd = HTreeBackwardTileLang(H, Hkv, K, dtype=dtype)
        # fp32: also at the seed's own precision (its tl.dot on fp32 runs TF32 products)
        bwd_tf32 = HTreeBackwardTileLang(H, Hkv, K, dtype=dtype, fp32_precision="high") if tag == "a" else None
        cos, sin = rope_tables(K, max(Ts), 10000.0, torch.float32, dev)
        for T in Ts:
            once = T > 131072  # seconds per call: one timed run after one warm-up
            wl = f"({tag}) backward B=1 T={T} H={H} Hkv={Hkv} K=V={K} {str(dtype)[6:]}"
            q, k, v = _inputs(1, T, H, Hkv, K, K, dtype, dev)
            do = torch.randn_like(q)
            o, lse, sel = fwd.forward_for_backward(q, k, v)
            flops, moved = _bwd_flops_bytes(T, H, Hkv, K, K, 16, 512, 8192, q.element_size())
            if once:
                bwd(do, q, k, v, o, lse, sel, validate=False)
            ours = _time_backward(b, lambda: bwd(do, q, k, v, o, lse, sel, validate=False), once)
            b.row("htree", wl, "tilelang backward", ours, bytes=moved, flops=flops, ours=True)
            ours_tf32 = None
            if bwd_tf32 is not None:
                ours_tf32 = _time_backward(b, lambda: bwd_tf32(do, q, k, v, o, lse, sel, validate=False), once)
                b.row("htree", wl, "tilelang backward, TF32 products (fp32_precision='high')", ours_tf32,
                      bytes=moved, flops=flops, ours=True)

            def fwd_bwd():
                o2, lse2, sel2 = fwd.forward_for_backward(q, k, v)
                return bwd(do, q, k, v, o2, lse2, sel2, validate=False)

            both = _time_backward(b, fwd_bwd, once)
            b.row("htree", wl, "tilelang forward+backward", both)
            del o, lse, sel
            torch.cuda.empty_cache()
            seed_ms = None
            if seed is not None and (tag == "a" or T <= 131072):
                qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
                out = seed(qs, ks, vs, 16, 8192, 512)
                out.backward(do, retain_graph=True)
                seed_ms = _time_once(lambda: out.backward(do, retain_graph=True))
                b.row("htree", wl, "seed Triton backward", seed_ms)
                del qs, ks, vs, out
                torch.cuda.empty_cache()
            qd, kd, vd = (x.requires_grad_() for x in (q, k, v))  # (ours is done: no copies at 1M tokens)
            dense_f = _time_backward(b, lambda: dense_rope_sdpa(qd, kd, vd, cos, sin), once)
            out = dense_rope_sdpa(qd, kd, vd, cos, sin)
            dense_b = _time_backward(b, lambda: out.backward(do, retain_graph=True), once)
            # causal: half of the 4 T^2 H (K + V) of a dense backward, plus the recomputed scores
            b.row("htree", wl, "dense causal SDPA backward", dense_b, flops=2.5 * T * T * H * (K + K))
            b.row("htree", wl, "dense causal SDPA forward+backward", dense_f + dense_b)
            del qd, kd, vd, out
            torch.cuda.empty_cache()
            if tag == "a" and seed_ms is not None:
                b.target("htree", wl, ">= 5x faster than the seed's Triton backward", seed_ms >= 5 * ours)
                b.target("htree", wl, ">= 5x faster than the seed's Triton backward at its precision (TF32)",
                         seed_ms >= 5 * ours_tf32)
            if tag == "b" and T == 131072 and seed_ms is not None:
                b.target("htree", wl, ">= 15x faster than the seed's Triton backward", seed_ms >= 15 * ours)
            if tag == "b" and T == 1048576:
                b.target("htree", wl, "forward+backward faster than dense SDPA's forward+backward",
                         both < dense_f + dense_b)
            del q, k, v, do
            torch.cuda.empty_cache()
