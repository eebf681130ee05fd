"""The paged decode kernels by family: the split-KV attention kernel (`split_kv`), its sibling whose warps split the
keys and keep q, P and O in registers (`split_kv_warps`, 16-row query tiles), the combine of their splits
(`combine`), and the tile-range arithmetic they share (`common`)."""

from .combine import paged_decode_combine_kernel
from .split_kv import paged_decode_split_kernel
from .split_kv_warps import paged_decode_warps_kernel

__all__ = ["paged_decode_split_kernel", "paged_decode_warps_kernel", "paged_decode_combine_kernel"]
