"""The paged decode kernels by family: the split-KV attention kernel (`split_kv`) and the combine of its
splits (`combine`), with the tile-range arithmetic both share (`common`)."""

from .combine import paged_decode_combine_kernel
from .split_kv import paged_decode_split_kernel

__all__ = ["paged_decode_split_kernel", "paged_decode_combine_kernel"]
