"""Prefill -> decode hand-off: the pure handshake and plan, the wire format, and NIXL transport.

The pure parts (``EngineDesc``, ``handshake``, plans, ``encode``/``decode_untrusted``) import neither
torch nor triton (only attrs, numpy and msgspec) and are bound here eagerly, so a public name never
collides with a submodule of the same name; ``serve``/``connect`` load NIXL and ZMQ on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from fkv.connector.handshake import (
    PROTOCOL_VERSION,
    Accept,
    EngineDesc,
    Reason,
    Reject,
    check_remote_ranks,
    handshake,
)
from fkv.connector.plan import StagingStep, TransferPlan
from fkv.connector.wire import Peer, decode_untrusted, encode
from fkv.errors import FkvWireError

__all__ = [
    "Accept", "CurveKeys", "EngineDesc", "FkvWireError", "HandshakeRejected", "PROTOCOL_VERSION", "Peer",
    "ReadResult", "Reason", "Reject", "SideChannelError", "TransferFailed",
    "StagingStep", "TransferPlan", "check_remote_ranks", "connect", "decode_untrusted", "encode",
    "curve_keypair", "handshake", "serve",
]

_LAZY = {
    "serve": "fkv.connector.transport",
    "connect": "fkv.connector.transport",
    "HandshakeRejected": "fkv.connector.transport",
    "ReadResult": "fkv.connector.transport",
    "SideChannelError": "fkv.connector.transport",
    "TransferFailed": "fkv.connector.transport",
    "CurveKeys": "fkv.connector.transport",
    "curve_keypair": "fkv.connector.transport",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fkv.connector' has no attribute {name!r}")
