"""mHC (manifold-constrained hyper-connections): the pre step (forward and backward, with DeepSeek-V4's Sinkhorn
projection of h_res), the post step (forward and backward) and the fused post -> next pre for inference.

``MHCForwardPreTileLang`` / ``MHCBackwardPreTileLang`` (ops/mhc/pre.py, pre_bwd.py) are the op classes,
built per (n, D) and Sinkhorn iterations (h_res as DeepSeek-V4's doubly-stochastic comb); ``mhc_pre`` is the
differentiable function over the ``llm_tile_ops::mhc_pre_fwd`` / ``mhc_pre_bwd`` custom ops
(ops/mhc/custom_ops.py). Kernels: ops/mhc/kernels; host-side tiling and
shared-memory models: ops/mhc/tiling.py; design: docs/design/mhc.md."""

from .custom_ops import mhc_post, mhc_post_pre, mhc_pre
from .post import MHCPostBackwardTileLang, MHCPostPreTileLang, MHCPostTileLang
from .pre import MHCForwardPreTileLang
from .pre_bwd import MHCBackwardPreTileLang

__all__ = ["MHCForwardPreTileLang", "MHCBackwardPreTileLang", "mhc_pre", "MHCPostTileLang", "MHCPostBackwardTileLang",
           "mhc_post", "MHCPostPreTileLang", "mhc_post_pre"]
