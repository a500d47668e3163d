"""Prefill -> decode hand-off: the pure handshake and plan, the wire format, and NIXL transport.

The pure parts (``EngineDesc``, ``handshake``, plans, ``encode``/``decode_untrusted``) import neither
torch nor triton; ``serve``/``connect`` load NIXL and ZMQ on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from fkv.errors import FkvWireError

__all__ = [
    "Accept", "EngineDesc", "FkvWireError", "PROTOCOL_VERSION", "Peer", "Reason", "Reject",
    "TransferPlan", "connect", "decode_untrusted", "encode", "handshake", "serve",
]

_LAZY = {
    "EngineDesc": "fkv.connector.handshake",
    "Accept": "fkv.connector.handshake",
    "Reject": "fkv.connector.handshake",
    "Reason": "fkv.connector.handshake",
    "handshake": "fkv.connector.handshake",
    "PROTOCOL_VERSION": "fkv.connector.handshake",
    "TransferPlan": "fkv.connector.plan",
    "Peer": "fkv.connector.wire",
    "encode": "fkv.connector.wire",
    "decode_untrusted": "fkv.connector.wire",
    "serve": "fkv.connector.transport",
    "connect": "fkv.connector.transport",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fkv.connector' has no attribute {name!r}")
