"""Argument checks shared by every op, raised before any launch. One error type per kind of mistake:
``TypeError`` for a wrong Python type or tensor dtype, ``ValueError`` for a wrong value, shape, device or
layout. Each message names the argument, what was expected and what was given."""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence

import torch

from .hw import TL_DTYPES


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")


def check_int(name: str, value, lo: int | None = None, hi: int | None = None,
              multiple_of: int | None = None, power_of_two: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: expected >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: expected <= {hi}, got {value}")
    if multiple_of is not None and value % multiple_of:
        raise ValueError(f"{name}: expected a multiple of {multiple_of}, got {value}")
    if power_of_two and (value < 1 or value & (value - 1)):
        raise ValueError(f"{name}: expected a power of two, got {value}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def check_float(name: str, value, lo: float | None = None, positive: bool = False) -> float:
    """A finite real number (ints accepted, bools not), >= lo, or > 0 with ``positive``; returned as float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite value, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: expected >= {lo}, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name}: expected a positive value, got {value!r}")
    return float(value)


def check_scale(scale, head_dim: int, name: str = "scale") -> float:
    """The softmax scale of an attention op: ``None`` gives head_dim ** -0.5; else a finite positive float
    (the kernels take their running max on unscaled scores, which a negative scale would invert)."""
    return head_dim ** -0.5 if scale is None else check_float(name, scale, positive=True)


def dtype_name(dtype, allowed: Sequence[torch.dtype], name: str = "dtype") -> str:
    """TileLang's name of a torch dtype the op supports."""
    if dtype not in allowed:
        raise TypeError(f"{name}: expected one of {list(allowed)}, got {dtype!r}")
    return TL_DTYPES[dtype]


def check_tensor(name: str, t, dtype: torch.dtype | Sequence[torch.dtype] | None = None,
                 shape: Sequence[int | None] | None = None, device: torch.device | None = None,
                 contiguous: bool = True) -> None:
    """Raise TypeError/ValueError naming ``name`` unless ``t`` is a CUDA tensor of the given
    dtype(s) and shape (``None`` in ``shape`` accepts any size), contiguous, on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in dtypes:
            want = dtypes[0] if len(dtypes) == 1 else list(dtypes)
            raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(s is None or s == a for s, a in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got device {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {list(t.stride())}")


def check_values(checks: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise ValueError with the message of the first failed (message, bool tensor) check. All checks
    reduce on the device and come back in one host synchronization."""
    if not checks:
        return
    ok = torch.stack([c.all() for _, c in checks]).tolist()
    for (msg, _), good in zip(checks, ok):
        if not good:
            raise ValueError(msg)


def renamed(kwargs: dict, renames: dict[str, str], where: str) -> dict:
    """Map deprecated keyword names to their new ones (``renames``: old -> new) with a FutureWarning;
    giving both names of one argument is a TypeError."""
    out = dict(kwargs)
    for old, new in renames.items():
        if old in out:
            if new in out:
                raise TypeError(f"{where}: got both {old!r} and its new name {new!r}")
            warnings.warn(f"{where}: {old!r} is deprecated, use {new!r}", FutureWarning, stacklevel=3)
            out[new] = out.pop(old)
    return out
