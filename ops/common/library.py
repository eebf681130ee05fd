"""What the ``torch.library`` custom ops share: their namespace, and one compiled op object per
specialization and process, so that a custom op call (eager, compiled or in a training loop) builds
nothing after its first call."""

import functools

NAMESPACE = "llm_tile_ops"


@functools.lru_cache(maxsize=None)
def op_instance(cls, **kwargs):
    """``cls(**kwargs)``, constructed once per process for each keyword set."""
    return cls(**kwargs)
