"""htree: hierarchical tree sparse attention. The op classes ``HTreeForwardTileLang`` and ``HTreeBackwardTileLang``
and the differentiable functional form ``htree_attention`` (the custom ops ``llm_tile_ops::htree_forward``,
``llm_tile_ops::htree_forward_train`` and ``llm_tile_ops::htree_backward``)."""

from .backward import HTreeBackwardTileLang
from .custom_ops import htree_attention
from .forward import HTreeForwardTileLang

__all__ = ["HTreeForwardTileLang", "HTreeBackwardTileLang", "htree_attention"]
