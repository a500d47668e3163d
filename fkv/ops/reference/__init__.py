"""Pure torch/einops references of every op in ``fkv.ops``, with the same signatures.

Slow and obvious on purpose: tests compare the Triton kernels against these.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["convert", "gather", "move", "paged_attention", "scatter", "write_kv"]

_LAZY = {
    "write_kv": "fkv.ops.reference._write",
    "convert": "fkv.ops.reference._convert",
    "gather": "fkv.ops.reference._convert",
    "scatter": "fkv.ops.reference._convert",
    "move": "fkv.ops.reference._convert",
    "paged_attention": "fkv.ops.reference._attention",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fkv.ops.reference' has no attribute {name!r}")
