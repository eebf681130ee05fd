"""mHC pre forward (`MHCForwardPreTileLang`).

Single pass (`mhc_pre_fused`, shapes where `fused_fits`): x is read from memory once. A cluster of 16
CTAs owns a tile of 64 tokens, each CTA D / 16 columns of every stream. A producer warpgroup streams
the CTA's x chunks by TMA into a ring that holds the whole share (plus slack for the next tile) and
phi's chunks (from L2) into a shallower ring; the consumer warpgroup accumulates its partial h_mix =
x @ phi^T on bf16 tensor cores (phi split into bf16 hi + lo parts: ~16 mantissa bits, more than TF32)
and the sum of squares, exchanges partials with the other 15 CTAs through distributed shared memory
(a reduce-scatter, then an all-gather of h_pre), and writes h_in = sum_i h_pre[i] * x[i, :] from the
chunks still in shared memory. Clusters are persistent, as many as the GPU holds at once. That leaves SMs
idle (20 of an H100's or H200's 132: 7 clusters of 16 fit), so at large token counts the last tokens
(`side_tokens`) go to a side kernel (`mhc_pre_mix` with `apply`: one CTA per 128-token tile, x read twice)
on those SMs. It is launched right behind the single pass, which lets it start at once (programmatic
dependent launch: the single pass triggers at its start).

Two kernels (other shapes; x is read twice):
1. `mhc_pre_mix`: per tile of `block_t` tokens, the full n*D reduction, pipelined over K, with the sum
   of squares from the same tiles; its epilogue writes h_pre, h_post, h_res and inv_rms.
2. `mhc_pre_apply`: h_in = sum_i h_pre[i] * x[i, :], a bandwidth-bound pass.
"""

import torch

from ._runtime import (check_choice, check_int, check_tensor, compile_kernel, max_active_clusters,
                       resolve_config, sm_count)

import tilelang.language as T  # noqa: E402  (after _runtime set the cache dir)

_D_PAD = 256  # phi's split copy pads D to a multiple of this, so every K-chunk reads in bounds
_SIDE_D = 64  # columns per h_in chunk of the side kernel
_MIX_CONFIG = {"block_t": 128, "block_k": 128, "num_stages": 3, "threads": 256}  # measured best (H200)
# The side kernel is not the critical path: a shallower ring leaves more bandwidth to the single pass.
_SIDE_CONFIG = dict(_MIX_CONFIG, num_stages=2)
_SIDE_ROUND_COST = 11650  # tokens of the single pass as long as one side tile (x read twice) on an idle SM


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def phi_split_rows(n: int) -> int:
    """Rows NG of phi's split copy: n*n+2n padded to a multiple of 16, the widest tensor-core N that
    TileLang issues as one wgmma (24 rows ran as three n8 instructions: 1.5x slower mix kernel)."""
    return _round_up(n * n + 2 * n, 16)


def _thread_choices(block_t: int) -> list[int]:
    """Threads of the mix kernel for a token tile: at most one warpgroup per 64 tokens (a wgmma's M)."""
    return [t for t in (128, 256) if t <= 2 * block_t]


def mhc_phi_split_kernel(n: int, D: int, block_d: int = _D_PAD, threads: int = 128):
    """phi fp32 [N, n*D] -> bf16 hi and lo parts [NG, n, Dp], NG = phi_split_rows(n) and Dp = D rounded
    up to _D_PAD: rows N..NG-1 and columns D..Dp-1 are zero."""
    N, NG = n * n + 2 * n, phi_split_rows(n)
    Dp = _round_up(D, _D_PAD)

    @T.prim_func
    def mhc_phi_split(Phi: T.Tensor((N, n * D), "float32"), PhiHi: T.Tensor((NG, n, Dp), "bfloat16"),
                      PhiLo: T.Tensor((NG, n, Dp), "bfloat16")):
        with T.Kernel(Dp // block_d, n, NG, threads=threads) as (bd, i, r):
            for d in T.Parallel(block_d):
                col = bd * block_d + d
                v = T.if_then_else(r < N and col < D, Phi[T.min(r, N - 1), i * D + T.min(col, D - 1)],
                                   T.float32(0))
                hi = T.cast(v, "bfloat16")
                PhiHi[r, i, col] = hi
                PhiLo[r, i, col] = T.cast(v - T.cast(hi, "float32"), "bfloat16")

    return mhc_phi_split


def mix_smem_bytes(n: int, block_t: int, block_k: int, num_stages: int, **_) -> int:
    """Shared memory of `mhc_pre_mix`: the x tile and phi's two parts, once per pipeline stage (TileLang
    overlays the epilogue's buffers on them; checked against its allocation)."""
    return num_stages * (block_t + 2 * phi_split_rows(n)) * block_k * 2


def mhc_pre_mix_kernel(n: int, D: int, rms_eps: float, hc_eps: float,
                       block_t: int = 128, block_k: int = 128, num_stages: int = 2, threads: int = 256,
                       apply: bool = False):
    """Per tile of `block_t` tokens: h_pre, h_post, h_res and inv_rms; with `apply` also h_in, from x read
    a second time (the side kernel of the single pass, see MHCForwardPreTileLang)."""
    N, NG = n * n + 2 * n, phi_split_rows(n)
    d_chunks = _round_up(D, _D_PAD) // block_k  # phi's copy is padded with zeros past D
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_mix(
        X: T.Tensor((num_tokens, n, D), "bfloat16"),
        PhiHi: T.Tensor((NG, n, _round_up(D, _D_PAD)), "bfloat16"),
        PhiLo: T.Tensor((NG, n, _round_up(D, _D_PAD)), "bfloat16"),
        Alpha: T.Tensor((3,), "float32"),
        Bias: T.Tensor((N,), "float32"),
        HPost: T.Tensor((num_tokens, n), "float32"),
        HRes: T.Tensor((num_tokens, n * n), "float32"),
        InvRms: T.Tensor((num_tokens,), "float32"),
        HPre: T.Tensor((num_tokens, n), "float32"),
        HMix: T.Tensor((num_tokens, N), "float32"),
        HIn: T.Tensor((num_tokens, D), "bfloat16"),  # written only with `apply`
    ):
        with T.Kernel(T.ceildiv(num_tokens, block_t), threads=threads) as bx:
            xs = T.alloc_shared((block_t, block_k), "bfloat16")
            hi_s = T.alloc_shared((NG, block_k), "bfloat16")
            lo_s = T.alloc_shared((NG, block_k), "bfloat16")
            acc = T.alloc_fragment((block_t, NG), "float32")
            sq = T.alloc_fragment((block_t, block_k), "float32")
            sumsq = T.alloc_fragment((block_t,), "float32")
            mix_s = T.alloc_shared((block_t, NG), "float32")
            sumsq_s = T.alloc_shared((block_t,), "float32")
            t0 = bx * block_t

            T.clear(acc)
            T.clear(sq)
            for kc in T.Pipelined(n * d_chunks, num_stages=num_stages):
                i, d0 = kc // d_chunks, (kc % d_chunks) * block_k
                T.copy(X[t0:t0 + block_t, i, d0:d0 + block_k], xs)
                T.copy(PhiHi[:, i, d0:d0 + block_k], hi_s)
                T.copy(PhiLo[:, i, d0:d0 + block_k], lo_s)
                # The squares first, then a proxy fence: TileLang releases xs to the TMA producer after its
                # last reader (the products), and ptxas may issue that release with these shared loads
                # still in flight; the fence orders them before the next tile's TMA write (docs/perf.md,
                # mHC backward). Summed per element, reduced over the row once after the loop (a
                # reduction per chunk made the kernel issue-bound).
                for t, k in T.Parallel(block_t, block_k):
                    sq[t, k] += T.cast(xs[t, k], "float32") * T.cast(xs[t, k], "float32")
                T.fence_proxy_async()
                # Warps split the tokens only, so each wgmma spans all NG columns.
                T.gemm(xs, hi_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.gemm(xs, lo_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.reduce_sum(sq, sumsq, dim=1)

            # Through shared memory: the epilogue pairs each h_mix entry with its token's sum of squares.
            T.copy(acc, mix_s)
            for t in T.Parallel(block_t):
                sumsq_s[t] = sumsq[t]
            hpre_s = T.alloc_shared((block_t, n), "float32") if apply else None  # h_pre kept for h_in
            T.sync_threads()
            for t, r in T.Parallel(block_t, NG):
                if t0 + t < num_tokens and r < N:
                    inv_rms = T.rsqrt(sumsq_s[t] / (n * D) + rms_eps)
                    HMix[t0 + t, r] = mix_s[t, r]
                    if r == 0:
                        InvRms[t0 + t] = inv_rms
                    if r < n:
                        h_pre = T.sigmoid(Alpha[0] * inv_rms * mix_s[t, r] + Bias[r]) + hc_eps
                        HPre[t0 + t, r] = h_pre
                        if apply:
                            hpre_s[t, r] = h_pre
                    elif r < 2 * n:
                        HPost[t0 + t, r - n] = 2 * T.sigmoid(Alpha[1] * inv_rms * mix_s[t, r] + Bias[r])
                    else:
                        HRes[t0 + t, r - 2 * n] = Alpha[2] * inv_rms * mix_s[t, r] + Bias[r]
            if apply:
                x_f = T.alloc_fragment((n, block_t, _SIDE_D), "bfloat16")
                out_f = T.alloc_fragment((block_t, _SIDE_D), "float32")
                out = T.alloc_fragment((block_t, _SIDE_D), "bfloat16")
                T.sync_threads()  # hpre_s is complete
                for c in T.serial(T.ceildiv(D, _SIDE_D)):
                    _apply_tile(X, hpre_s, x_f, out_f, out, HIn, t0, c * _SIDE_D, n, block_t, _SIDE_D)
                # Launched right behind the single pass, whose CTAs let it start early (T.pdl_trigger);
                # this wait (for the single pass to finish, with nothing left to do) is what makes TileLang
                # launch it that way.
                T.pdl_sync()

    return mhc_pre_mix


_CLUSTER = 16  # CTAs per token tile (the largest cluster Hopper allows): each owns D / 16 columns
_FUSED_T = 64  # tokens per tile: one wgmma M; phi (re-read per tile from L2) then costs as much as x
_FUSED_K = 64  # columns per chunk: one 128-byte swizzled row per token
_SMEM_BUDGET = 232448 - 2048  # Hopper's opt-in dynamic shared memory per block, less barriers and slack


def fused_smem_bytes(n: int, x_slots: int, phi_stages: int) -> int:
    """Shared memory of `mhc_pre_fused` (the x ring, phi's stages and the exchange buffers)."""
    NG, G = phi_split_rows(n), _FUSED_T // _CLUSTER
    return (x_slots * _FUSED_T * _FUSED_K * 2 + phi_stages * 2 * NG * _FUSED_K * 2
            + (_FUSED_T + _CLUSTER * G) * (NG + 4) * 4 + (G + _FUSED_T) * n * 4)


def fused_chunks(n: int, D: int) -> int:
    """x chunks of a tile per CTA: n streams of D / 16 columns, _FUSED_K at a time."""
    return n * D // (_CLUSTER * _FUSED_K)


def fused_fits(n: int, D: int) -> bool:
    """Whether the single-pass kernel runs: D splits into 16 whole column slices, a CTA's share of a
    tile (it stays in shared memory until h_in is written) is large enough to pay for the per-tile
    exchange (>= 8 chunks), and it fits with a slack slot beside 8 phi stages (shallower phi rings
    starve it). H100, 16384 tokens, against the two kernels: n*D = 16384 1.31-1.37x, n=4 D=2048 1.1x;
    n=2 D=2048 (4 chunks) 0.84x, n=8 D=1024 (5 phi stages) 0.85x."""
    Q = fused_chunks(n, D)
    return D % (_CLUSTER * _FUSED_K) == 0 and Q >= 8 and fused_smem_bytes(n, Q + 1, 8) <= _SMEM_BUDGET


def mhc_pre_fused_kernel(n: int, D: int, rms_eps: float, hc_eps: float, x_slots: int, phi_stages: int):
    """Single pass over x (see the module docstring). `x_slots` >= a tile's chunks, the rest is slack
    for the next tile's loads; `phi_stages` deep phi ring (its chunks come from L2)."""
    N, NG = n * n + 2 * n, phi_split_rows(n)
    C, block_t, block_k = _CLUSTER, _FUSED_T, _FUSED_K
    G = block_t // C  # rank r of the cluster finishes tokens [r*G, (r+1)*G) of a tile
    NP = NG + 4  # a partial row: h_mix columns, then the sum of squares (16-byte rows for the bulk copies)
    Ds, Q = D // C, fused_chunks(n, D)
    kcs = Ds // block_k  # chunks per stream; chunk q of a tile is stream q // kcs
    R, PS = x_slots, phi_stages
    num_tokens = T.dynamic("num_tokens")

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
            else:  # consumer warpgroup
                T.set_max_nreg(240, 1)
                for k in T.serial(my_tiles):
                    t0 = (cid + k * clusters) * block_t

                    # 1. This CTA's share of h_mix and of the sum of squares: its Ds columns of every stream.
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

                    # 2. Reduce-scatter through distributed shared memory: rank r receives every rank's
                    # partial rows of its G tokens (bulk copies completing on its barrier), sums them in
                    # rank order (deterministic), finishes those tokens and sends their h_pre to every
                    # rank. Tile k+1's partials go out only after every rank has all of tile k's h_pre,
                    # which orders the reuse of these buffers.
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
                        inv_rms = T.rsqrt(sum(recv[r, g, NG] for r in range(C)) / (n * D) + rms_eps)
                        if j < n:
                            hpre_own[g, j] = T.sigmoid(Alpha[0] * inv_rms * mix + Bias[j]) + hc_eps
                        if t < num_tokens:
                            if j < N:
                                HMix[t, j] = mix
                            if j == 0:
                                InvRms[t] = inv_rms
                            if j < n:
                                HPre[t, j] = T.sigmoid(Alpha[0] * inv_rms * mix + Bias[j]) + hc_eps
                            elif j < 2 * n:
                                HPost[t, j - n] = 2 * T.sigmoid(Alpha[1] * inv_rms * mix + Bias[j])
                            elif j < N:
                                HRes[t, j - 2 * n] = Alpha[2] * inv_rms * mix + Bias[j]
                    T.fence_proxy_async()
                    T.sync_threads(1, 128)
                    for r in T.unroll(C):
                        T.copy_cluster(hpre_own, hpre[rank * G:(rank + 1) * G, :], dst_block=r,
                                       remote_barrier=landed[1])
                    T.barrier_wait(landed[1], k % 2)

                    # 3. h_in over this CTA's columns from the resident chunks, each ring slot freed for
                    # the next tile's loads as soon as it has been used.
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
            # No CTA exits while a bulk copy may still read or write its shared memory: every copy to
            # a rank has landed once that rank's last wait returned.
            T.cluster_sync()

    return mhc_pre_fused


def side_tokens(tokens: int, idle_sms: int) -> int:
    """Tokens the side kernel takes beside the single pass: whole rounds of one tile per idle SM, as many
    as keep both ending together. A round costs as long as the single pass takes for _SIDE_ROUND_COST
    tokens (H200, n=4, D=4096 and 2048, 16384 tokens: 316.8 -> 276.5 us with one round; at 8192 tokens a
    round made it slower, 168.9 -> 225.1 us). Both times scale with D, so the ratio holds across D."""
    per_round = idle_sms * _SIDE_CONFIG["block_t"]
    return tokens // (per_round + _SIDE_ROUND_COST) * per_round if per_round > 0 else 0


def mhc_pre_apply_kernel(n: int, D: int, block_t: int = 16, block_d: int = 256, threads: int = 128):
    num_tokens = T.dynamic("num_tokens")

    @T.prim_func
    def mhc_pre_apply(
        X: T.Tensor((num_tokens, n, D), "bfloat16"),
        HPre: T.Tensor((num_tokens, n), "float32"),
        HIn: T.Tensor((num_tokens, D), "bfloat16"),
    ):
        with T.Kernel(T.ceildiv(D, block_d), T.ceildiv(num_tokens, block_t), threads=threads) as (bd, bt):
            hpre_s = T.alloc_shared((block_t, n), "float32")
            x_f = T.alloc_fragment((n, block_t, block_d), "bfloat16")
            out_f = T.alloc_fragment((block_t, block_d), "float32")
            out = T.alloc_fragment((block_t, block_d), "bfloat16")
            t0, d0 = bt * block_t, bd * block_d

            T.copy(HPre[t0:t0 + block_t, :], hpre_s)
            _apply_tile(X, hpre_s, x_f, out_f, out, HIn, t0, d0, n, block_t, block_d)

    return mhc_pre_apply


@T.macro
def _apply_tile(X, hpre_s, x_f, out_f, out, HIn, t0, d0, n, block_t, block_d):
    """h_in[t0:t0 + block_t, d0:d0 + block_d] = sum_i h_pre[:, i] * x[:, i, d0:d0 + block_d]."""
    for i in T.unroll(n):  # every stream's loads in flight before the first use
        T.copy(X[t0:t0 + block_t, i, d0:d0 + block_d], x_f[i, :, :])
    T.clear(out_f)
    for i in T.unroll(n):
        for t, d in T.Parallel(block_t, block_d):
            out_f[t, d] += hpre_s[t, i] * T.cast(x_f[i, t, d], "float32")
    T.copy(out_f, out)
    T.copy(out, HIn[t0:t0 + block_t, d0:d0 + block_d])


class MHCForwardPreTileLang:
    """mHC pre forward: ``op(x, phi, alpha, bias) -> (h_in, h_post, h_res)``; see golden/mhc_pre.py.

    x [B, S, n, D] bf16, phi [n*n+2n, n*D] fp32, alpha [3] fp32, bias [n*n+2n] fp32 (CUDA, contiguous).
    B and S are free at call time (one compiled kernel serves any number of tokens); n and D are fixed
    at construction. ``return_aux=True`` also returns inv_rms [B, S], h_pre [B, S, n] and h_mix
    [B, S, n*n+2n] (x @ phi^T before the inv_rms scale; fp32), which the backward needs. The matmul runs on bf16 tensor cores with phi split into hi + lo bf16 parts.
    Shapes where the single pass measured faster (`fused_fits`) run it (with the side kernel beside it at
    large token counts); the others run the two kernels.
    The config keys differ accordingly (`default_config`).
    """

    op_name = "mhc_pre"

    @staticmethod
    def default_config(n: int, D: int) -> dict:
        if not fused_fits(n, D):
            return dict(_MIX_CONFIG)
        # 8 phi stages (its chunks come from L2; depth measured to matter more than x's slack), then up
        # to a tile of slack for the next tile's x.
        Q = fused_chunks(n, D)
        x_slots = max(r for r in range(Q + 1, 2 * Q + 1) if fused_smem_bytes(n, r, 8) <= _SMEM_BUDGET)
        return {"x_slots": x_slots, "phi_stages": 8}

    @staticmethod
    def config_space(n: int, D: int, **_) -> list[dict]:
        if fused_fits(n, D):
            Q = fused_chunks(n, D)
            return [dict(x_slots=r, phi_stages=s) for r in (Q, Q + 1, Q + 2) for s in range(2, 9)
                    if fused_smem_bytes(n, r, s) <= _SMEM_BUDGET]
        return [dict(block_t=bt, block_k=bk, num_stages=st, threads=th)
                for bt in (64, 128) for bk in (64, 128) for st in (2, 3, 4) for th in _thread_choices(bt)
                if mix_smem_bytes(n, bt, bk, st) <= _SMEM_BUDGET]

    @property
    def tunable_kernel(self):
        return mhc_pre_mix_kernel if self._fused is None else mhc_pre_fused_kernel

    def __init__(self, B: int, S: int, n: int, D: int, rms_eps: float = 1e-6, hc_eps: float = 1e-6,
                 config: dict | None = None):
        check_int("B", B, lo=1)
        check_int("S", S, lo=1)
        check_int("n", n, lo=1, hi=8)
        check_int("D", D, lo=8, hi=16384, multiple_of=8)
        for name, eps in (("rms_eps", rms_eps), ("hc_eps", hc_eps)):
            if not isinstance(eps, (int, float)) or eps < 0:
                raise ValueError(f"{name}: expected a float >= 0, got {eps!r}")
        self.n, self.D = n, D
        self.spec = {"n": n, "D": D, "rms_eps": float(rms_eps), "hc_eps": float(hc_eps)}
        self.config = resolve_config(self.op_name, self.spec, config, self.default_config(n, D))
        fused = fused_fits(n, D)
        if fused:
            check_int("config['x_slots']", self.config["x_slots"], lo=fused_chunks(n, D))
            check_int("config['phi_stages']", self.config["phi_stages"], lo=2)
            smem = fused_smem_bytes(n, **self.config)
        else:
            check_int("config['block_t']", self.config["block_t"], lo=64, hi=128, multiple_of=64)
            check_int("config['block_k']", self.config["block_k"], lo=64, hi=_D_PAD, multiple_of=64)
            check_int("config['num_stages']", self.config["num_stages"], lo=1, hi=4)
            check_choice("config['threads']", self.config["threads"], _thread_choices(self.config["block_t"]))
            smem = mix_smem_bytes(n, **self.config)
        if smem > _SMEM_BUDGET:
            raise ValueError(f"config: expected a config within {_SMEM_BUDGET} bytes of shared memory, "
                             f"got {self.config} needing {smem}")
        self._split = compile_kernel(mhc_phi_split_kernel(n, D))
        self._phi_parts = {}
        self._fused = self._mix = self._apply = self._side = None
        if fused:
            self._fused = compile_kernel(mhc_pre_fused_kernel(**self.spec, **self.config))
            self._side = compile_kernel(mhc_pre_mix_kernel(**self.spec, **_SIDE_CONFIG, apply=True))
        else:
            self._mix = compile_kernel(mhc_pre_mix_kernel(**self.spec, **self.config))
            self._apply = compile_kernel(mhc_pre_apply_kernel(n, D))

    def check_inputs(self, x, phi, alpha, bias) -> None:
        n, D = self.n, self.D
        N = n * n + 2 * n
        check_tensor("x", x, torch.bfloat16, (None, None, n, D))
        check_tensor("phi", phi, torch.float32, (N, n * D), device=x.device)
        check_tensor("alpha", alpha, torch.float32, (3,), device=x.device)
        check_tensor("bias", bias, torch.float32, (N,), device=x.device)

    def _split_phi(self, phi):
        """phi's bf16 hi + lo parts, in buffers reused across calls on the same device."""
        if phi.device not in self._phi_parts:
            shape = (phi_split_rows(self.n), self.n, _round_up(self.D, _D_PAD))
            self._phi_parts[phi.device] = tuple(torch.empty(shape, device=phi.device, dtype=torch.bfloat16)
                                                for _ in range(2))
        hi, lo = self._phi_parts[phi.device]
        self._split(phi, hi, lo)
        return hi, lo

    @staticmethod
    def _outputs(x):
        """Empty h_in, h_post, h_res, inv_rms, h_pre, h_mix for x's tokens (flattened)."""
        B, S, n, D = x.shape
        f32 = dict(device=x.device, dtype=torch.float32)
        return (torch.empty(B * S, D, device=x.device, dtype=torch.bfloat16), torch.empty(B * S, n, **f32),
                torch.empty(B * S, n * n, **f32), torch.empty(B * S, **f32), torch.empty(B * S, n, **f32),
                torch.empty(B * S, n * n + 2 * n, **f32))

    def _kernel_args(self, x, phi, alpha, bias, outs):
        """Arguments of the tunable kernel: the fused kernel takes all outputs and the cluster count, the mix
        kernel all outputs with h_in last (it writes h_in only as the side kernel)."""
        B, S, n, D = x.shape
        head = (x.view(B * S, n, D), *self._split_phi(phi), alpha, bias)
        if self._fused is None:
            return head + outs[1:] + outs[:1]
        # One CTA per SM whatever its shared memory: 256 threads of up to 240 registers fill the file.
        return head + outs + (max_active_clusters(_CLUSTER, 256, _SMEM_BUDGET, x.device.index),)

    def _launch_fused(self, x2, hi, lo, alpha, bias, *outs_and_clusters):
        """The single pass over the first tokens and the side kernel over the last ones (`side_tokens`), on
        the SMs that no cluster takes."""
        *outs, clusters = outs_and_clusters
        tokens = x2.shape[0]
        side = side_tokens(tokens, sm_count(x2.device) - _CLUSTER * clusters)
        m = tokens - side
        self._fused(x2[:m], hi, lo, alpha, bias, *(o[:m] for o in outs), clusters)
        if side:  # the mix kernel's order: h_in last
            self._side(x2[m:], hi, lo, alpha, bias, *(o[m:] for o in outs[1:]), outs[0][m:])

    def tune_args(self, x, phi, alpha, bias):
        """Arguments of the tunable kernel (``tunable_kernel``) for these inputs."""
        self.check_inputs(x, phi, alpha, bias)
        return self._kernel_args(x, phi, alpha, bias, self._outputs(x))

    def __call__(self, x, phi, alpha, bias, return_aux: bool = False):
        self.check_inputs(x, phi, alpha, bias)
        B, S, n, D = x.shape
        h_in, h_post, h_res, inv_rms, h_pre, h_mix = outs = self._outputs(x)
        args = self._kernel_args(x, phi, alpha, bias, outs)
        if B * S:
            if self._fused is not None:
                self._launch_fused(*args)
            else:
                self._mix(*args)
                self._apply(args[0], h_pre, h_in)
        result = (h_in.view(B, S, D), h_post.view(B, S, n), h_res.view(B, S, n, n))
        return result + (inv_rms.view(B, S), h_pre.view(B, S, n), h_mix.view(B, S, -1)) if return_aux else result
