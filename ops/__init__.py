"""TileLang GPU operators for long-context LLMs (Hopper, sm_90a).

A package per operator (``ops.mhc``, ``ops.paged_prefill``, ``ops.paged_decode``, ``ops.hsa``, ``ops.htree``), each with op
classes built for one specialization (kernels compiled at construction or loaded from the disk cache)
and functional forms registered as ``torch.library`` custom ops (namespace ``llm_tile_ops``), which
``torch.compile`` traces without graph breaks. The semantics of each op are defined by its readable
reference in ``golden``; the shared machinery (runtime, validation, op protocol) is in ``ops.common``.
"""

from .common import runtime  # noqa: F401  (sets up the kernel cache before any kernel module imports TileLang)
from .hsa import HSADecodeTileLang, HSAExtendTileLang, HSAPageReprTileLang, hsa_decode, hsa_page_repr, hsa_select
from .htree import HTreeBackwardTileLang, HTreeForwardTileLang, htree_attention
from .mhc import (MHCBackwardPreTileLang, MHCForwardPreTileLang, MHCPostBackwardTileLang, MHCPostPreTileLang,
                  MHCPostTileLang, mhc_post, mhc_post_pre, mhc_pre)
from .paged_decode import PagedAttentionDecodeTileLang, paged_attention_decode
from .paged_prefill import PagedAttentionPrefillTileLang, paged_attention_prefill

__all__ = [
    "MHCForwardPreTileLang", "MHCBackwardPreTileLang", "mhc_pre",
    "MHCPostTileLang", "MHCPostBackwardTileLang", "mhc_post", "MHCPostPreTileLang", "mhc_post_pre",
    "PagedAttentionPrefillTileLang", "paged_attention_prefill",
    "PagedAttentionDecodeTileLang", "paged_attention_decode",
    "HSADecodeTileLang", "HSAExtendTileLang", "HSAPageReprTileLang", "hsa_decode", "hsa_select", "hsa_page_repr",
    "HTreeForwardTileLang", "HTreeBackwardTileLang", "htree_attention",
]
