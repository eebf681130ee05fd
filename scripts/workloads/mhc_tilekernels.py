"""mHC against DeepSeek's TileKernels in one run (issue targets: the pre with 20 Sinkhorn iterations >= 1.5x
TileKernels' fused pre, its backward >= 1.5x TileKernels' backward, timed as pre -> post backward: TileKernels'
pre backward needs its post's), 16384 tokens, bf16, n = 4 (TileKernels supports
n = 4 only) at D = 4096 and 7168, and ours alone at n = 8. TileKernels is timed when a copy of its repository sits
in ``.peers/TileKernels`` (`tile_kernels.modeling.mhc.functional`: ``mhc_pre`` runs its fused "big fuse" kernel
without autograd and its split kernels with it; ``mhc_post``; both take [num_seqs, num_tokens, n, D])."""

import torch

from golden.mhc_pre import random_inputs
from ops.mhc import MHCForwardPreTileLang, mhc_post, mhc_pre
from scripts.workloads import tilekernels_mhc

OP = "mhc_tilekernels"
TOKENS, ITERS = 16384, 20  # DeepSeek-V4's Sinkhorn iterations


def demo_cases(device):
    return []  # the demo's mHC cases live in mhc_pre.py / mhc_post.py


def _grads_fn(outs, inputs):
    """Time the backward alone: the graph is kept, each call differentiates it again."""
    grads = [torch.randn_like(o) for o in outs]
    return lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True)


def bench(b):
    tk = None if b.quick else tilekernels_mhc()
    for n, D in ((4, 4096), (4, 7168), (8, 4096)):
        wl = f"tokens={TOKENS} n={n} D={D}"
        x, phi, alpha, bias = random_inputs(1, TOKENS, n, D, "cuda")
        x = x.view(TOKENS, n, D)
        x_bytes = x.numel() * 2
        # forward: x read, h_in written, the small outputs
        fwd_bytes = x_bytes + TOKENS * D * 2 + TOKENS * (n + n * n) * 4
        op = MHCForwardPreTileLang(1, TOKENS, n, D, sinkhorn_iters=ITERS)
        b.row(OP, f"pre {wl}", "tilelang (ours)", b.time(lambda: op(x, phi, alpha, bias)), fwd_bytes, ours=True)
        if tk is not None and n == 4:
            with torch.no_grad():
                ms = b.time(lambda: tk.mhc_pre(x.view(1, TOKENS, n, D), phi, alpha, bias, mhc_mult=n,
                                               post_mult_value=2.0, sinkhorn_repeat=ITERS))
            b.row(OP, f"pre {wl}", "TileKernels big fuse", ms, fwd_bytes)
            sp = b.speedup(OP, f"pre {wl}", "TileKernels big fuse")
            b.target(OP, f"pre {wl}", f">= 1.5x TileKernels' fused pre (got {sp:.2f}x)", sp >= 1.5)
        # backward: x and grad_h_in read, grad_x written (the small tensors aside)
        bwd_bytes = 2 * x_bytes + TOKENS * D * 2
        leaves = [t.clone().requires_grad_() for t in (x, phi, alpha, bias)]
        outs = mhc_pre(*leaves, sinkhorn_iters=ITERS)
        b.row(OP, f"pre backward {wl}", "tilelang (ours)", b.time(_grads_fn(outs, leaves)), bwd_bytes, ours=True)
        # TileKernels' pre backward runs only behind its post's (its norm backward takes the residual's gradient
        # from the post's), so the peer comparison is pre -> post with the sublayer as the identity, backward
        new = mhc_post(leaves[0], *outs)
        b.row(OP, f"pre+post backward {wl}", "tilelang (ours)", b.time(_grads_fn((new,), leaves)), ours=True)
        del outs, new
        if tk is not None and n == 4:
            tk_leaves = [x.view(1, TOKENS, n, D).clone().requires_grad_()] + leaves[1:]
            layer_input, (post_mix, comb_mix) = tk.mhc_pre(*tk_leaves, mhc_mult=n, post_mult_value=2.0,
                                                           sinkhorn_repeat=ITERS)
            new = tk.mhc_post(layer_input, tk_leaves[0], post_mix, comb_mix)
            b.row(OP, f"pre+post backward {wl}", "TileKernels", b.time(_grads_fn((new,), tk_leaves)))
            sp = b.speedup(OP, f"pre+post backward {wl}", "TileKernels")
            b.target(OP, f"pre+post backward {wl}", f">= 1.5x TileKernels' backward (got {sp:.2f}x)", sp >= 1.5)
            del layer_input, post_mix, comb_mix, tk_leaves, new
        # post: residual read and written, layer_out read
        residual = torch.randn(TOKENS, n, D, device="cuda", dtype=torch.bfloat16)
        layer_out = torch.randn(TOKENS, D, device="cuda", dtype=torch.bfloat16)
        post = torch.rand(TOKENS, n, device="cuda") * 2
        comb = torch.softmax(torch.randn(TOKENS, n, n, device="cuda"), -1)
        post_bytes = 2 * x_bytes + TOKENS * D * 2
        b.row(OP, f"post {wl}", "tilelang (ours)", b.time(lambda: mhc_post(residual, layer_out, post, comb)),
              post_bytes, ours=True)
        if tk is not None and n == 4:  # TileKernels' post takes [num_seqs, num_tokens, ...] and post as [.., n, 1]
            tk_args = (layer_out.view(1, TOKENS, D), residual.view(1, TOKENS, n, D), post.view(1, TOKENS, n, 1),
                       comb.view(1, TOKENS, n, n))
            b.row(OP, f"post {wl}", "TileKernels", b.time(lambda: tk.mhc_post(*tk_args)), post_bytes)
        del x, phi, alpha, bias, leaves, residual, layer_out
        torch.cuda.empty_cache()
