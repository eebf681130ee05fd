"""The paged prefill kernels by family: the warp-specialized persistent kernel (`ws`), the gather kernel
(`gather`), the schedule kernel (`schedule`) and what the first two share (`tile_plan`)."""

from ..tiling import warp_specialized
from .gather import paged_prefill_gather_kernel
from .schedule import paged_prefill_schedule_kernel
from .ws import paged_prefill_ws_kernel


def paged_prefill_kernel(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: str,
                         use_alibi: bool, kv_layout: str, scale: float, num_ctas: int, window_left: int = -1,
                         soft_cap: float = 0.0, kv_dtype: str | None = None, fp8_compute: bool = False, **config):
    """The attention kernel of a specialization (`warp_specialized` picks the family) with its config.
    `num_ctas` (the device's SM count) bounds the persistent grid of the warp-specialized kernel; the
    gather kernel launches one CTA per query tile and head group. `fp8_compute` (an 8-bit cache, the
    warp-specialized kernel only): both products on FP8 tensor cores, q and P rounded to e4m3."""
    args = (num_heads, num_kv_heads, head_dim, page_size, dtype, use_alibi, kv_layout, scale)
    options = dict(window_left=window_left, soft_cap=soft_cap, kv_dtype=kv_dtype)
    if warp_specialized(dtype, page_size):
        return paged_prefill_ws_kernel(*args, num_ctas=num_ctas, **options, fp8_compute=fp8_compute, **config)
    return paged_prefill_gather_kernel(*args, **options, **config)


__all__ = ["paged_prefill_kernel", "paged_prefill_ws_kernel", "paged_prefill_gather_kernel",
           "paged_prefill_schedule_kernel"]
