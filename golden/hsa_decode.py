"""Golden HSA decode (hierarchical sparse attention over SGLang's paged KV cache).

Per request b with L = seq_lens[b] tokens (scale defaults to head_dim ** -0.5):
  n_full = L // page_size complete pages; local tokens are [lo, L) with
  lo = min(max(0, L - window_size), n_full * page_size): the window, and always the incomplete last page.
  Candidates: logical pages j with (j + 1) * page_size <= lo whose repr is valid.
  Scores per kv head, E_j = chunk_repr[page_table[b, j]]:
    group: s_j = scale * (sum of the G query vectors of the group) . E_j
    head:  s_j = max over the G heads of scale * q_g . E_j
  Top-k: the min(topk, #candidates) largest s_j, ties to the smaller logical page index.
  Attention per query head h over the selected pages of its kv head plus the local tokens:
    token:   one softmax over all those tokens.
    softmax: per selected page k, o_k = softmax attention over the page, z_k = scale * q_h . E_k;
             the local tokens give o_loc, lse_loc; w = softmax([z_1..z_K, lse_loc]);
             o = sum_k w_k o_k + w_loc o_loc.
  A request with nothing to attend to (no selected page, no local token) gets o = 0.

HSA extend (``hsa_extend``): a chunk of q_len new tokens per request (packed, cum_seq_lens_q as in paged prefill),
seq_lens including them. New token i of request b sits at position p = seq_lens[b] - q_len + i and is answered
exactly as a decode of request b with seq_len p + 1 and that token's query (so causality holds, and q_len = 1 is
decode).
"""

from __future__ import annotations

import torch

STRATEGIES = ("group", "head")
COMBINES = ("softmax", "token")
REPR_MODES = ("mean", "last")


def local_range(seq_len: int, page_size: int, window_size: int) -> tuple[int, int]:
    """(n_full, lo): complete pages and the first local token of a request of ``seq_len`` tokens."""
    n_full = seq_len // page_size
    return n_full, min(max(0, seq_len - window_size), n_full * page_size)


def page_repr(k_buffer: torch.Tensor, page_ids: torch.Tensor, page_size: int, mode: str) -> torch.Tensor:
    """Representative key of each (complete) page in ``page_ids``: the mean of its keys or its last key.
    k_buffer [num_slots, num_kv_heads, head_dim] -> [len(page_ids), num_kv_heads, head_dim] in its dtype."""
    slots = page_ids.long()[:, None] * page_size + torch.arange(page_size, device=k_buffer.device)
    keys = k_buffer[slots]  # [N, page_size, Hkv, D]
    if mode == "mean":
        acc = torch.float64 if k_buffer.dtype == torch.float64 else torch.float32
        return keys.to(acc).mean(dim=1).to(k_buffer.dtype)
    if mode == "last":
        return keys[:, -1].clone()
    raise ValueError(f"mode: expected one of {list(REPR_MODES)}, got {mode!r}")


def select_pages(q, page_table, seq_lens, chunk_repr, page_size, topk, selection_strategy="group",
                 window_size=0, repr_valid=None, scale=None):
    """-> (selected_page_ids [B, Hkv, topk] int32 padded with -1, selected_scores fp32 padded with -inf),
    best first (score descending, then logical page ascending)."""
    B, Hq, D = q.shape
    Hkv = chunk_repr.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    ids = torch.full((B, Hkv, topk), -1, dtype=torch.int32, device=q.device)
    scores = torch.full((B, Hkv, topk), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(B):
        _, lo = local_range(int(seq_lens[b]), page_size, window_size)
        pids = page_table[b, :lo // page_size].long()
        if repr_valid is not None:
            pids = pids[repr_valid[pids]]
        if pids.numel() == 0:
            continue
        qg = q[b].to(acc).view(Hkv, G, D)
        E = chunk_repr[pids].to(acc)  # [C, Hkv, D]
        if selection_strategy == "group":
            s = scale * torch.einsum("hd,chd->hc", qg.sum(dim=1), E)
        elif selection_strategy == "head":
            s = (scale * torch.einsum("hgd,chd->hgc", qg, E)).amax(dim=1)
        else:
            raise ValueError(f"selection_strategy: expected one of {list(STRATEGIES)}, got {selection_strategy!r}")
        k = min(topk, pids.numel())
        # Stable descending sort: equal scores keep logical order, so ties go to the smaller page index.
        top_s, top_c = torch.sort(s, dim=1, descending=True, stable=True)
        ids[b, :, :k] = pids[top_c[:, :k]].to(torch.int32)
        scores[b, :, :k] = top_s[:, :k].float()
    return ids, scores


def _attend(q, k, v, scale):
    """Softmax attention of q [G, D] over k, v [..., N, D] (a leading axis: one softmax per chunk)
    -> (o [..., G, D], lse [..., G])."""
    s = scale * q @ k.transpose(-1, -2)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def hsa_decode(q, k_buffer, v_buffer, page_table, seq_lens, chunk_repr, page_size, topk,
               selection_strategy="group", window_size=0, combine="softmax", repr_valid=None,
               selected_page_ids=None, scale=None):
    """-> (o [B, num_heads, head_dim] in q's dtype, selected_page_ids, selected_scores).
    Given ``selected_page_ids``, selection is skipped (scores are then None). Computes in fp32
    (fp64 when q is fp64)."""
    if combine not in COMBINES:
        raise ValueError(f"combine: expected one of {list(COMBINES)}, got {combine!r}")
    B, Hq, D = q.shape
    Hkv = chunk_repr.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    scores = None
    if selected_page_ids is None:
        selected_page_ids, scores = select_pages(q, page_table, seq_lens, chunk_repr, page_size, topk,
                                                 selection_strategy, window_size, repr_valid, scale)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = torch.zeros(B, Hkv, G, D, dtype=acc, device=q.device)
    offs = torch.arange(page_size, device=q.device)
    for b in range(B):
        L = int(seq_lens[b])
        _, lo = local_range(L, page_size, window_size)
        tok = torch.arange(lo, L, device=q.device)
        local_slots = page_table[b, tok // page_size].long() * page_size + tok % page_size
        for h in range(Hkv):
            qh = q[b, h * G:(h + 1) * G].to(acc)
            pids = selected_page_ids[b, h]
            pids = pids[pids >= 0].long()
            page_slots = (pids[:, None] * page_size + offs).reshape(-1)
            if combine == "token":
                slots = torch.cat([page_slots, local_slots])
                if slots.numel():
                    o[b, h] = _attend(qh, k_buffer[slots, h].to(acc), v_buffer[slots, h].to(acc), scale)[0]
                continue
            # each selected page on its own (one softmax per page), its logit z_k = scale * q . E_k
            shape = (pids.numel(), page_size, D)
            o_sel, _ = _attend(qh, k_buffer[page_slots, h].to(acc).view(shape),
                               v_buffer[page_slots, h].to(acc).view(shape), scale)  # [K, G, D]
            outs, logits = [o_sel], [scale * chunk_repr[pids, h].to(acc) @ qh.t()]  # [K, G]
            if local_slots.numel():
                o_loc, lse_loc = _attend(qh, k_buffer[local_slots, h].to(acc), v_buffer[local_slots, h].to(acc), scale)
                outs.append(o_loc[None])
                logits.append(lse_loc[None])
            outs, logits = torch.cat(outs), torch.cat(logits)  # [chunks, G, D], [chunks, G]
            if outs.shape[0]:
                w = torch.softmax(logits, dim=0)  # over the chunks, per query head
                o[b, h] = torch.einsum("cg,cgd->gd", w, outs)
    return o.view(B, Hq, D).to(q.dtype), selected_page_ids, scores


def extend_rows(seq_lens, cum_seq_lens_q):
    """Each new token of an extend batch as a decode row: (its request [total_q] int64, its decode seq_len p + 1
    [total_q] int32)."""
    q_lens = (cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]).long()
    req = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q_lens.device), q_lens)
    first = cum_seq_lens_q[:-1].long()[req]
    pos = seq_lens.long()[req] - q_lens[req] + torch.arange(req.numel(), device=req.device) - first
    return req, (pos + 1).to(torch.int32)


def hsa_extend(q, k_buffer, v_buffer, page_table, seq_lens, cum_seq_lens_q, chunk_repr, page_size, topk,
               selection_strategy="group", window_size=0, combine="softmax", repr_valid=None, scale=None,
               selected_page_ids=None):
    """-> (o [total_q, num_heads, head_dim] in q's dtype, selected_page_ids [total_q, Hkv, topk], selected_scores):
    every new token through ``hsa_decode`` as its own request (see the module docstring); given
    ``selected_page_ids``, selection is skipped (scores are then None)."""
    req, row_lens = extend_rows(seq_lens, cum_seq_lens_q)
    return hsa_decode(q, k_buffer, v_buffer, page_table[req], row_lens, chunk_repr, page_size, topk,
                      selection_strategy, window_size, combine, repr_valid, selected_page_ids, scale)


def random_case(seq_lens, num_heads, num_kv_heads, head_dim, page_size, dtype=torch.float32, device="cpu",
                spare_pages=3, invalid_frac=0.0, generator=None):
    """A random paged-KV decode batch: physical pages shuffled across requests (plus ``spare_pages``
    unused ones), page_table padded with -1 past each request's pages, chunk_repr the mean of each page's
    keys (garbage rows for the incomplete last pages, which are never candidates), and repr_valid with
    about ``invalid_frac`` of the pages stale. Returns a dict of the op's inputs."""
    seq = torch.as_tensor(seq_lens, dtype=torch.int32)
    pages_per = [(int(L) + page_size - 1) // page_size for L in seq]
    max_pages = max(pages_per)
    num_pages = sum(pages_per) + spare_pages
    perm = torch.randperm(num_pages, generator=generator).to(torch.int32)
    page_table = torch.full((len(seq), max_pages), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_per):
        page_table[b, :n] = perm[start:start + n]
        start += n
    kv = dict(dtype=torch.float32)
    q = torch.randn(len(seq), num_heads, head_dim, generator=generator, **kv)
    k_buffer = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=generator, **kv)
    v_buffer = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=generator, **kv)
    # Keys share a per-page offset so that page reprs (and so the scores) are well separated.
    k_buffer += 2 * torch.randn(num_pages, 1, num_kv_heads, head_dim, generator=generator).repeat_interleave(
        page_size, dim=0).view_as(k_buffer)
    k_buffer, v_buffer, q = (t.to(dtype) for t in (k_buffer, v_buffer, q))
    chunk_repr = page_repr(k_buffer, torch.arange(num_pages), page_size, "mean")
    repr_valid = torch.rand(num_pages, generator=generator) >= invalid_frac
    case = dict(q=q, k_buffer=k_buffer, v_buffer=v_buffer, page_table=page_table, seq_lens=seq,
                chunk_repr=chunk_repr, repr_valid=repr_valid)
    return {k: v.to(device) for k, v in case.items()}
