"""The forward's single pass (`mhc_pre_fused`): x is read from memory once.

A cluster of 16 CTAs owns a tile of 64 tokens, each CTA D / 16 columns of every stream. A producer
warpgroup streams the CTA's x chunks by TMA into a ring that holds the whole share (plus slack for the
next tile) and phi's chunks (from L2) into a shallower ring; the consumer warpgroup accumulates its
partial h_mix = x @ phi^T on bf16 tensor cores (phi split into bf16 hi + lo parts: ~16 mantissa bits,
more than TF32) and the sum of squares, exchanges partials with the other 15 CTAs through distributed
shared memory (a reduce-scatter, then an all-gather of h_pre), and writes h_in = sum_i h_pre[i] * x[i, :]
from the chunks still in shared memory. Clusters are persistent, as many as the GPU holds at once."""

from ...common import runtime  # noqa: F401  (the kernel cache dir before TileLang is imported)
from ..tiling import _CLUSTER, _FUSED_K, _FUSED_T, fused_chunks, phi_split_rows
from . import weights

import tilelang.language as T  # noqa: E402


def mhc_pre_fused_kernel(n: int, D: int, rms_eps: float, hc_eps: float, x_slots: int, phi_stages: int):
    """Single pass over x (see this module's docstring). `x_slots` >= a tile's chunks, the rest is slack
    for the next tile's loads; `phi_stages` deep phi ring (its chunks come from L2)."""
    N, NG = n * n + 2 * n, phi_split_rows(n)
    C, block_t, block_k = _CLUSTER, _FUSED_T, _FUSED_K
    G = block_t // C  # rank r of the cluster finishes tokens [r*G, (r+1)*G) of a tile
    NP = NG + 4  # a partial row: h_mix columns, then the sum of squares (16-byte rows for the bulk copies)
    Ds, Q = D // C, fused_chunks(n, D)
    kcs = Ds // block_k  # chunks per stream; chunk q of a tile is stream q // kcs
    R, PS = x_slots, phi_stages
    num_tokens = T.dynamic("num_tokens")

    @T.macro
    def load_tile(X, PhiHi, PhiLo, xs, hi_s, lo_s, x_full, x_free, p_full, p_free, tx, d_base, k, t0):
        """Producer warpgroup, tile k (tokens t0..): one warp loads its x chunks into the x ring, one phi's
        chunks into the phi ring, each in ring order."""
        for q in T.serial(Q):
            seq = k * Q + q
            i, d0 = q // kcs, d_base + (q % kcs) * block_k
            # x is read once: it should not push phi (re-read by every tile) out of L2.
            if tx < 160:
                T.barrier_wait(x_free[seq % R], (seq // R) % 2 ^ 1)
                T.tma_copy(X[t0:t0 + block_t, i, d0:d0 + block_k], xs[seq % R, :, :],
                           barrier=x_full[seq % R], eviction_policy="evict_first")
                T.barrier_arrive(x_full[seq % R])
            elif tx < 192:
                T.barrier_wait(p_free[seq % PS], (seq // PS) % 2 ^ 1)
                T.tma_copy(PhiHi[:, i, d0:d0 + block_k], hi_s[seq % PS, :, :], barrier=p_full[seq % PS],
                           eviction_policy="evict_last")
                T.tma_copy(PhiLo[:, i, d0:d0 + block_k], lo_s[seq % PS, :, :], barrier=p_full[seq % PS],
                           eviction_policy="evict_last")
                T.barrier_arrive(p_full[seq % PS])

    @T.macro
    def partials(xs, hi_s, lo_s, x_full, p_full, p_free, acc, sq, sumsq, k):
        """Consumer, tile k, phase 1: this CTA's share of h_mix and of the sum of squares, its Ds columns of
        every stream."""
        T.clear(acc)
        T.clear(sq)
        for q in T.serial(Q):
            seq = k * Q + q
            T.barrier_wait(x_full[seq % R], (seq // R) % 2)
            for t, kk in T.Parallel(block_t, block_k):
                sq[t, kk] += T.cast(xs[seq % R, t, kk], "float32") * T.cast(xs[seq % R, t, kk], "float32")
            T.barrier_wait(p_full[seq % PS], (seq // PS) % 2)
            T.wgmma_gemm(xs[seq % R, :, :], hi_s[seq % PS, :, :], acc, transpose_B=True,
                         policy=T.GemmWarpPolicy.FullRow)
            T.wgmma_gemm(xs[seq % R, :, :], lo_s[seq % PS, :, :], acc, transpose_B=True,
                         policy=T.GemmWarpPolicy.FullRow)
            # The previous chunk's two products are done (this chunk's stay in flight
            # while the next chunk's sum of squares runs): its phi stage is free.
            T.wait_wgmma(2)
            if q > 0:
                T.barrier_arrive(p_free[(seq - 1) % PS])
        T.wait_wgmma(0)
        T.barrier_arrive(p_free[(k * Q + Q - 1) % PS])
        T.reduce_sum(sq, sumsq, dim=1)

    @T.macro
    def exchange(Alpha, Bias, HPost, HRes, InvRms, HPre, HMix, acc, sumsq, part, recv, hpre_own, hpre, landed, rank, k,
                 t0):
        """Consumer, tile k, phase 2: a reduce-scatter through distributed shared memory. Rank r receives every
        rank's partial rows of its G tokens (bulk copies completing on its barrier), sums them in rank order
        (deterministic), finishes those tokens and sends their h_pre to every rank. Tile k+1's partials go
        out only after every rank has all of tile k's h_pre, which orders the reuse of these buffers."""
        T.copy(acc, part[:, 0:NG])
        for t in T.Parallel(block_t):
            part[t, NG] = sumsq[t]
        T.fence_proxy_async()  # generic-proxy writes read next by the bulk-copy engine
        T.sync_threads(1, 128)
        for r in T.unroll(C):
            T.copy_cluster(part[r * G:(r + 1) * G, :], recv[rank, :, :], dst_block=r,
                           remote_barrier=landed[0])
        T.barrier_wait(landed[0], k % 2)
        for g, j in T.Parallel(G, NG):
            t = t0 + rank * G + g
            mix = sum(recv[r, g, j] for r in range(C))
            inv_rms = weights.inv_rms(sum(recv[r, g, NG] for r in range(C)), n, D, rms_eps)
            if j < n:
                hpre_own[g, j] = weights.h_pre(Alpha, inv_rms, mix, Bias[j], hc_eps)
            if t < num_tokens:
                if j < N:
                    HMix[t, j] = mix
                if j == 0:
                    InvRms[t] = inv_rms
                if j < n:
                    HPre[t, j] = weights.h_pre(Alpha, inv_rms, mix, Bias[j], hc_eps)
                elif j < 2 * n:
                    HPost[t, j - n] = weights.h_post(Alpha, inv_rms, mix, Bias[j])
                elif j < N:
                    HRes[t, j - 2 * n] = weights.h_res_logit(Alpha, inv_rms, mix, Bias[j])
        T.fence_proxy_async()
        T.sync_threads(1, 128)
        for r in T.unroll(C):
            T.copy_cluster(hpre_own, hpre[rank * G:(rank + 1) * G, :], dst_block=r,
                           remote_barrier=landed[1])
        T.barrier_wait(landed[1], k % 2)

    @T.macro
    def write_h_in(HIn, xs, x_free, hpre, out_f, out, d_base, k, t0):
        """Consumer, tile k, phase 3: h_in over this CTA's columns from the resident chunks, each ring slot
        freed for the next tile's loads as soon as it has been used."""
        for c in T.serial(kcs):
            for t, d in T.Parallel(block_t, block_k):
                out_f[t, d] = sum(hpre[t, i] * T.cast(xs[(k * Q + i * kcs + c) % R, t, d], "float32")
                                  for i in range(n))
            # The slots' shared loads above feed registers only: without the fence they may
            # still be in flight when the slots go back and the next TMA write lands.
            T.fence_proxy_async()
            for i in T.unroll(n):
                T.barrier_arrive(x_free[(k * Q + i * kcs + c) % R])
            T.copy(out_f, out)
            T.copy(out, HIn[t0:t0 + block_t, d_base + c * block_k:d_base + (c + 1) * block_k])

    @T.prim_func
    def mhc_pre_fused(
        X: T.Tensor((num_tokens, n, D), "bfloat16"),
        PhiHi: T.Tensor((NG, n, D), "bfloat16"),
        PhiLo: T.Tensor((NG, n, D), "bfloat16"),
        Alpha: T.Tensor((3,), "float32"),
        Bias: T.Tensor((N,), "float32"),
        HIn: T.Tensor((num_tokens, D), "bfloat16"),
        HPost: T.Tensor((num_tokens, n), "float32"),
        HRes: T.Tensor((num_tokens, n * n), "float32"),
        InvRms: T.Tensor((num_tokens,), "float32"),
        HPre: T.Tensor((num_tokens, n), "float32"),
        HMix: T.Tensor((num_tokens, N), "float32"),
        num_clusters: T.int32,
    ):
        num_tiles = T.ceildiv(num_tokens, block_t)
        clusters = T.min(num_tiles, num_clusters)
        with T.Kernel(C, clusters, threads=256, cluster_dims=(C, 1, 1)) as (rank, cid):
            xs = T.alloc_shared((R, block_t, block_k), "bfloat16")
            hi_s = T.alloc_shared((PS, NG, block_k), "bfloat16")
            lo_s = T.alloc_shared((PS, NG, block_k), "bfloat16")
            x_full = T.alloc_barrier([32] * R)  # the loading warp arrives, TMA bytes complete it
            x_free = T.alloc_barrier([128] * R)  # consumer threads arrive once the tile's h_in used it
            p_full = T.alloc_barrier([32] * PS)
            p_free = T.alloc_barrier([128] * PS)
            landed = T.alloc_cluster_barrier([C, C])  # partials, then h_pre, from every rank
            acc = T.alloc_fragment((block_t, NG), "float32")
            sq = T.alloc_fragment((block_t, block_k), "float32")
            sumsq = T.alloc_fragment((block_t,), "float32")
            part = T.alloc_shared((block_t, NP), "float32")
            recv = T.alloc_shared((C, G, NP), "float32")
            hpre_own = T.alloc_shared((G, n), "float32")
            hpre = T.alloc_shared((block_t, n), "float32")
            out_f = T.alloc_fragment((block_t, block_k), "float32")
            out = T.alloc_fragment((block_t, block_k), "bfloat16")
            tx = T.get_thread_binding()
            d_base = rank * Ds
            my_tiles = T.ceildiv(num_tiles - cid, clusters)  # tiles cid, cid + clusters, ...
            # TileLang launches clusters with programmatic stream serialization allowed, so this grid may
            # start before the phi split kernel has finished; only this wait makes its output visible.
            T.pdl_sync()
            # The side kernel launched behind this one (other tokens, on the SMs no cluster took) may start.
            T.pdl_trigger()

            if tx >= 128:  # producer warpgroup: one warp loads x chunks, one phi's, each in ring order
                T.set_max_nreg(24, 0)
                for k in T.serial(my_tiles):
                    t0 = (cid + k * clusters) * block_t
                    load_tile(X, PhiHi, PhiLo, xs, hi_s, lo_s, x_full, x_free, p_full, p_free, tx, d_base, k, t0)
            else:  # consumer warpgroup
                T.set_max_nreg(240, 1)
                for k in T.serial(my_tiles):
                    t0 = (cid + k * clusters) * block_t
                    partials(xs, hi_s, lo_s, x_full, p_full, p_free, acc, sq, sumsq, k)
                    exchange(Alpha, Bias, HPost, HRes, InvRms, HPre, HMix, acc, sumsq, part, recv, hpre_own, hpre,
                             landed, rank, k, t0)
                    write_h_in(HIn, xs, x_free, hpre, out_f, out, d_base, k, t0)
            # No CTA exits while a bulk copy may still read or write its shared memory: every copy to
            # a rank has landed once that rank's last wait returned.
            T.cluster_sync()

    return mhc_pre_fused
