"""A fake prefill rank 0 (and pack server) for tests that script what a prefill peer answers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from fkv.connector.transport import _side
from fkv.connector.transport._sidelimits import FrameServer


class FakePrefill:
    """A bounded frame server on a thread of this process. The i-th ``Fetch`` gets
    ``fetch(i)`` (a message: ``Ranks``, ``Error``, anything), a ``Pack`` gets ``pack(msg)``
    (None: never answered; no ``pack``: an ``Error``), everything else ``other(msg)`` (no
    ``other``: ``Ok``). ``fetches`` and
    ``packs`` count what came; a test may set ``fetches`` to choose the next answer."""

    def __init__(self, fetch: Callable[[int], Any], pack: Callable[[Any], Any] | None = None,
                 other: Callable[[Any], Any] | None = None) -> None:
        self.server = FrameServer("tcp://127.0.0.1:0", max_frame=_side.MAX_SIDE_MESSAGE_BYTES)
        self.address = self.server.address
        self.fetch, self.pack, self.other = fetch, pack, other
        self.fetches = self.packs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for conn, payload in self.server.poll(0.005):
                msg = _side.decode_request(payload)
                if isinstance(msg, _side.Fetch):
                    reply: Any = self.fetch(self.fetches)
                    self.fetches += 1
                elif isinstance(msg, _side.Pack):
                    self.packs += 1
                    reply = (self.pack(msg) if self.pack
                             else _side.Error(message="no", token=msg.token))
                    if reply is None:
                        continue  # never answered
                else:
                    reply = self.other(msg) if self.other else _side.Ok(engine_id="fake")
                self.server.reply(conn, _side.encode_message(reply))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.server.close()

    def __enter__(self) -> FakePrefill:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
