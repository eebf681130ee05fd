"""Machinery shared by every operator: runtime (target, cache, builds, tuned configs), validation, the op
protocol, the torch.library helpers, hardware constants, and kernel building blocks (``ops.common.tl``)."""
