"""The protocol every operator class follows, and the registry of op classes by name.

An op class is built for one specialization (``spec``: the shapes, dtypes and constants its kernels are
compiled for) and one set of tunables (``config``); calling it validates the inputs and launches.

Class attributes
  ``op_name``        the op's name: tuned-config key, ``scripts/autotune.py --op``, registry key
  ``warm_specs``     constructor keyword sets of the specializations ``scripts/warm_cache.py`` builds
Class methods, each taking a spec dict
  ``default_config(spec)``  the tunables used when neither ``config=`` nor a stored autotune winner is given
  ``config_space(spec)``    the configs the autotuner may try (empty: nothing to tune)
  ``tunable_kernel(spec)``  the builder the autotuner times, called as ``builder(**spec, **config)`` and
                            returning a ``T.prim_func``; None when the op has nothing to tune
  ``tunable_pass_configs(spec)``  the TileLang pass configs the op builds that kernel with (None: the defaults),
                            so that the autotuner times what the op runs
Instance attributes and methods
  ``spec``, ``config``      as above
  ``tune_args(*inputs)``    the tunable kernel's arguments for the call inputs ``inputs``
"""

from __future__ import annotations

from typing import Callable, ClassVar

_REGISTRY: dict[str, type] = {}


class Op:
    op_name: ClassVar[str]
    warm_specs: ClassVar[tuple[dict, ...]] = ()
    spec: dict
    config: dict

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "op_name" in cls.__dict__:
            _REGISTRY[cls.op_name] = cls

    @classmethod
    def default_config(cls, spec: dict) -> dict:
        return {}

    @classmethod
    def config_space(cls, spec: dict) -> list[dict]:
        return []

    @classmethod
    def tunable_kernel(cls, spec: dict) -> Callable | None:
        return None

    @classmethod
    def tunable_pass_configs(cls, spec: dict) -> dict | None:
        return None

    def tune_args(self, *inputs) -> tuple:
        raise NotImplementedError(f"{self.op_name}: nothing to tune")


def registry() -> dict[str, type]:
    """Every op class by ``op_name`` (importing ``ops`` registers them all)."""
    import ops  # noqa: F401

    return dict(_REGISTRY)


def op_class(name: str) -> type:
    """The op class named ``name``; a ValueError listing the valid names otherwise."""
    ops = registry()
    if name not in ops:
        raise ValueError(f"op: expected one of {sorted(ops)}, got {name!r}")
    return ops[name]
