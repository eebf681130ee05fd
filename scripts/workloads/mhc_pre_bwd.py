"""mHC pre backward: demo case and the issue's bench rows (tokens 16384, n=4, D in {4096, 7168}, bf16), each
also with DeepSeek-V4's 20 Sinkhorn iterations beside the backward without them.

Peers: the golden's autograd backward (torch.autograd.grad through golden.mhc_pre's forward, graph
built once outside the timing) and the same under torch.compile. Bytes counted: x, grad_h_in and the
small per-token tensors read once, grad_x written once (the issue's definition).
"""

import torch
import torch._functorch.config

from golden.mhc_pre import mhc_forward_pre, random_inputs
from golden.mhc_pre_bwd import mhc_backward_pre_autograd
from ops.mhc import MHCBackwardPreTileLang

OP = "mhc_pre_bwd"
SINKHORN_ITERS = 20  # DeepSeek-V4's


def _inputs(B, S, n, D, device):
    x, phi, alpha, bias = random_inputs(B, S, n, D, device)
    grads = (torch.randn(B, S, D, device=device).to(torch.bfloat16), torch.randn(B, S, n, device=device),
             torch.randn(B, S, n, n, device=device))
    aux = mhc_forward_pre(x, phi, alpha, bias, return_aux=True)[3:]  # inv_rms, h_pre, h_mix
    return (x, phi, alpha, bias, *aux), grads


def _compare(ref, out):
    """Worst max-abs and relative-norm error over (grad_x, grad_phi, grad_alpha, grad_bias)."""
    errs = [((o.double() - r.double()).abs().max().item(),
             ((o.double() - r.double()).norm() / r.double().norm()).item()) for r, o in zip(ref, out)]
    return max(e[0] for e in errs), max(e[1] for e in errs)


def demo_cases(device: str) -> list[dict]:
    B, S, n, D = 2, 1024, 4, 4096
    op = MHCBackwardPreTileLang(B, S, n, D)
    saved, grads = _inputs(B, S, n, D, device)
    return [dict(
        name="MHCBackwardPreTileLang",
        shape=f"B={B} S={S} n={n} D={D} bf16",
        golden=lambda: mhc_backward_pre_autograd(*saved[:4], *grads),
        compiled=None if device == "cpu" else (lambda: op(*saved, *grads)),
        compare=_compare)]


def autotune_cases(n=4, D=4096, tokens=16384):
    """The issue's bench case for scripts/autotune.py: [(op, the op's call inputs)]."""
    saved, grads = _inputs(1, tokens, n, D, "cuda")
    return [(MHCBackwardPreTileLang(1, tokens, n, D), (*saved, *grads))]


AUTOTUNE = {OP: autotune_cases}


def _autograd_backward(forward, saved, grads):
    """A zero-arg callable running only the backward of ``forward`` (graph built here, retained)."""
    leaves = [t.detach().float().requires_grad_() for t in saved[:4]]
    outs = forward(*leaves)
    grads32 = [g.float() for g in grads]
    return lambda: torch.autograd.grad(outs, leaves, grads32, retain_graph=True)


def bench(b):
    tokens = 2048 if b.quick else 16384
    for D in (4096,) if b.quick else (4096, 7168):
        n = 4
        saved, grads = _inputs(1, tokens, n, D, "cuda")
        op = MHCBackwardPreTileLang(1, tokens, n, D)
        wl = f"tokens={tokens} n={n} D={D} bf16"
        x = saved[0]
        moved = (2 * x.numel() * 2 + grads[0].numel() * 2
                 + sum(t.numel() * 4 for t in (*saved[1:], *grads[1:])))
        ours = b.time(lambda: op(*saved, *grads))
        b.row(OP, wl, "tilelang", ours, bytes=moved, ours=True)
        golden = b.time(_autograd_backward(mhc_forward_pre, saved, grads))
        b.row(OP, wl, "golden autograd (eager)", golden, bytes=moved)
        if not b.quick:
            # The timed backward reruns on a retained graph, which donated buffers forbid.
            with torch._functorch.config.patch(donated_buffer=False):
                compiled = b.time(_autograd_backward(torch.compile(mhc_forward_pre), saved, grads))
            b.row(OP, wl, "golden autograd (torch.compile)", compiled, bytes=moved)
        frac = moved / (ours * 1e-3) / 1e9 / b.copy_gbs
        b.target(OP, wl, ">= 70% of the measured copy bandwidth", frac >= 0.7)
        b.target(OP, wl, ">= 5x faster than the golden's autograd", golden >= 5 * ours)
        _bench_sinkhorn(b, op, wl, saved, grads, moved)
        del saved, grads, x


def _bench_sinkhorn(b, plain, wl, saved, grads, moved):
    """The backward through SINKHORN_ITERS iterations (grad_h_res is then comb's gradient) beside the same op
    without them, timed in interleaved rounds, and the golden's autograd through them."""
    n, D = saved[0].shape[-2:]
    op = MHCBackwardPreTileLang(1, saved[0].shape[1], n, D, sinkhorn_iters=SINKHORN_ITERS)
    wl = f"{wl} sinkhorn_iters={SINKHORN_ITERS}"
    times = b.time_many({"with": lambda: op(*saved, *grads), "without": lambda: plain(*saved, *grads)})
    b.row(OP, wl, "tilelang", times["with"], bytes=moved, ours=True)
    b.row(OP, wl, "ours, sinkhorn_iters=0", times["without"], bytes=moved)

    def forward(x, phi, alpha, bias):
        return mhc_forward_pre(x, phi, alpha, bias, sinkhorn_iters=SINKHORN_ITERS)

    golden = b.time(_autograd_backward(forward, saved, grads))
    b.row(OP, wl, "golden autograd (eager)", golden, bytes=moved)
    b.target(OP, wl, ">= 5x faster than the golden's autograd", golden >= 5 * times["with"])
