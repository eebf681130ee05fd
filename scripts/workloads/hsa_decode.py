"""HSA decode: demo cases and the issue's bench rows (a) (b) (c): bf16, 32 heads, 8 kv heads, head_dim 128,
page_size 64, topk 64, window 512."""

import torch

from golden.hsa_decode import hsa_decode, local_range, random_case
from ops.hsa import HSADecodeTileLang, HSAPageReprTileLang
from scripts.workloads import graph_replay, sdpa_decode_peers

OP = "HSADecodeTileLang"
H, HKV, D, PS, TOPK, WINDOW = 32, 8, 128, 64, 64, 512
SPEC = dict(num_heads=H, num_kv_heads=HKV, head_dim=D, page_size=PS, topk=TOPK, dtype=torch.bfloat16,
            window_size=WINDOW)


def _compare(golden_out, compiled_out):
    g, c = golden_out.float(), compiled_out.float()
    return (g - c).abs().max().item(), ((g - c).norm() / g.norm()).item()


def demo_cases(device: str) -> list[dict]:
    torch.manual_seed(0)
    seq_lens = [40000, 700, 9001, 65]
    batch = random_case(seq_lens, H, HKV, D, PS, dtype=torch.bfloat16, device=device, invalid_frac=0.05)
    cases = []
    for combine in ("softmax", "token"):
        op = HSADecodeTileLang(**SPEC, combine=combine)  # built (cached) on cpu too
        cases.append({
            "name": OP,
            "shape": f"H={H} Hkv={HKV} D={D} ps={PS} topk={TOPK} window={WINDOW} {combine} seq_lens={seq_lens}",
            "golden": lambda combine=combine: hsa_decode(**batch, page_size=PS, topk=TOPK, window_size=WINDOW,
                                                         combine=combine)[0],
            "compiled": None if device == "cpu" else (lambda op=op: op(**batch)),
            "compare": _compare,
        })
    return cases


def paged_batch(seq_lens, device="cuda"):
    """A bench-sized paged batch built on the GPU: shuffled physical pages, mean page reprs."""
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    pages_per = [(L + PS - 1) // PS for L in seq_lens]
    num_pages = sum(pages_per)
    perm = torch.randperm(num_pages, device=device, dtype=torch.int32)
    page_table = torch.full((len(seq_lens), max(pages_per)), -1, dtype=torch.int32, device=device)
    for b, ids in enumerate(perm.split(pages_per)):
        page_table[b, :len(ids)] = ids
    k_buffer = torch.randn(num_pages * PS, HKV, D, device=device, dtype=torch.bfloat16)
    v_buffer = torch.randn_like(k_buffer)
    chunk_repr = torch.empty(num_pages, HKV, D, device=device, dtype=torch.bfloat16)
    HSAPageReprTileLang(HKV, D, PS, torch.bfloat16, "mean")(k_buffer, perm, chunk_repr)
    return dict(q=torch.randn(len(seq_lens), H, D, device=device, dtype=torch.bfloat16), k_buffer=k_buffer,
                v_buffer=v_buffer, page_table=page_table, seq_lens=seq, chunk_repr=chunk_repr)


def touched_bytes(seq_lens):
    """q, o, the reprs of the request's candidate pages, K and V of the selected pages and local tokens."""
    item = 2  # bf16
    total = 2 * len(seq_lens) * H * D * item
    for L in seq_lens:
        _, lo = local_range(L, PS, WINDOW)
        n_cand = lo // PS
        total += n_cand * HKV * D * item
        total += (min(TOPK, n_cand) * PS + (L - lo)) * HKV * D * item * 2
    return total


def torch_select(q, page_table, seq_lens, chunk_repr):
    """The torch baseline: gather the candidate reprs, einsum, mask, torch.topk."""
    B = q.shape[0]
    n_cand = torch.minimum(torch.clamp(seq_lens - WINDOW, min=0), seq_lens // PS * PS) // PS
    C = page_table.shape[1]
    E = chunk_repr[page_table.clamp(min=0).long()]  # [B, C, Hkv, D]
    qsum = q.view(B, HKV, H // HKV, D).float().sum(dim=2)
    s = torch.einsum("bhd,bchd->bhc", qsum.to(E.dtype), E).float() * D ** -0.5
    s = s.masked_fill((torch.arange(C, device=q.device) >= n_cand[:, None])[:, None, :], float("-inf"))
    return torch.topk(s, TOPK, dim=-1)


def bench(b):
    def case(workload, seq_lens, speedup=None):
        batch = paged_batch(seq_lens)
        op = HSADecodeTileLang(**SPEC)
        out = torch.empty_like(batch["q"])
        nbytes = touched_bytes(seq_lens)

        def step():
            op(**batch, out=out, validate=False)

        ms_eager = b.time(step)
        b.row(OP, workload, "tilelang (eager launches)", ms_eager, bytes=nbytes)
        # Serving engines replay decode as a CUDA graph: the 4 launches then cost no host time.
        ms = b.time(graph_replay(step))
        b.row(OP, workload, "tilelang (CUDA graph)", ms, bytes=nbytes, ours=True)
        b.target(OP, workload, ">= 75% of copy bandwidth on touched bytes",
                 nbytes / ms * 1e-6 >= 0.75 * b.copy_gbs)
        sel = f"{workload} selection"
        args = (batch["q"], batch["page_table"], batch["seq_lens"], batch["chunk_repr"])
        ms_sel = b.time(lambda: op.select(*args, validate=False))
        b.row(OP, sel, "tilelang", ms_sel, ours=True)
        ms_torch = b.time(lambda: torch_select(*args))
        b.row(OP, sel, "torch einsum+topk", ms_torch)
        b.target(OP, sel, "selection faster than torch einsum + topk", ms_sel < ms_torch)
        del batch, out
        torch.cuda.empty_cache()
        if speedup is not None:
            B, S = len(seq_lens), seq_lens[0]
            best = sdpa_decode_peers(b, OP, workload, B, H, HKV, D, S, nbytes=2 * B * HKV * S * D * 2)
            if best is not None:
                b.target(OP, workload, f">= {speedup}x faster than the fastest dense SDPA decode", best / ms >= speedup)

    if b.quick:
        case("(a) quick: B=4, seq_len 16384", [16384] * 4, speedup=15)
        return
    case("(a) B=32, seq_len 131072", [131072] * 32, speedup=15)
    case("(b) B=8, seq_len 524288", [524288] * 8, speedup=50)
    gen = torch.Generator().manual_seed(1)
    ragged = torch.randint(1, 131073, (32,), generator=gen).tolist()
    case("(c) B=32, ragged seq_lens 1..131072", ragged)


def _shared_gpu_case(seq_lens):
    """One decode step of the bench's batch, replayed as a CUDA graph (as engines run decode)."""
    def make():
        batch = paged_batch(seq_lens)
        op = HSADecodeTileLang(**SPEC)
        out = torch.empty_like(batch["q"])
        return graph_replay(lambda: op(**batch, out=out, validate=False), keep=(batch, out))
    return make


# scripts/shared_gpu.py: the decode while another stream holds some SMs
SHARED_GPU = {"hsa_decode (a) B=32 x 131072, CUDA graph": _shared_gpu_case([131072] * 32),
              "hsa_decode (b) B=8 x 524288, CUDA graph": _shared_gpu_case([524288] * 8)}
