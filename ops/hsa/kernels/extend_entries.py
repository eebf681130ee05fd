"""The page-major kernel's entry lists of HSA extend, built on the device in two passes over the selections (a
counting sort by (kv head, physical page)): count each group's entries, then place each entry at its group's start
plus a slot taken by an atomic increment. Within a group the entries' order is whatever the atomics give: the
page-major kernel computes every entry's rows on their own (each row's products and softmax touch no other row), so
its outputs do not depend on that order, only on the groups' contents."""

import tilelang.language as T


def _entry(ids, i, num_kv_heads: int, topk: int, num_pages):
    """Entry i of the flattened selections [total_q, num_kv_heads, topk]: (its group or -1, row, slot)."""
    pid = ids[i]
    group = T.if_then_else(pid >= 0, (i // topk % num_kv_heads) * num_pages + pid, -1)
    return group, i // (num_kv_heads * topk), i % topk


def hsa_extend_count_kernel(num_kv_heads: int, topk: int, threads: int = 256):
    """counts[1 + g] += the entries of group g (counts zeroed by the caller; its exclusive scan is then
    counts.cumsum(0))."""
    n, groups1 = T.dynamic("n, groups1")

    @T.prim_func
    def hsa_extend_count(ids: T.Tensor((n,), "int32"), counts: T.Tensor((groups1,), "int32")):
        with T.Kernel(T.ceildiv(n, threads), threads=threads) as bx:
            i = bx * threads + T.get_thread_binding()
            if i < n:
                group, _, _ = _entry(ids, i, num_kv_heads, topk, (groups1 - 1) // num_kv_heads)
                if group >= 0:
                    T.atomic_add(counts[group + 1], 1)

    return hsa_extend_count


def hsa_extend_place_kernel(num_kv_heads: int, topk: int, threads: int = 256):
    """entry_row / entry_slot[cursor[g]++] = (row, slot) of every entry of group g (cursor: the groups' starts)."""
    n, groups = T.dynamic("n, groups")

    @T.prim_func
    def hsa_extend_place(ids: T.Tensor((n,), "int32"), cursor: T.Tensor((groups,), "int32"),
                         entry_row: T.Tensor((n,), "int32"), entry_slot: T.Tensor((n,), "int32")):
        with T.Kernel(T.ceildiv(n, threads), threads=threads) as bx:
            i = bx * threads + T.get_thread_binding()
            if i < n:
                group, row, slot = _entry(ids, i, num_kv_heads, topk, groups // num_kv_heads)
                if group >= 0:
                    at = T.atomic_add(cursor[group], 1, return_prev=True)
                    entry_row[at] = row
                    entry_slot[at] = slot

    return hsa_extend_place
