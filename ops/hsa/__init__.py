"""HSA (hierarchical sparse attention) decode: page reprs, top-k page selection and sparse paged decode
over SGLang's paged KV cache. Classes: ``HSADecodeTileLang``, ``HSAPageReprTileLang``; functions (custom
ops ``torch.ops.llm_tile_ops.*``): ``hsa_decode``, ``hsa_select``, ``hsa_page_repr``. Design:
docs/design/hsa.md."""

from .custom_ops import hsa_decode, hsa_page_repr, hsa_select
from .decode import HSADecodeTileLang
from .page_repr import HSAPageReprTileLang

__all__ = ["HSADecodeTileLang", "HSAPageReprTileLang", "hsa_decode", "hsa_select", "hsa_page_repr"]
