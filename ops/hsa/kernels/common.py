"""Expressions the HSA kernels share: the local window's first token, and the selection key's encoding
of an fp32 score (a sortable unsigned 32-bit key; 0 marks a non-candidate)."""

import tilelang.language as T


def first_local(L, page_size: int, window_size: int):
    """lo, the first local token of a request of L tokens: the window, and always the incomplete last page
    (see golden/hsa_decode.py)."""
    return T.min(T.max(L - window_size, 0), (L // page_size) * page_size)


def u32(v: int):
    return T.uint32(v)


def score_to_key(score):
    """Sortable bits of an fp32 score: negative scores flip all bits, others set the sign bit, so unsigned
    order is float order and finite scores stay > 0 (0 marks a non-candidate)."""
    ib = T.reinterpret(score, "int32")
    return T.reinterpret(ib ^ ((ib >> 31) | T.int32(-(1 << 31))), "uint32")


def key_to_score(key):
    """The fp32 score of a key of ``score_to_key``."""
    bits = T.if_then_else(key >= u32(0x80000000), key ^ u32(0x80000000), ~key)
    return T.reinterpret(bits, "float32")
