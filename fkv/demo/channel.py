"""The demo's control channel: children PUSH msgpack events to the parent's PULL socket.

Only the demo's own processes talk here (the KV bytes go through NIXL, not this channel); messages
are msgpack dicts (no pickle), arrays travel as ``{"dtype", "shape", "data": bytes}``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import zmq

__all__ = ["Collector", "Reporter", "pack_array", "unpack_array"]


def pack_array(a: Any) -> dict[str, Any]:
    """A numpy array (or torch tensor, moved to CPU) as a msgpack-friendly dict."""
    if hasattr(a, "detach"):
        a = a.detach().to("cpu").numpy()
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def unpack_array(d: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


class Reporter:
    """A child's side: ``send(kind, **fields)`` pushes ``{"role", "rank", "kind", "t", ...}``."""

    def __init__(self, address: str, role: str, rank: int) -> None:
        self.role, self.rank = role, rank
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 5000)
        self._sock.connect(address)

    def send(self, kind: str, **fields: Any) -> None:
        msg = {"role": self.role, "rank": self.rank, "kind": kind, "t": time.time(), **fields}
        self._sock.send(msgspec.msgpack.encode(msg))

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


class Collector:
    """The parent's side: a PULL socket on a free loopback port; ``poll(timeout_s)`` -> events."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def poll(self, timeout_s: float) -> list[dict[str, Any]]:
        out = []
        if self._sock.poll(int(timeout_s * 1000)):
            while True:
                try:
                    raw = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                out.append(msgspec.msgpack.decode(raw))
        return out

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
