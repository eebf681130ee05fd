"""HSA (hierarchical sparse attention) decode and extend: page reprs, top-k page selection and sparse paged
attention over SGLang's paged KV cache. Classes: ``HSADecodeTileLang``, ``HSAExtendTileLang``,
``HSAPageReprTileLang``; functions (custom ops ``torch.ops.llm_tile_ops.*``): ``hsa_decode``, ``hsa_select``,
``hsa_page_repr``. Design: docs/design/hsa.md."""

from .custom_ops import hsa_decode, hsa_page_repr, hsa_select
from .decode import HSADecodeTileLang
from .extend import ExtendPlan, HSAExtendTileLang
from .page_repr import HSAPageReprTileLang

__all__ = ["HSADecodeTileLang", "HSAExtendTileLang", "ExtendPlan", "HSAPageReprTileLang", "hsa_decode", "hsa_select",
           "hsa_page_repr"]
