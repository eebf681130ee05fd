"""Host-side tiling of the mHC kernels: tile constants, shared-memory models, and the choices they drive
(which forward and which backward path runs, their default configs). Plain Python, no TileLang.
The designs and the measurements behind the constants: docs/design/mhc.md."""

from ..common.hw import SMEM_BUDGET, SMEM_LIMIT
from ..common.runtime import sm_count
from ..common.validate import check_int


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


# ----------------------------------------------------------------------------- phi's split copy
_D_PAD = 256  # phi's split copy pads D to a multiple of this, so every K-chunk reads in bounds


def phi_split_rows(n: int) -> int:
    """Rows NG of phi's split copy: n*n+2n padded to a multiple of 16, the widest tensor-core N that
    TileLang issues as one wgmma (24 rows ran as three n8 instructions: 1.5x slower mix kernel)."""
    return _round_up(n * n + 2 * n, 16)


# ----------------------------------------------------------------------------- forward, two kernels
_SIDE_D = 64  # columns per h_in chunk of the side kernel
# Measured best (H200) with one split at 8192 tokens and more; small token counts run `forward_small_config`.
_MIX_CONFIG = {"block_t": 128, "block_k": 128, "num_stages": 3, "threads": 256, "splits": 1}
# The side kernel is not the critical path: a shallower ring leaves more bandwidth to the single pass.
_SIDE_CONFIG = dict(_MIX_CONFIG, num_stages=2)
_SIDE_ROUND_COST = 11650  # tokens of the single pass as long as one side tile (x read twice) on an idle SM


def _thread_choices(block_t: int) -> list[int]:
    """Threads of the mix kernel for a token tile: at most one warpgroup per 64 tokens (a wgmma's M)."""
    return [t for t in (128, 256) if t <= 2 * block_t]


def mix_chunks(n: int, D: int, block_k: int) -> int:
    """The mix kernel's column chunks (n streams of D padded to _D_PAD, block_k at a time): `splits` divides it."""
    return n * _round_up(D, _D_PAD) // block_k


def splits_fit(chunks: int, num_stages: int, splits: int) -> bool:
    """Whether `splits` CTAs can share a tile's `chunks` column chunks (kernels/splits.py): a divisor of them,
    each split at least num_stages long."""
    return chunks % splits == 0 and (splits == 1 or chunks // splits >= num_stages)


def check_splits(splits: int, chunks: int, num_stages: int, of: str) -> None:
    """config['splits'] against `splits_fit`; `of` names the chunks' shape in the message."""
    if not splits_fit(chunks, num_stages, splits):
        raise ValueError(f"config['splits']: expected a divisor of the {chunks} column chunks of {of} leaving each "
                         f"split at least num_stages={num_stages} of them, got {splits}")


# ----------------------------------------------------------------------------- small token counts
# A decode step's batch (tens to a few thousand tokens) leaves the default tiles' grid far under a wave: one CTA per
# 128 (pre) or 64 (post -> pre) tokens streams all n*D columns alone (H200, n = 4, D = 4096, 20 Sinkhorn iterations:
# the pre took 118 us for 16 tokens, 132 us for 512). The mix kernels then run 64-token tiles whose columns are split
# over SMALL_SPLITS CTAs (the tile's last adds the partials, kernels/splits.py): 39 and 51 us.
SMALL_SPLITS = (8, 4, 2)  # the widest that divides the column chunks
_SMALL_MIN_CHUNKS = 8  # a split's fewest column chunks: narrower rows are not worth their partials


def small_splits(chunks: int, num_stages: int) -> int | None:
    """The widest of SMALL_SPLITS that divides `chunks` leaving each split at least _SMALL_MIN_CHUNKS (and
    num_stages) of them; None where none does."""
    return next((s for s in SMALL_SPLITS if splits_fit(chunks, num_stages, s) and chunks // s >= _SMALL_MIN_CHUNKS),
                None)


def small_tokens_limit(splits: int, sms: int) -> int:
    """The most tokens the small-token kernel takes: its grid (64-token tiles x `splits` CTAs) stays within about
    two CTAs per SM (2112 tokens at 8 splits on 132 SMs; measured faster than the default up to 2048 tokens)."""
    return 64 * 2 * sms // splits


def forward_small_config(n: int, D: int) -> dict | None:
    """The pre's mix kernel for small token counts: 64-token tiles, one warpgroup, 128-column chunks, 3 stages, the
    splits of `small_splits` (None where there are too few columns to split)."""
    splits = small_splits(mix_chunks(n, D, 128), 3)
    return splits and {"block_t": 64, "block_k": 128, "num_stages": 3, "threads": 128, "splits": splits}


def mix_smem_bytes(n: int, block_t: int, block_k: int, num_stages: int, **_) -> int:
    """Shared memory of `mhc_pre_mix`: the x tile and phi's two parts, once per pipeline stage (TileLang
    overlays the epilogue's buffers on them; checked against its allocation)."""
    return num_stages * (block_t + 2 * phi_split_rows(n)) * block_k * 2


# ----------------------------------------------------------------------------- forward, single pass
_CLUSTER = 16  # CTAs per token tile (the largest cluster Hopper allows): each owns D / 16 columns
_FUSED_T = 64  # tokens per tile: one wgmma M; phi (re-read per tile from L2) then costs as much as x
_FUSED_K = 64  # columns per chunk: one 128-byte swizzled row per token


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
    return D % (_CLUSTER * _FUSED_K) == 0 and Q >= 8 and fused_smem_bytes(n, Q + 1, 8) <= SMEM_BUDGET


def side_tokens(tokens: int, idle_sms: int) -> int:
    """Tokens the side kernel takes beside the single pass: whole rounds of one tile per idle SM, as many
    as keep both ending together. A round costs as long as the single pass takes for _SIDE_ROUND_COST
    tokens (H200, n=4, D=4096 and 2048, 16384 tokens: 316.8 -> 276.5 us with one round; at 8192 tokens a
    round made it slower, 168.9 -> 225.1 us). Both times scale with D, so the ratio holds across D."""
    per_round = idle_sms * _SIDE_CONFIG["block_t"]
    return tokens // (per_round + _SIDE_ROUND_COST) * per_round if per_round > 0 else 0


def forward_default_config(n: int, D: int, single_pass: bool = False) -> dict:
    """The forward's tunables: the mix kernel's tiling, or (`single_pass`, only where `fused_fits`) the single
    pass's ring depths."""
    if not single_pass:
        return dict(_MIX_CONFIG)
    # 8 phi stages (its chunks come from L2; depth measured to matter more than x's slack), then up
    # to a tile of slack for the next tile's x.
    Q = fused_chunks(n, D)
    x_slots = max(r for r in range(Q + 1, 2 * Q + 1) if fused_smem_bytes(n, r, 8) <= SMEM_BUDGET)
    return {"x_slots": x_slots, "phi_stages": 8}


def forward_config_space(n: int, D: int, single_pass: bool = False) -> list[dict]:
    if single_pass:
        Q = fused_chunks(n, D)
        return [dict(x_slots=r, phi_stages=s) for r in (Q, Q + 1, Q + 2) for s in range(2, 9)
                if fused_smem_bytes(n, r, s) <= SMEM_BUDGET]
    return [dict(block_t=bt, block_k=bk, num_stages=st, threads=th, splits=sp)
            for bt in (64, 128) for bk in (64, 128) for st in (2, 3, 4) for th in _thread_choices(bt) for sp in (1, 2, 4)
            if mix_smem_bytes(n, bt, bk, st) <= SMEM_BUDGET and splits_fit(mix_chunks(n, D, bk), st, sp)]


def check_num_sms(num_sms) -> int:
    """The SM budget of an op (None: every SM of the GPU): the grids of its persistent kernels stay within it,
    for callers that keep SMs for other work (communication kernels). Non-persistent grids (one tile per CTA)
    need no budget: the hardware places them on whatever SMs are free."""
    if num_sms is None:
        return sm_count()
    check_int("num_sms", num_sms, lo=1, hi=sm_count())
    return num_sms


# ----------------------------------------------------------------------------- backward
def _dims(n: int, D: int, block_d: int):
    """M rows of phi; NG = phi_split_rows(n) and Dp = D padded to _D_PAD: the layout
    [NG, n, Dp] of the forward's phi split, reused here; NP = M padded to 32 for g_mix as a tensor-core
    operand (K multiple of 16, >= 64-byte rows as the MN-major operand of grad_phi); Dc = D padded to
    block_d (the D-chunks the kernels walk; block_d divides _D_PAD, so Dc <= Dp)."""
    M = n * n + 2 * n
    return M, phi_split_rows(n), _round_up(M, 32), _round_up(D, _D_PAD), _round_up(D, block_d)


def _coef_cols(n: int) -> int:
    """Columns of the per-token coefficients [c, h_pre[0..n-1], zeros]: rows of a multiple of 16 bytes
    (a TMA box row)."""
    return _round_up(n + 1, 4)


_OP_BLOCK = 64  # tokens per tile and bf16 columns per stream of a D-slice (one 128-byte swizzle band)
_OP_THREADS = 512  # two consumer warpgroups; warps 8 (grad loads), 9 (row loads), 10-11 (dots), 12-15 (coefficients)
_DOT_WARPS, _COEF_WARPS = 2, 4
_ROW_COLS = 512  # columns of every stream per row chunk (two 256-column TMA boxes)
_ROW_SLOTS = 8  # row chunks in flight per CTA (40 KB at n = 4; 12 or 16 were no faster)
# The row role runs at most `lag` token tiles ahead of the grad role, and the rows it read stay in L2 until their
# re-read: the largest lag <= 8 whose rows fit this budget. More lag hides the exchange, but held rows past ~35 MiB
# start to miss L2 (H200: at D = 4096 lag 6-7 beat 8 by 3%, at D = 7168 lag 8 beat 7).
_ROW_L2_BUDGET = 36 << 20
# A stage is handed back one tile after its own (once its grad_x stores have read it): with one stage the
# producer would wait for a release that comes only after the next tile has landed.
_OP_MIN_STAGES = 2


def _slices(D: int) -> int:
    """The one pass's D-slices: one CTA each per token group."""
    return -(-D // _OP_BLOCK)


def _lag(n: int, D: int, token_groups: int) -> int:
    """Token tiles the one pass's row role may run ahead of its grad role (_ROW_L2_BUDGET). A resident grid
    holds at most sm_count() * 64 columns, so one tile's rows stay near 5 MB on 132 SMs and the lag at 6 or more."""
    tile_rows = token_groups * _OP_BLOCK * (n + 1) * D * 2  # x and g_in of one token tile of every group
    return min(8, _ROW_L2_BUDGET // tile_rows)


def one_pass(n: int, D: int, num_sms: int | None = None) -> bool:
    """Whether the backward runs as one pass (`mhc_pre_bwd_one_pass`): n <= 4 (its rings fit shared memory)
    and one CTA per D-slice fits the SM budget (default: the GPU; D <= 8448 on 132 SMs). The grid is persistent
    (a CTA per slice and token group): wider than the budget, it would take SMs the caller keeps for other work."""
    return n <= 4 and _slices(D) <= (sm_count() if num_sms is None else num_sms)


def _stats_smem(n: int, block_t: int, block_d: int, num_stages: int) -> int:
    """Shared memory of the stats kernel: its TMA tiles once per stage, the epilogue's buffers."""
    _, NG, _, _, _ = _dims(n, block_d, block_d)
    bk = n * block_d
    tiles = block_t * bk * 2 + 2 * NG * bk * 2 + block_t * block_d * 2
    return num_stages * tiles + block_t * (2 * NG + _round_up(3 * n * n, 4) + 3 + n) * 4


def _grad_smem(n: int, block_t: int, block_d: int, num_stages: int) -> int:
    """Shared memory of the grad kernel: its TMA tiles once per stage, then phi's [hi; hi; lo] slice,
    the side-by-side x tile and g_mix's bf16 parts."""
    _, _, NP, _, _ = _dims(n, block_d, block_d)
    bk = n * block_d
    tiles = block_t * (bk * 2 + block_d * 2 + NP * 4 + _coef_cols(n) * 4)
    return num_stages * tiles + 3 * NP * bk * 2 + block_t * bk * 2 + block_t * 5 * NP * 2


def _one_pass_smem(n: int, block_t: int, num_stages: int) -> int:
    """Shared memory of the one pass: the grad role's ring (x, g_in, g_mix's hi and lo, coefficients), phi's
    [hi; lo] slice, the row ring and the dots handed to the coefficient warps."""
    _, _, NP, _, _ = _dims(n, _OP_BLOCK, _OP_BLOCK)
    bk = n * _OP_BLOCK
    stage = block_t * (bk * 2 + _OP_BLOCK * 2 + NP * 2 * 2 + _coef_cols(n) * 4)
    rows = _ROW_SLOTS * (n + 1) * _ROW_COLS * 2
    return num_stages * stage + 2 * NP * bk * 2 + rows + _COEF_WARPS * _DOT_WARPS * 4 * 4


def _stats_stages(n: int, block_t: int, block_d: int) -> int:
    """Two stages for the stats kernel where they fit, else one."""
    return 2 if _stats_smem(n, block_t, block_d, 2) + 2048 <= SMEM_LIMIT else 1


def _smem_bytes(n: int, D: int, block_t: int, block_d: int, num_stages: int, num_sms: int | None = None) -> int:
    """Shared memory of the one pass (exact), or of the larger of the two kernels plus slack."""
    if one_pass(n, D, num_sms):
        return _one_pass_smem(n, block_t, num_stages)
    stats = _stats_smem(n, block_t, block_d, _stats_stages(n, block_t, block_d))
    return max(stats, _grad_smem(n, block_t, block_d, num_stages)) + 2048


def _smem_limit(n: int, D: int, num_sms: int | None = None) -> int:
    """Hopper's opt-in shared memory per block less slack for the one pass (its model is exact), or the two
    kernels' margin."""
    return SMEM_BUDGET if one_pass(n, D, num_sms) else SMEM_LIMIT


def one_pass_groups(D: int, num_sms: int | None = None) -> int:
    """The one pass's most token groups: as many as keep its grid within the SM budget (a CTA per SM; on 132 SMs
    2 at D = 4096, 1 at D = 7168)."""
    return min(64, (sm_count() if num_sms is None else num_sms) // _slices(D))


def backward_default_config(n: int, D: int, num_sms: int | None = None) -> dict:
    """The backward's tunables (those of the kernel that writes grad_x)."""
    if one_pass(n, D, num_sms):
        return {"block_t": _OP_BLOCK, "block_d": _OP_BLOCK, "token_groups": one_pass_groups(D, num_sms),
                "num_stages": 3}
    # block_d keeps n*block_d a multiple of 64 (the grad_phi product's M over 8 warps) and shared
    # memory in bounds (n = 5 and 7 fit with no block_d, see MHCBackwardPreTileLang). num_stages is the
    # grad kernel's (the tunable one; the stats kernel takes 2 when they fit, see _stats_stages): one
    # stage, as measured; its x tiles are copied out at once, which frees them for the next loads.
    return {"block_t": 64, "block_d": {6: 32, 8: 16}.get(n, 64), "token_groups": 4, "num_stages": 1}


def backward_config_space(n: int, D: int, num_sms: int | None = None) -> list[dict]:
    # block_d and token_groups fix the workspace shapes of tune_args, so they stay at the default.
    base = backward_default_config(n, D, num_sms)
    tiles, least = ((64,), _OP_MIN_STAGES) if one_pass(n, D, num_sms) else ((64, 128), 1)
    return [{**base, "block_t": bt, "num_stages": s} for bt in tiles for s in range(least, 5)
            if _smem_bytes(n, D, bt, base["block_d"], s, num_sms) <= _smem_limit(n, D, num_sms)]


# ----------------------------------------------------------------------------- Sinkhorn (h_res -> comb)
SINKHORN_MAX_ITERS = 100  # the op's bound on sinkhorn_iters (DeepSeek-V4 runs 20)
_SINKHORN_THREADS = 128  # tokens per CTA (one per thread): 128 CTAs for 16384 tokens, one wave on 132 SMs
# Shared memory of the Sinkhorn backward's denominators (n per normalization and token): two CTAs per SM.
_SINKHORN_SMEM = 96 * 1024


def sinkhorn_segment(n: int, iters: int) -> int:
    """Normalizations per segment of the Sinkhorn backward (even: each starts with a column normalization):
    all 2 * iters - 1 where their denominators fit _SINKHORN_SMEM, else the earlier segments are recomputed
    from the softmax once per later segment (one segment up to 24 iterations at n = 4, 12 at n = 8)."""
    fit = _SINKHORN_SMEM // (n * _SINKHORN_THREADS * 4) // 2 * 2
    return min(2 * iters, max(2, fit))
