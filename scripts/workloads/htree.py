"""htree forward: demo cases and the issue's bench rows (a) and (b).

The seed's Triton (github skywong14/htree, src/parallel.py) is timed beside ours when a copy sits at
``.htree_ref/htree_parallel.py`` (never committed); dense causal SDPA (RoPE at absolute positions
applied to q and k first, counted in its time) is the dense baseline.
"""

import logging
import pathlib

import torch
import torch.nn.functional as F

from golden.htree import apply_rope, htree_forward, num_layers, rope_tables
from ops.htree import HTreeForwardTileLang
from scripts.workloads import peer_module

_SEED = pathlib.Path(__file__).resolve().parents[2] / ".htree_ref" / "htree_parallel.py"


def _seed_forward():
    mod = peer_module(_SEED)
    if mod is None:
        return None
    mod.logger.setLevel(logging.WARNING)
    return mod.htree_forward


def _inputs(B, T, H, Hkv, K, V, dtype, device):
    return (torch.randn(B, T, H, K, dtype=dtype, device=device), torch.randn(B, T, Hkv, K, dtype=dtype, device=device),
            torch.randn(B, T, Hkv, V, dtype=dtype, device=device))


def _compare(ref, out):
    diff = (out.float() - ref.float())
    return diff.abs().max().item(), (diff.norm() / ref.float().norm()).item()


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
    return cases


def dense_rope_sdpa(q, k, v, cos, sin):
    """Dense causal attention with RoPE at absolute positions (the rotation is part of the timed work);
    k and v are expanded to the query heads so every SDPA backend (also fp32's) applies."""
    T, G = q.shape[1], q.shape[2] // k.shape[2]
    qr = apply_rope(q, cos[:T, None].to(q.dtype), sin[:T, None].to(q.dtype)).transpose(1, 2)
    kr = apply_rope(k, cos[:T, None].to(k.dtype), sin[:T, None].to(k.dtype)).repeat_interleave(G, 2).transpose(1, 2)
    vr = v.repeat_interleave(G, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)


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
