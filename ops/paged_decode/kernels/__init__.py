"""The paged decode kernels by family: the split-KV attention kernel (`split_kv`), its FP8 sibling that widens K and V
in registers (`split_kv_fp8`), the combine of their splits (`combine`), and the tile-range arithmetic they share
(`common`)."""

from .combine import paged_decode_combine_kernel
from .split_kv import paged_decode_split_kernel
from .split_kv_fp8 import paged_decode_fp8_kernel

__all__ = ["paged_decode_split_kernel", "paged_decode_fp8_kernel", "paged_decode_combine_kernel"]
