"""Dense paged decode: demo cases and the issue's bench rows: bf16, 32 heads, 8 kv heads, head_dim 128, page
size 16 and 64, (a) B=64 x 8K and (b) B=8 x 64K context, bf16 and FP8 caches, against SDPA on the same KV
stored contiguously."""

import torch

from golden.paged_decode import paged_attention_decode
from ops.paged_decode import PagedAttentionDecodeTileLang
from scripts.workloads import graph_replay, sdpa_decode_peers

OP = "PagedAttentionDecodeTileLang"
H, HKV, D = 32, 8, 128
FP8 = torch.float8_e4m3fn


def paged_batch(batch_size, seq_len, page_size, kv_dtype=torch.bfloat16, num_q_tokens=1, device="cuda", seed=0):
    """Equal-length sequences over a cache whose pages are shuffled (built on the device)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_per = -(-seq_len // page_size)
    num_pages = batch_size * pages_per
    perm = torch.randperm(num_pages, device=device, dtype=torch.int32, generator=gen)
    shape = (num_pages, HKV, page_size, D)
    cache = [torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen).to(kv_dtype) for _ in range(2)]
    return dict(q=torch.randn(batch_size * num_q_tokens, H, D, device=device, dtype=torch.bfloat16, generator=gen),
                k_cache=cache[0], v_cache=cache[1], block_tables=perm.view(batch_size, pages_per),
                seq_lens=torch.full((batch_size,), seq_len, dtype=torch.int32, device=device))


def kv_bytes(batch_size, seq_len, kv_dtype, num_q_tokens=1):
    """Bytes a decode step must move: K and V of every token, q and out."""
    kv = 2 * batch_size * seq_len * HKV * D * torch.empty((), dtype=kv_dtype).element_size()
    return kv + 2 * batch_size * num_q_tokens * H * D * 2


def _compare(golden_out, compiled_out):
    g, c = golden_out.float(), compiled_out.float()
    return (g - c).abs().max().item(), ((g - c).norm() / g.norm()).item()


def demo_cases(device: str) -> list[dict]:
    cases = []
    for kv_dtype, nq, extra in ((torch.bfloat16, 1, {}), (FP8, 2, dict(window_left=500, logits_soft_cap=30.0))):
        torch.manual_seed(0)
        seq_lens = [3000, 17, 900]
        op = PagedAttentionDecodeTileLang(H, HKV, D, 16, torch.bfloat16, kv_dtype=kv_dtype, num_q_tokens=nq,
                                          **extra)  # built (cached) on cpu too
        batches = [paged_batch(1, n, 16, kv_dtype, nq, device="cpu", seed=i) for i, n in enumerate(seq_lens)]
        offsets = torch.tensor([0] + [b["k_cache"].shape[0] for b in batches]).cumsum(0)[:-1].tolist()
        width = max(b["block_tables"].shape[1] for b in batches)
        tables = torch.zeros(len(batches), width, dtype=torch.int32)
        for i, (b, off) in enumerate(zip(batches, offsets)):
            tables[i, :b["block_tables"].shape[1]] = b["block_tables"][0] + off
        batch = {k: torch.cat([b[k] for b in batches]).to(device) for k in ("q", "k_cache", "v_cache", "seq_lens")}
        batch["block_tables"] = tables.to(device)
        scales = dict(k_scale=0.5, v_scale=1.5) if kv_dtype == FP8 else {}
        cases.append({
            "name": OP,
            "shape": f"H={H} Hkv={HKV} D={D} ps=16 kv={kv_dtype} nq={nq} {extra} seq_lens={seq_lens}",
            "golden": lambda batch=batch, nq=nq, extra=extra, scales=scales: paged_attention_decode(
                **batch, num_q_tokens=nq, **extra, **scales),
            "compiled": None if device == "cpu" else (lambda op=op, batch=batch, scales=scales: op(
                batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"], **scales)),
            "compare": _compare,
        })
    return cases


def bench(b):
    shapes = [("(a)", 4, 2048)] if b.quick else [("(a)", 64, 8192), ("(b)", 8, 65536)]
    for tag, batch_size, seq_len in shapes:
        best_sdpa = sdpa_decode_peers(b, OP, f"{tag} B={batch_size} x {seq_len} SDPA contiguous", batch_size, H, HKV,
                                      D, seq_len, kv_bytes(batch_size, seq_len, torch.bfloat16))
        for page_size in (16, 64):
            bf16_ms = None
            for kv_dtype in (torch.bfloat16, FP8):
                kv = "fp8" if kv_dtype == FP8 else "bf16"
                workload = f"{tag} B={batch_size} x {seq_len}, page {page_size}, {kv} KV"
                op = PagedAttentionDecodeTileLang(H, HKV, D, page_size, torch.bfloat16, kv_dtype=kv_dtype)
                batch = paged_batch(batch_size, seq_len, page_size, kv_dtype)
                plan = op.plan(batch["block_tables"], batch["seq_lens"])
                out = torch.empty_like(batch["q"])
                scales = dict(k_scale=0.5, v_scale=2.0) if kv_dtype == FP8 else {}
                nbytes = kv_bytes(batch_size, seq_len, kv_dtype)

                def step():
                    return op.run(batch["q"], batch["k_cache"], batch["v_cache"], plan, out=out, **scales)

                b.row(OP, workload, "tilelang (eager run)", b.time(step), bytes=nbytes)
                ms = b.time(graph_replay(step))  # serving engines replay decode as a graph
                b.row(OP, workload, f"tilelang (CUDA graph, {plan.num_splits} splits)", ms, bytes=nbytes, ours=True)
                b.target(OP, workload, ">= 80% of copy bandwidth on the bytes read",
                         nbytes / ms * 1e-6 >= 0.8 * b.copy_gbs)
                if best_sdpa is not None:
                    b.target(OP, workload, f"faster than the fastest SDPA on contiguous bf16 KV "
                             f"({best_sdpa / ms:.2f}x)", ms < best_sdpa)
                if kv_dtype == FP8:
                    b.target(OP, workload, f"FP8 KV at most 0.6x the bf16 time ({ms / bf16_ms:.2f}x)",
                             ms <= 0.6 * bf16_ms)
                else:
                    bf16_ms = ms
                del batch, out, plan
                torch.cuda.empty_cache()


def autotune_case(page_size=16, batch_size=64, seq_len=8192, fp8=0):
    """scripts/autotune.py --op paged_decode [--shape page_size=64,batch_size=8,seq_len=65536,fp8=1]."""
    kv_dtype = FP8 if fp8 else torch.bfloat16
    op = PagedAttentionDecodeTileLang(H, HKV, D, page_size, torch.bfloat16, kv_dtype=kv_dtype)
    batch = paged_batch(batch_size, seq_len, page_size, kv_dtype)
    return [(op, (batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"], batch["seq_lens"]))]


AUTOTUNE = {PagedAttentionDecodeTileLang.op_name: autotune_case}


def _shared_gpu_case(batch_size, seq_len, page_size, kv_dtype):
    """One decode step of a bench batch (plan once, run replayed as a CUDA graph, as engines run decode)."""
    def make():
        op = PagedAttentionDecodeTileLang(H, HKV, D, page_size, torch.bfloat16, kv_dtype=kv_dtype)
        batch = paged_batch(batch_size, seq_len, page_size, kv_dtype)
        plan = op.plan(batch["block_tables"], batch["seq_lens"])
        out = torch.empty_like(batch["q"])
        return graph_replay(lambda: op.run(batch["q"], batch["k_cache"], batch["v_cache"], plan, out=out),
                            keep=(batch, plan, out))
    return make


# scripts/shared_gpu.py: the decode while another stream holds some SMs
SHARED_GPU = {f"paged_decode {tag} B={b} x {s}, page {ps}, {kv} KV, CUDA graph": _shared_gpu_case(b, s, ps, dt)
              for tag, b, s, ps in (("(a)", 64, 8192, 16), ("(b)", 8, 65536, 64))
              for kv, dt in (("bf16", torch.bfloat16), ("fp8", FP8))}
