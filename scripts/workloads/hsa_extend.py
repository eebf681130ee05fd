"""HSA extend: the issue's bench rows (bf16, H=32, Hkv=8, D=128, page 64, topk 64, window 512) against our dense
paged prefill over the same cache (exact attention over the whole history): (a) 8 requests x 2048 new tokens on
65536 of history, (b) 4 x 4096 on 524288, (c) 16 ragged requests, new 1..4096, history 0..131072; and (a) again
with correlated queries; and the selection alone (the scores and the top-k, which the attention follows)."""

import torch

from ops.hsa import HSAExtendTileLang
from ops.paged_prefill import PagedAttentionPrefillTileLang
from scripts.workloads.hsa_decode import D, H, HKV, PS, SPEC, WINDOW, TOPK, paged_batch

OP = "HSAExtendTileLang"


def demo_cases(device):
    return []  # golden.hsa_decode.hsa_extend is a decode per new token: hsa_decode's demo cases cover it


def _batch(histories, new, correlated=False):
    """A bench batch; with ``correlated``, each request's queries share a component (one random vector per request
    plus 0.3x independent noise), as neighbouring tokens' queries do in a model, so their selections overlap (a
    64-token tile's pages: ~200 instead of ~1000 at (a), docs/design/hsa.md)."""
    batch = paged_batch([h + n for h, n in zip(histories, new)])
    cum = torch.tensor([0] + list(new)).cumsum(0).to(torch.int32).cuda()
    q = torch.randn(int(cum[-1]), H, D, device="cuda")
    if correlated:
        q = 0.3 * q + torch.randn(len(new), H, D, device="cuda").repeat_interleave(torch.tensor(new, device="cuda"), 0)
    batch["q"] = q.to(torch.bfloat16)
    batch["cum_seq_lens_q"] = cum
    return batch


def _work(histories, new):
    """(selection FLOPs: every new token's G heads against its request's candidate reprs; bytes: the reprs it scores
    and the K, V of its selected pages and window, per kv head, bf16)."""
    flops = moved = 0
    for h, n in zip(histories, new):
        for p in range(h, h + n):
            pages = max(0, p + 1 - WINDOW) // PS
            flops += 2 * H * pages * D
            moved += HKV * D * 2 * (pages + 2 * (min(TOPK, pages) * PS + min(p + 1, WINDOW + PS)))
    return flops, moved


def bench(b):
    gen = torch.Generator().manual_seed(2)
    # (workload, histories, new tokens, target speedup or None, correlated queries)
    rows = [("(a) 8 x 2048 new on 65536", [65536] * 8, [2048] * 8, 3, False),
            ("(b) 4 x 4096 new on 524288", [524288] * 4, [4096] * 4, 20, False),
            ("(c) 16 ragged, new 1..4096, history 0..131072", torch.randint(0, 131073, (16,), generator=gen).tolist(),
             torch.randint(1, 4097, (16,), generator=gen).tolist(), None, False),
            ("(a) with correlated queries per request", [65536] * 8, [2048] * 8, None, True)]
    if b.quick:
        rows = [("(a) quick: 2 x 512 new on 8192", [8192] * 2, [512] * 2, None, False)]
    op = HSAExtendTileLang(**SPEC)
    dense = PagedAttentionPrefillTileLang(H, HKV, D, PS, torch.bfloat16, kv_layout="NHD")
    for workload, histories, new, speedup, correlated in rows:
        batch = _batch(histories, new, correlated)
        total_q = batch["q"].shape[0]
        plan = op.plan(batch["page_table"], batch["seq_lens"], batch["cum_seq_lens_q"], total_q,
                       batch["chunk_repr"].shape[0])
        out = torch.empty_like(batch["q"])
        flops, moved = _work(histories, new)
        ms = b.time(lambda: op.run(batch["q"], batch["k_buffer"], batch["v_buffer"], batch["chunk_repr"], plan,
                                   out=out))
        b.row(OP, workload, "tilelang (run)", ms, bytes=moved, flops=flops, ours=True)
        b.row(OP, workload, "selection alone", b.time(lambda: op.select(batch["q"], batch["chunk_repr"], plan)))
        k_pages = batch["k_buffer"].view(-1, PS, HKV, D)
        v_pages = batch["v_buffer"].view(-1, PS, HKV, D)
        table = batch["page_table"].clamp(min=0)
        ms_dense = b.time(lambda: dense(batch["q"], k_pages, v_pages, table, batch["seq_lens"],
                                        batch["cum_seq_lens_q"], out=out, validate=False))
        b.row(OP, workload, "dense paged prefill (ours, exact)", ms_dense)
        if speedup is not None:
            b.target(OP, workload, f">= {speedup}x faster than our dense paged prefill", ms_dense >= speedup * ms)
        del batch, plan, out
        torch.cuda.empty_cache()


def _shared_gpu_case(histories, new):
    """One planned extend step (``run`` on a plan made once, as an engine calls it per layer)."""
    def make():
        op = HSAExtendTileLang(**SPEC)
        batch = _batch(histories, new)
        plan = op.plan(batch["page_table"], batch["seq_lens"], batch["cum_seq_lens_q"], batch["q"].shape[0],
                       batch["chunk_repr"].shape[0])
        out = torch.empty_like(batch["q"])
        return lambda: op.run(batch["q"], batch["k_buffer"], batch["v_buffer"], batch["chunk_repr"], plan, out=out)
    return make


# scripts/shared_gpu.py: the extend while another stream holds some SMs
SHARED_GPU = {"hsa_extend 2 x 1024 new on 65536": _shared_gpu_case([65536] * 2, [1024] * 2)}
