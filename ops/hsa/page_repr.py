"""HSA page representations (``HSAPageReprTileLang``): the repr of each completed page of the paged KV
cache, the key its selection scores against."""

import torch

from ..common.protocol import Op
from ..common.runtime import compile_kernel
from ..common.validate import check_bool, check_choice, check_int, check_tensor, check_values, dtype_name

import tilelang.language as T  # noqa: E402  (after the runtime set the cache dir)

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (16, 32, 64, 128)
REPR_MODES = ("mean", "last")


def page_repr_kernel(num_kv_heads: int, head_dim: int, page_size: int, dtype: str, mode: str):
    """chunk_repr[page_ids[i], h] = mean (or last) of page page_ids[i]'s keys of kv head h."""
    num_ids, num_slots, num_pages = T.dynamic("num_ids, num_slots, num_pages")

    @T.prim_func
    def page_repr(k_buffer: T.Tensor((num_slots, num_kv_heads, head_dim), dtype),
                  page_ids: T.Tensor((num_ids,), "int32"),
                  chunk_repr: T.Tensor((num_pages, num_kv_heads, head_dim), dtype)):
        with T.Kernel(num_ids, num_kv_heads, threads=head_dim) as (i, h):
            acc = T.alloc_fragment((head_dim,), "float32")
            pid = page_ids[i]
            if mode == "mean":
                T.clear(acc)
                for t in T.serial(page_size):
                    for d in T.Parallel(head_dim):
                        acc[d] += T.cast(k_buffer[pid * page_size + t, h, d], "float32")
                for d in T.Parallel(head_dim):
                    chunk_repr[pid, h, d] = T.cast(acc[d] / page_size, dtype)
            else:
                for d in T.Parallel(head_dim):
                    chunk_repr[pid, h, d] = k_buffer[pid * page_size + page_size - 1, h, d]

    return page_repr


class HSAPageReprTileLang(Op):
    """Fills chunk_repr rows of completed pages: ``mode="mean"`` (mean of the page's keys per kv head) or
    ``"last"`` (its last key).

    ``op(k_buffer, page_ids, chunk_repr, validate=True) -> chunk_repr`` writes rows ``page_ids`` of
    chunk_repr in place (nothing else). k_buffer ``[num_slots, num_kv_heads, head_dim]`` (SGLang's paged
    layout: page p holds slots p * page_size ..), page_ids ``[n]`` int32 physical page ids, chunk_repr
    ``[num_physical_pages, num_kv_heads, head_dim]`` in k_buffer's dtype. ``validate=False`` skips the check
    that page ids are in range (a host sync), so a call can be captured in a CUDA graph.
    """

    op_name = "hsa_page_repr"
    # The bench's page reprs (scripts/workloads/hsa_decode.py).
    warm_specs = (dict(num_kv_heads=8, head_dim=128, page_size=64, dtype=torch.bfloat16, mode="mean"),)

    def __init__(self, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, mode: str = "mean"):
        check_int("num_kv_heads", num_kv_heads, lo=1)
        check_choice("head_dim", head_dim, HEAD_DIMS)
        check_choice("page_size", page_size, PAGE_SIZES)
        check_choice("mode", mode, REPR_MODES)
        self.dtype = dtype
        self.spec = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                         dtype=dtype_name(dtype, DTYPES), mode=mode)
        self.config = {}
        self.kernel = compile_kernel(page_repr_kernel(**self.spec))

    def __call__(self, k_buffer: torch.Tensor, page_ids: torch.Tensor, chunk_repr: torch.Tensor,
                 validate: bool = True) -> torch.Tensor:
        Hkv, D, ps = self.spec["num_kv_heads"], self.spec["head_dim"], self.spec["page_size"]
        check_bool("validate", validate)
        check_tensor("k_buffer", k_buffer, self.dtype, (None, Hkv, D))
        check_tensor("page_ids", page_ids, torch.int32, (None,), device=k_buffer.device)
        check_tensor("chunk_repr", chunk_repr, self.dtype, (None, Hkv, D), device=k_buffer.device)
        num_pages = chunk_repr.shape[0]
        if k_buffer.shape[0] < num_pages * ps:
            raise ValueError(f"k_buffer: expected at least num_physical_pages * page_size = {num_pages * ps} "
                             f"slots, got {k_buffer.shape[0]}")
        if validate:
            check_values([(f"page_ids: expected values in [0, {num_pages})",
                           (page_ids >= 0) & (page_ids < num_pages))])
        if page_ids.numel():
            self.kernel(k_buffer, page_ids, chunk_repr)
        return chunk_repr
