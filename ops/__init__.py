"""TileLang GPU operators for long-context LLMs. Each op class validates its inputs and launches a
kernel built (or loaded from the disk cache) at construction; see ``golden`` for the semantics."""

from . import _runtime  # noqa: F401  (points TileLang's cache at ours before TileLang is imported)
from .mhc_pre import MHCForwardPreTileLang
from .mhc_pre_bwd import MHCBackwardPreTileLang, mhc_pre
from .hsa_decode import HSADecodeTileLang, HSAPageReprTileLang
from .htree import HTreeForwardTileLang
from .paged_prefill import PagedAttentionPrefillTileLang

__all__ = ["MHCForwardPreTileLang", "MHCBackwardPreTileLang", "mhc_pre", "PagedAttentionPrefillTileLang",
           "HSADecodeTileLang", "HSAPageReprTileLang", "HTreeForwardTileLang"]
