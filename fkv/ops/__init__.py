"""Triton kernels over any layout (CUDA, or CPU under ``TRITON_INTERPRET=1``).

``write_kv``, ``convert``, ``gather``, ``scatter``, ``move`` (token copy between any two
specs, with block re-chunking and head ranges), ``paged_attention``; ``fkv.ops.reference`` holds
pure torch/einops versions of each with the same signatures. ``graph_primer`` is a measured
start-up recipe for CUDA graphs (``fkv.ops.graphs``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["convert", "gather", "graph_primer", "move", "paged_attention", "reference", "scatter",
           "write_kv"]

_LAZY = {
    "write_kv": ("fkv.ops.write", "write_kv"),
    "convert": ("fkv.ops.relayout", "convert"),
    "gather": ("fkv.ops.relayout", "gather"),
    "scatter": ("fkv.ops.relayout", "scatter"),
    "move": ("fkv.ops.relayout", "move"),
    "paged_attention": ("fkv.ops.attention", "paged_attention"),
    "reference": ("fkv.ops.reference", None),
    "graph_primer": ("fkv.ops.graphs", "graph_primer"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fkv.ops' has no attribute {name!r}")
