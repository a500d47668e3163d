"""Streaming requests, decode side: how many layers the prefill ranks have published.

A prefill rank serving a streaming request (``server.hold(..., layers_ready=k)`` then
``server.publish(request_id, n)``) answers :class:`~fkv.connector.transport._side.Status` on its
own side-channel address with the layers readers may read now (on CUDA only after the event of
``publish`` completed). :class:`Watch` asks every prefill rank a decode rank reads and returns the
smallest answer: a layer is readable once every rank holding a part of it published it.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from fkv.connector.transport import _side
from fkv.connector.transport._base import SideChannelError, TransferFailed

__all__ = ["Watch"]

_tokens = itertools.count(1)


class Watch:
    """Status requests to the prefill ranks one decode rank reads (one DEALER socket each)."""

    def __init__(self, zctx: Any, entries: list[Any], ranks: tuple[int, ...], engine_id: str,
                 curve: Any = None) -> None:
        self.engine_id = engine_id
        self.dealers: dict[int, _side.Dealer] = {}
        try:
            for rank in ranks:
                if not entries[rank].address:
                    raise TransferFailed(f"prefill rank {rank} of engine {engine_id!r} announced "
                                         f"no side-channel address: it cannot serve streaming "
                                         f"requests")
                self.dealers[rank] = _side.Dealer(zctx, entries[rank].address, curve)
        except BaseException:
            self.close()
            raise

    def ready(self, request_id: str, deadline: float) -> int:
        """Layers readable on every rank now (0 while a rank does not hold the request yet)."""
        try:
            return self._ready(request_id, deadline)
        except SideChannelError as e:
            raise TransferFailed(f"layer status from prefill engine {self.engine_id!r}: {e}") \
                from e

    def _ready(self, request_id: str, deadline: float) -> int:
        tokens = {}
        for rank, dealer in self.dealers.items():
            tokens[rank] = next(_tokens)
            dealer.send(_side.Status(token=tokens[rank], request_id=request_id))
        ready = None
        for rank, dealer in self.dealers.items():
            reply = dealer.wait(tokens[rank], deadline)
            if reply is None:
                raise TransferFailed(f"prefill rank {rank} of engine {self.engine_id!r} did not "
                                     f"answer the layer status before the read's timeout")
            if not isinstance(reply, _side.Layers):
                raise TransferFailed(f"prefill rank {rank} of engine {self.engine_id!r} refused "
                                     f"the layer status: {getattr(reply, 'message', reply)}")
            n = reply.layers_ready if reply.held else 0
            ready = n if ready is None else min(ready, n)
        return ready or 0

    def close(self) -> None:
        for dealer in self.dealers.values():
            dealer.close()
        self.dealers.clear()


def wait_pause(idle: int) -> float:
    """Seconds to sleep after ``idle`` status polls that found nothing new (20 µs up to
    0.25 ms: a published layer is seen within a quarter millisecond)."""
    return min(0.00025, 0.00002 * (1 << min(idle, 4)))


def sleep_until(deadline: float, pause: float) -> None:
    time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
