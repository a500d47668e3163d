"""fkv: paged KV-cache layouts that are correct by construction, and fast.

The pure core (``Layout``, ``KVCacheSpec``, ``rearrange_pattern``, ``FkvError``) imports neither
torch nor triton; tensor helpers, kernels and the connector load lazily on first use.

>>> import fkv
>>> spec = fkv.KVCacheSpec(layout="HND", num_blocks=8, block_size=16, num_kv_heads=8, head_size=128)
>>> spec.physical_shape
(8, 2, 8, 16, 128)
"""

from __future__ import annotations

import importlib
from typing import Any

from fkv.errors import FkvError, FkvWireError
from fkv.layout import KVCacheSpec, Layout, rearrange_pattern

__all__ = [
    "FkvError",
    "FkvWireError",
    "KVCacheSpec",
    "Layout",
    "allocate",
    "connector",
    "infer_spec",
    "ops",
    "rearrange_pattern",
    "testing",
]
__version__ = "0.1.0"

_LAZY = {
    "allocate": ("fkv.tensors", "allocate"),
    "infer_spec": ("fkv.tensors", "infer_spec"),
    "ops": ("fkv.ops", None),
    "connector": ("fkv.connector", None),
    "testing": ("fkv.testing", None),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
