"""The prefill side of the transport: a :class:`Server` per prefill rank (``fkv.connector.serve``).

A server registers its rank's caches (and its pack buffer) with its own NIXL agent, then runs one
thread that does everything afterwards, so NIXL is only ever called from that thread:

- answers its side-channel socket: rank 0 for the whole engine (``Fetch``, ``Publish`` from ranks
  ``1..tp-1``), every rank with a pack buffer for ``Pack`` requests of packed reads (a held
  streaming request's packs only of layers it published: ``Status`` and ``Pack`` see the same
  count). Packs run on
  this thread between polls: the requests waiting on the socket are taken as one batch and
  answered in order; each pack's gather (one launch for all layers) is launched as its request
  comes up, and its reply goes out as soon as that gather has finished (CUDA: its own event, with
  the gathers behind it already queued; CPU: right after it ran), so a decode rank that keeps
  several chunks in flight READs one while the next is gathered. A pack that finds the buffer
  full first takes in the NIXL notifications that free slots, then asks the requester to retry if
  it still does not fit;
- polls NIXL notifications: ``"<request id>:<decode tp>"`` counts a reader of a request (held
  blocks are released after the expected count, or when the lease runs out); a
  :data:`_packer.FREE_PREFIX` notification frees a pack slot;
- expires leases and pack slots.

Errors inside the loop never stop it: they land in ``server.errors``. ``FKV_TRANSPORT_SPIN``
(seconds, default 0) keeps the loop busy-polling that long after each request instead of sleeping
in ``poll``.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import hmac
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from fkv.connector.plan import check_block_ids
from fkv.connector.transport import _side
from fkv.connector.transport._base import (
    DEFAULT_LEASE,
    DEFAULT_PACK_BYTES,
    cache_regions,
    check_curve,
    check_engine,
    check_seconds,
    layer_views,
    spin_seconds,
    zmq,
)
from fkv.connector.transport._agent import Agent, UndecodableNotifications
from fkv.connector.transport._lifecycle import Requests, _blocks_text
from fkv.connector.transport._base import SideChannelError
from fkv.connector.transport._packer import FREE_PREFIX, Packer
from fkv.connector.handshake import EngineDesc
from fkv.connector.wire import decode_untrusted, encode
from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec

__all__ = ["Server"]

# request-table counters that mean a refused peer notification (telemetry's refused kinds)
_REFUSED_KINDS = ("duplicate", "unexpected_reader", "unknown_request", "late", "failed",
                  "malformed", "foreign", "impersonation")

#: Status long polls a rank keeps waiting at once; more are answered at once (peers must not
#: grow the list without end).
MAX_PARKED = 256
#: ... and of them, from one connection: an honest decode rank has one poll out per prefill rank
#: it reads, while one CURVE connection can pipeline any number and would otherwise take every
#: parked place, leaving the other readers' polls answered at once (each reader then re-asks in
#: a loop until its layer comes). A plain-frames connection carries one request at a time.
MAX_PARKED_PER_PEER = 8
#: Same-host decode outboxes a rank reads at once (one per bound NIXL agent that announced one);
#: a Hello past it closes the least recently active one (whose notifications then come through
#: NIXL), so that outboxes of decode processes that died without closing are not kept forever.
MAX_OUTBOXES = 1024
#: While nothing is held, the outboxes are read this often (seconds) rather than on every turn:
#: a done names a held request, so only stray records (late, duplicate) wait for it.
OUTBOX_IDLE_LOOK = 0.05
_PARK = object()  # _handle's answer to a Status that waits for news

#: Servers not closed yet, each with the process that started it (a forked child inherits the
#: table but not the servers' threads, and must not stop its parent's board).
_OPEN: weakref.WeakKeyDictionary[Server, int] = weakref.WeakKeyDictionary()


@atexit.register
def _close_at_exit() -> None:
    """Close this process's servers that are still open when the interpreter exits. Until then
    a server thread may be inside a NIXL call that released the GIL; the interpreter's shutdown
    ends such a daemon thread where it takes the GIL back, which unwinds through NIXL's C++ frames
    and aborts the process (``terminate called without an active exception``, exit status 134).
    Exit handlers run before that, while the thread can still be stopped and joined."""
    for server, pid in list(_OPEN.items()):
        if pid == os.getpid():
            with contextlib.suppress(Exception):
                server.close()


class Server:
    """One prefill rank: its registered caches, notification tracking, its pack buffer and, on
    rank 0, the side channel for the whole engine. Use ``fkv.connector.serve``; a context
    manager."""

    def __init__(self, engine: EngineDesc, spec: KVCacheSpec, caches: Any, *,
                 host: str = "127.0.0.1", port: int = 0, join: str | None = None,
                 lease: float = DEFAULT_LEASE, join_timeout: float = 30.0,
                 on_release: Callable[[str, Any, str], None] | None = None,
                 pack_bytes: int | None = None, curve: Any = None) -> None:
        self.engine = check_engine(engine)
        # a prefill rank > 0 is also a client: it publishes to rank 0 through the side channel
        self._curve = check_curve(curve, client=engine.tp_rank > 0)
        self.spec = spec
        if engine.tp_rank == 0 and join is not None:
            raise field_error("join", join, "None on rank 0 (rank 0 answers the side channel)")
        if engine.tp_rank > 0 and not isinstance(join, str):
            raise field_error("join", join, f"rank 0's address (a str) on rank {engine.tp_rank}",
                              "pass join=<the address rank 0's server reports>")
        if not isinstance(host, str) or not host:
            raise field_error("host", host, "a non-empty str: the interface to bind, like "
                              "'127.0.0.1'")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise field_error("port", port, "an int in [0, 65535] (0: any free port)")
        lease = check_seconds("lease", lease)
        join_timeout = check_seconds("join_timeout", join_timeout)
        if on_release is not None and not callable(on_release):
            raise field_error("on_release", on_release,
                              "None or a callable on_release(request_id, block_ids, why)")
        if pack_bytes is not None and (isinstance(pack_bytes, bool)
                                       or not isinstance(pack_bytes, int) or pack_bytes < 0):
            raise field_error("pack_bytes", pack_bytes, "None (default) or a non-negative int")
        regions, mem_type, device_id, device = cache_regions(spec, caches)
        if pack_bytes is None:
            pack_bytes = min(DEFAULT_PACK_BYTES, spec.region_bytes * spec.num_regions)
        self.lease = lease
        self._device = device
        self._on_release = on_release
        self._lock = threading.Lock()
        # the request table (release by reader identity), fed under self._lock
        self._table = Requests(num_layers=spec.num_layers, prefill_tp=engine.tp_size,
                               prefill_rank=engine.tp_rank)
        self._published: dict[str, int] = {}   # streaming: layers announced so far
        self._events: dict[str, list[tuple[int, Any]]] = {}  # announced, event not yet done
        self._due: list[Any] = []  # releases a publish completed, for the server thread
        # Status long polls waiting for news: (envelope, request, answer-by time)
        self._parked: list[tuple[Any, _side.Status, float]] = []
        # the parked polls are looked at again only when something may have changed their answer
        # (a hold, a publish, an event, a release: ``_news``) or the earliest wait ends
        self._news = True
        self._parked_until = float("inf")
        self._waiter: _EventWaiter | None = None  # waits for publish events (made on first use)
        # CUDA: interprocess events, one per layer slot, recorded (on one stream of their own)
        # after each publish's writes; ipc readers wait for them on their stream instead of for
        # the writes on the host
        self._ipc_events: list[Any] = []
        self._ipc_stream: Any = None
        # same-host readers read each streaming request's layer counts here without asking
        self._board: Any = None
        # bound NIXL agent name -> its same-host decode rank's outbox (``_outbox``); the server
        # thread's alone
        self._outboxes: dict[str, Any] = {}
        self._outbox_due = 0.0  # the next look at the outboxes while nothing is held
        self._stop = threading.Event()
        self._sock: Any = None
        self._ranks: dict[int, _side.RankEntry] = {}
        # rank 0: per rank k > 0, the hash of the secret its first Publish carried (only rank k
        # may replace its entry); rank k > 0: its own secret, never handed out
        self._secrets: dict[int, bytes] = {}
        self._secret = os.urandom(32)
        self._packer: Packer | None = None
        self._spin = spin_seconds()
        #: recent problems of the server thread (bounded: peers must not grow it without end)
        self.errors: collections.deque[str] = collections.deque(maxlen=100)
        from fkv.telemetry import Telemetry

        self.telemetry = Telemetry("server", engine_id=engine.engine_id)
        self._ctx = zmq().Context()
        self._agent: Any = None
        try:
            self._agent = Agent("prefill")
            self._agent.register(regions, mem_type, device_id)
            if pack_bytes:
                self._packer = Packer(spec, layer_views(spec, caches), device, pack_bytes,
                                      self._agent, mem_type, device_id)
            self.ipc_reason = ""
            ipc = None
            if device.type == "cuda":
                from fkv.connector.transport._ipc import export_regions

                try:
                    ipc = export_regions(regions, device)
                except FkvError as e:  # the NIXL paths still work
                    self.ipc_reason = str(e)
                else:
                    ipc = attrs.evolve(ipc, events=self._publish_events(device))
            else:
                self.ipc_reason = "the caches are not on CUDA"
            board = self._make_board(regions)
            wire = encode(engine, spec, regions, device_id=device_id,
                          agent_metadata=self._agent.metadata(), ipc=ipc, board=board)
            own = self._bind(host, port)
            packer = self._packer
            entry = _side.RankEntry(peer=wire, mem_type=mem_type, address=own,
                                    pack_base=packer.base if packer else 0,
                                    pack_bytes=packer.capacity if packer else 0)
            if engine.tp_rank == 0:
                self.address = own
                self._ranks[0] = entry
            else:
                self.address = join
                self._publish(join, entry, join_timeout)
        except BaseException:
            self._shutdown()
            raise
        self._thread = threading.Thread(target=self._run, name=f"fkv-serve-{engine.engine_id}-"
                                        f"{engine.tp_rank}", daemon=True)
        self._thread.start()
        _OPEN[self] = os.getpid()

    # -- public ------------------------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: Any = None, *, lease: float | None = None,
             layers_ready: int | None = None, decode_engine_id: str | None = None,
             decode_tp: int | None = None) -> None:
        """Hold ``request_id``'s blocks until every expected decode reader notified once, or
        until the lease (default: the server's) runs out. Calling it again renews the lease.
        ``block_ids``: this rank's blocks of the request (1-D ints in ``[0, spec.num_blocks)``,
        each once; ``on_release`` gets them back), or None; others raise FkvError before anything
        is recorded.

        Readers are decode ranks (engine id, rank). With ``decode_engine_id`` and ``decode_tp``
        the readers of this rank are fixed now (the plan's rule); without, the first decode rank
        that reads and notifies fixes them to its engine. Notifications count only from the NIXL
        agent each reader announced at connect, once per reader: duplicates, strangers and
        failed reads never release blocks (``server.diagnostics()`` counts them).

        ``layers_ready``: None (default) means every layer is written; an int starts a
        *streaming* request with layers ``[0, layers_ready)`` written, the rest announced later
        with :meth:`publish` (decode ranks read it with ``client.read(..., stream=True)``)."""
        from fkv.connector.transport._lifecycle import _check_request_id, expected_readers

        _check_request_id(request_id)  # before the table's lookups (an unhashable id)
        lease = self.lease if lease is None else lease
        if (decode_engine_id is None) != (decode_tp is None):
            raise field_error("decode_engine_id/decode_tp", (decode_engine_id, decode_tp),
                              "both or neither")
        if block_ids is not None:
            self._check_blocks(block_ids)
        readers = None if decode_engine_id is None else expected_readers(
            decode_engine_id, decode_tp, self.engine.tp_size, self.engine.tp_rank)
        with self._lock:
            renew = self._table.holds(request_id)
            self._table.hold(request_id, block_ids, readers, now=time.monotonic(),
                             lease=lease, layers_ready=layers_ready)
            if not renew:  # a new hold: nothing of an earlier hold of this id carries over
                self._events.pop(request_id, None)
                self._published.pop(request_id, None)
                if layers_ready is not None:
                    self._published[request_id] = layers_ready
            # a renewal keeps the count, and a request held as fully written stays so (a
            # renewal's layers_ready never makes it streaming: publish still refuses it)
            self._board_set(request_id)
        self._wake()

    def publish(self, request_id: str, layers_ready: int, *, event: Any = None) -> None:
        """Announce that layers ``[0, layers_ready)`` of the streaming request are written.

        Monotonic: ``layers_ready`` may not go back nor past ``spec.num_layers`` (FkvError). On
        CUDA pass ``event``, a ``torch.cuda.Event`` recorded after the last of those layers'
        writes: readers see the layers only once it has completed (a thread of the server waits
        for it, so no reader's copy can overtake the writes; ipc readers wait for the
        interprocess event recorded after it instead); anything else is refused (FkvError)
        before the request changes. Renews the lease and wakes the readers' long polls."""
        _check_id(request_id)
        self._check_event(event)
        with self._lock:
            published = self._published.get(request_id)
            if published is None or not self._table.holds(request_id):
                why = ("it is not held" if not self._table.holds(request_id)
                       else "it was held as fully written")
                raise FkvError(f"publish: request {request_id!r} is not a streaming request on "
                               f"this rank ({why}); start it with server.hold(request_id, "
                               f"block_ids, layers_ready=0)")
            self._check_layers(layers_ready, published)
            done = event is None or event.query()  # before any change: it may raise
            if self._ipc_events and layers_ready > 0:
                self._record_publish(event, layers_ready)  # first: ipc readers wait for it
            self._published[request_id] = layers_ready
            now = time.monotonic()
            if done:
                self._events.pop(request_id, None)
                release = self._table.publish(request_id, layers_ready, now)
                self._board_set(request_id)  # first: same-host readers go as soon as it is set
                if release is None:
                    self._table.hold(request_id, None, None, now=now, lease=self.lease)  # renew
                self._due_release(release)
            else:
                self._table.hold(request_id, None, None, now=now, lease=self.lease)  # renew
                self._events.setdefault(request_id, []).append((layers_ready, event))
                self._board_set(request_id)
                if self._waiter is None:
                    self._waiter = _EventWaiter(self._event_done, self.errors)
                self._waiter.put(event)
                self._news = True  # readers counting published layers may go now
                return
            # the server thread has nothing to do for this publish unless a long poll is parked
            # or a release is due (same-host readers read the board); otherwise its next turn
            # (at most 2 ms) looks, as _news says
            busy = bool(self._parked) or release is not None
            self._news = True
        if busy:
            self._wake()

    def layers_ready(self, request_id: str) -> int | None:
        """Layers of ``request_id`` readers may read now (None: not held)."""
        _check_id(request_id)
        with self._lock:
            if not self._table.holds(request_id):
                return None
            return self._table.layers_ready(request_id)

    def _check_layers(self, value: Any, lo: int) -> None:
        top = self.spec.num_layers
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= top:
            raise field_error("layers_ready", value,
                              f"an int in [{lo}, {top}] (layers only move forward, up to "
                              f"spec.num_layers={top})")

    def _check_blocks(self, block_ids: Any) -> None:
        """Refuse block ids that are not this rank's: 1-D ints in ``[0, spec.num_blocks)``, each
        once (``hold`` frees them once per release)."""
        ids = check_block_ids("block_ids", block_ids, self.spec, False)
        if ids.size > 1:
            values, counts = np.unique(ids, return_counts=True)
            if counts.max() > 1:
                raise field_error("block_ids", _blocks_text(block_ids), "distinct block ids",
                                  f"block {int(values[counts > 1][0])} is listed more than once")

    def _check_event(self, event: Any) -> None:
        """``publish``'s event: None or a ``torch.cuda.Event``, or anything with the methods of
        one this rank calls: ``query()`` (the server thread), ``synchronize()`` (the event
        waiter) and, where ipc readers wait on this rank's interprocess events, ``wait(stream)``
        (``stream.wait_event``)."""
        if event is None:
            return
        methods = ("query", "synchronize", *(("wait",) if self._ipc_events else ()))
        if not all(callable(getattr(event, name, None)) for name in methods):
            fix = ("this rank's caches are on CPU: pass None once the host wrote the layers, an "
                   "event only when asynchronous CUDA copies write them"
                   if self._device.type != "cuda" else
                   "record one after the layers' writes: event = torch.cuda.Event(); "
                   "event.record()")
            calls = ", ".join(f"{name}()" for name in methods[:-1]) + f" and {methods[-1]}()"
            raise field_error("event", event, f"None or a torch.cuda.Event (an object with its "
                              f"{calls} methods)", fix)

    def _publish_events(self, device: Any) -> tuple[bytes, ...]:
        """Make the interprocess publish events (one per layer, at most MAX_PUBLISH_EVENTS);
        their IPC handles (none when CUDA refuses: ipc readers then wait for the writes through
        the server, like the NIXL paths)."""
        import torch

        from fkv.connector.wire import MAX_PUBLISH_EVENTS

        try:
            with torch.cuda.device(device):
                stream = torch.cuda.Stream(device)
                events = [torch.cuda.Event(interprocess=True)
                          for _ in range(min(self.spec.num_layers, MAX_PUBLISH_EVENTS))]
                for event in events:
                    event.record(stream)
                handles = tuple(bytes(event.ipc_handle()) for event in events)
        except Exception as e:  # noqa: BLE001 - any CUDA refusal: streaming still works
            self.errors.append(f"no interprocess publish events ({type(e).__name__}: {e})")
            return ()
        self._ipc_stream, self._ipc_events = stream, events
        return handles

    def _record_publish(self, event: Any, layers_ready: int) -> None:
        """Record the publish event of ``layers_ready``'s slot after ``event`` (or, without one,
        after the work the caller enqueued on its current stream so far): asynchronous, the host
        does not wait. Every record goes on the one stream, so a slot recorded again later (a
        layer of another request) completes no earlier: a reader may wait too long, never too
        little."""
        import torch

        stream = self._ipc_stream
        with torch.cuda.device(stream.device):
            if event is not None:
                stream.wait_event(event)
            else:
                stream.wait_stream(torch.cuda.current_stream(stream.device))
            self._ipc_events[(layers_ready - 1) % len(self._ipc_events)].record(stream)

    def _wake(self) -> None:
        """Let the server thread answer the Status long polls now (any thread)."""
        self._news = True
        sock = self._sock
        if sock is not None:
            sock.wake()

    def _event_done(self) -> None:
        """The event waiter saw a publish event complete (its thread)."""
        self._advance()
        self._wake()

    def _advance(self) -> None:
        """Make layers visible whose CUDA event completed (server thread, event waiter)."""
        with self._lock:
            if not self._events:
                return
            now = time.monotonic()
            for request_id, events in list(self._events.items()):
                while events and events[0][1].query():
                    layers = events.pop(0)[0]
                    if self._table.holds(request_id):
                        self._due_release(self._table.publish(request_id, layers, now))
                        self._board_set(request_id)
                        self._news = True
                if not events:
                    del self._events[request_id]

    def pending(self) -> set[str]:
        """Request ids whose blocks this rank still holds."""
        with self._lock:
            return set(self._table.pending())

    def released(self) -> dict[str, str]:
        """Recently released request ids and why: ``"notified"`` or ``"lease expired"``."""
        with self._lock:
            return self._table.released()

    def diagnostics(self) -> dict[str, Any]:
        """The request table's counters (held, accepted, released; premature: notifications
        that came before this rank published a streaming request's last layer, kept until it
        did; and every refused kind: duplicate, unexpected_reader, unknown_request, late,
        failed, malformed, foreign, impersonation) and its most recent refused or early
        notifications (bounded)."""
        with self._lock:
            return {"counts": self._table.stats(), "recent": self._table.events()}

    def stats(self) -> dict[str, Any]:
        """What this rank served so far as plain dicts: packs (path ``packed``: gather time and
        bytes), notifications, lease expiries, refused peer messages by reason (see
        ``fkv.telemetry.Telemetry.stats``)."""
        return self.telemetry.stats()

    def prometheus(self, registry: Any = None) -> Any:
        """Register this rank's metrics (label ``role="server"``) on ``registry`` (default: a new
        ``prometheus_client.CollectorRegistry``); returns it."""
        return self.telemetry.prometheus(registry)

    @property
    def pack_bytes(self) -> int:
        """Size of this rank's pack buffer (0: packed reads are not served)."""
        return 0 if self._packer is None else self._packer.capacity

    def packs_held(self) -> int:
        """Pack slots reserved now (packed reads whose READ has not freed them yet)."""
        packer = self._packer
        return 0 if packer is None else len(packer.slots.held)

    def close(self) -> None:
        """Stop serving, release NIXL resources. Idempotent. A server still open when its
        process exits through the interpreter (a script or notebook kernel that never closed it)
        is closed by an exit handler."""
        _OPEN.pop(self, None)
        self._stop.set()
        board = getattr(self, "_board", None)
        if board is not None:  # first: a same-host reader copying now must not trust its bytes
            with self._lock:  # not while a publish stores into it
                board.stop()
        waiter = getattr(self, "_waiter", None)
        if waiter is not None:
            waiter.stop()
        self._wake()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)
            if thread.is_alive():  # stuck in a NIXL call: leave the daemon thread, keep going
                self.errors.append("close: the server thread did not stop within 10 s")
                return
        self._shutdown()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Server(engine_id={self.engine.engine_id!r}, rank={self.engine.tp_rank}/"
                f"{self.engine.tp_size}, address={self.address!r}, pending={len(self.pending())}, "
                f"pack_bytes={self.pack_bytes})")

    # -- start and stop ----------------------------------------------------------------------------
    def _bind(self, host: str, port: int) -> str:
        self._sock = _side.SideServer(self._ctx, host,
                                      port if self.engine.tp_rank == 0 and port else 0,
                                      curve=self._curve)
        return self._sock.address

    def _make_board(self, regions: Any) -> Any:
        """The publish board (``_board``, vouching for this process and ``regions``), or None
        where ``/dev/shm`` cannot hold one (readers then only ask through the side channel)."""
        from fkv.connector.transport._board import Board
        from fkv.connector.transport._ipc import host_identity
        from fkv.connector.wire import BoardInfo

        try:
            self._board = Board()
            self._board.vouch_for(os.getpid(), regions)
        except OSError as e:
            if self._board is not None:
                self._board.close()
                self._board = None
            self.errors.append(f"no publish board ({e}): same-host readers ask for every layer")
            return None
        return BoardInfo(host=host_identity(), name=self._board.name, salt=self._board.salt,
                         pid=os.getpid())

    def _board_set(self, request_id: str) -> None:
        """Write a request's counts into the board, as a Status would answer them (under the
        lock): layers published (ipc readers wait for the publish events themselves) and layers
        whose writes finished."""
        if self._board is None or not self._table.holds(request_id):
            return
        written = self._table.layers_ready(request_id)
        published = self._published.get(request_id, written) if self._ipc_events else written
        self._board.set(request_id, published, written)

    def _shutdown(self) -> None:
        for agent in list(getattr(self, "_outboxes", ())):
            self._drop_outbox(agent)
        if getattr(self, "_board", None) is not None:
            with self._lock:
                self._board.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        agent = getattr(self, "_agent", None)
        if agent is not None:
            agent.close()
            self._agent = None
        self._packer = None
        if self._ctx is not None:
            # destroy, not term: a socket still open (a set-up step that failed before its
            # owner could close it) is closed with linger 0 instead of blocking term() for ever
            self._ctx.destroy(linger=0)
            self._ctx = None

    def _publish(self, address: str, entry: _side.RankEntry, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        msg = _side.Publish(rank=self.engine.tp_rank, peer=entry.peer, mem_type=entry.mem_type,
                            address=entry.address, pack_base=entry.pack_base,
                            pack_bytes=entry.pack_bytes, secret=self._secret)
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                reply = _side.request(self._ctx, address, msg,
                                      min(2.0, max(0.05, deadline - time.monotonic())),
                                      curve=self._curve)
            except SideChannelError as e:
                last = str(e)
                continue
            if isinstance(reply, _side.Ok):
                return
            if isinstance(reply, _side.Error) and not reply.retry:
                raise SideChannelError(f"rank 0 at {address} refused rank {self.engine.tp_rank}: "
                                       f"{reply.message}")
            last = str(reply)
            time.sleep(0.05)
        raise SideChannelError(f"rank {self.engine.tp_rank} could not publish through rank 0 at "
                               f"{address} within {timeout:g} s: {last}")

    # -- the server thread -------------------------------------------------------------------------
    def _run(self) -> None:
        spin, active = self._spin, 0.0
        while not self._stop.is_set():
            try:
                if self._sock is not None:
                    wait = 0.0 if time.monotonic() - active < spin else 0.002
                    batch = self._sock.poll(wait)
                    self._advance()
                    if self._parked_due():  # news first: a reader may be waiting for this layer
                        self._answer_parked()
                    if batch:
                        self._answer_all(batch)
                        active = time.monotonic()
                else:
                    self._stop.wait(0.002)
                self._take_notifications()
                self._advance()
                self._deliver_due()
                self._expire()
                if self._parked_due():
                    self._answer_parked()
            except Exception as e:  # keep serving; the error is visible in server.errors
                self.errors.append(f"{type(e).__name__}: {e}")
                self._stop.wait(0.01)

    def _due_release(self, release: Any) -> None:
        """A release a publish completed (every reader had notified early), under the lock:
        delivered by the server thread, where every ``on_release`` runs."""
        if release is not None:
            self._due.append(release)

    def _deliver_due(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for release in due:
            self._released_now(release)

    def _take_notifications(self) -> None:
        """The notifications NIXL delivered, then those the same-host outboxes hold."""
        try:
            batch = self._agent.notifications()
        except UndecodableNotifications as e:
            self.errors.append(str(e))
            self.telemetry.refused("undecodable_notifications")
            batch = []
        now = time.monotonic()
        for sender, message in batch:
            self._notified(sender, message, now)
        if self._outboxes:
            with self._lock:
                held = self._table.held()
            if held or now >= self._outbox_due:
                self._outbox_due = now + OUTBOX_IDLE_LOOK
                self._take_outboxes(now)

    def _notified(self, sender: str, message: bytes, now: float) -> None:
        """One peer notification from NIXL agent ``sender`` (or the outbox announced for it)."""
        if message.startswith(FREE_PREFIX):
            if self._packer is None or not self._packer.free(message):
                self.errors.append(f"ignored a free of no held slot {message[:40]!r}")
                self.telemetry.refused("unknown_slot")
            return
        self.telemetry.notification()
        with self._lock:
            before = self._table.stats()
            release = self._table.notified(sender, message, now)
            after = self._table.stats()
        for kind in _REFUSED_KINDS:
            if after[kind] > before[kind]:
                self.telemetry.refused(kind)
        if release is not None:
            self._released_now(release)

    # -- same-host outboxes (``_outbox``) ------------------------------------------------------------
    def _open_outbox(self, agent: str, info: Any) -> bool:
        """Read ``info``'s outbox as agent ``agent``'s notifications from now on (replacing the
        one it had); False (its notifications come through NIXL) when there is none, it is on
        another host, another agent's, or it fails its checks (counted refused ``outbox``)."""
        from fkv.connector.transport._ipc import host_identity
        from fkv.connector.transport._outbox import OutboxReader

        self._drop_outbox(agent)
        with self._lock:
            gone = [a for a in self._outboxes if self._table.bound(a) is None]
        for a in gone:  # agents unbound since (evicted, or replaced by a reconnect)
            self._drop_outbox(a)
        if info is None or info.host != host_identity():
            return False
        if any(box.name == info.name for box in self._outboxes.values()):
            # another agent's outbox: a second reader would take its records as this agent's
            self.errors.append(f"hello from agent {agent[:64]!r}: outbox {info.name} is read "
                               f"for another agent")
            self.telemetry.refused("outbox")
            return False
        if len(self._outboxes) >= MAX_OUTBOXES:
            self._drop_outbox(min(self._outboxes, key=lambda a: self._outboxes[a].active))
        try:
            self._outboxes[agent] = OutboxReader(info.name, info.token)
        except FkvError as e:
            self.errors.append(f"hello from agent {agent[:64]!r}: {e}")
            self.telemetry.refused("outbox")
            return False
        return True

    def _drop_outbox(self, agent: str) -> None:
        box = self._outboxes.pop(agent, None)
        if box is not None:
            box.close()

    def _take_outboxes(self, now: float) -> None:
        from fkv.connector.transport._outbox import OutboxCorrupt

        for agent, box in list(self._outboxes.items()):
            try:
                messages = box.take()
            except OutboxCorrupt as e:
                self._drop_outbox(agent)
                self.errors.append(f"agent {agent[:64]!r}: {e}")
                self.telemetry.refused("outbox")
                continue
            for message in messages:
                self._notified(agent, message, now)
            if box.ended:  # its decode rank closed it and everything it wrote was taken
                self._drop_outbox(agent)

    def _answer_all(self, batch: list[tuple[Any, bytes | None]]) -> None:
        """Answer a batch of requests ``(envelope, payload)`` in order. A pack's reply goes out
        once its own gather has finished: on CPU right after it ran, on CUDA after every gather
        of the batch is launched (each reply waits for its gather's event only)."""
        queued = self._packer is not None and self._packer.asynchronous
        t0 = time.perf_counter()
        out: list[tuple[Any, Any]] = []
        for envelope, payload in batch:
            out.append(self._reply(envelope, payload))
            if not queued:
                t0 = self._send_replies(out, t0)
        self._send_replies(out, t0)

    def _send_replies(self, out: list[tuple[Any, Any]], t0: float) -> float:
        """Send (and drop from ``out``) every reply, a pack's once its gather has finished (a
        gather that failed on the device turns its reply into an error and frees its slot); a
        pack's gather time counts from ``t0`` or the previous pack's reply. Returns the time the
        last reply went out."""
        for envelope, reply in out:
            if reply is None:  # a parked Status: answered later
                continue
            if isinstance(reply, _side.Packed):
                try:
                    self._packer.sync(reply.slot)
                    now = time.perf_counter()
                    self.telemetry.record(path="packed", seconds=now - t0, nbytes=reply.nbytes,
                                          descriptors=1, waits={"gather": now - t0})
                    t0 = now
                except Exception as e:  # the gather may not have run: refuse the pack
                    self._packer.slots.held.pop(reply.slot, None)
                    reply = _side.Error(message=f"pack failed on prefill rank "
                                        f"{self.engine.tp_rank}: {type(e).__name__}: {e}",
                                        token=reply.token)
            self._send(envelope, reply)
        out.clear()
        return time.perf_counter()

    def _send(self, envelope: Any, reply: Any) -> None:
        """Send one reply. One too large for the side channel goes out as an Error saying so;
        a connection whose reply cannot be sent at all is closed (a plain-TCP connection waits
        for its answer before reading again: left open, it would hold a connection slot)."""
        try:
            payload = _side.encode_message(reply)
            if len(payload) > _side.MAX_SIDE_MESSAGE_BYTES:
                payload = _side.encode_message(_side.Error(
                    message=f"the {type(reply).__name__} reply is {len(payload)} bytes, more "
                    f"than the side channel's {_side.MAX_SIDE_MESSAGE_BYTES}",
                    token=getattr(reply, "token", 0)))
            if not self._sock.reply(envelope, payload):
                self.errors.append("reply not sent: the requester left")
        except Exception as e:  # noqa: BLE001 - never leave the connection waiting for it
            self.errors.append(f"reply not sent: {type(e).__name__}: {str(e)[:200]}")
            close = getattr(self._sock, "close_connection", None)
            if close is not None:
                close(envelope)

    def _reply(self, envelope: Any, payload: bytes | None) -> tuple[Any, Any]:
        if payload is None:
            self.telemetry.refused("frames")
            return envelope, _side.Error(message="expected one message frame")
        try:
            msg = _side.decode_request(payload)
        except Exception as e:  # noqa: BLE001 - SideChannelError; anything else is answered too
            self.telemetry.refused("undecodable")
            return envelope, _side.Error(message=str(e)[:4096])
        try:
            reply = self._handle(msg)
            if reply is _PARK:
                peer = _peer_of(envelope)
                if sum(1 for e, _, _ in self._parked if _peer_of(e) == peer) \
                        >= MAX_PARKED_PER_PEER:
                    return envelope, self._layers(msg)  # what there is now
                until = time.monotonic() + msg.wait
                self._parked.append((envelope, msg, until))
                self._parked_until = min(self._parked_until, until)
                return envelope, None
            return envelope, reply
        except FkvError as e:
            self.telemetry.refused(type(msg).__name__.lower())
            return envelope, _side.Error(message=str(e)[:4096])
        except Exception as e:
            return envelope, _side.Error(message=f"internal error: {type(e).__name__}: "
                                         f"{str(e)[:4000]}")

    def _handle(self, msg: Any) -> Any:
        tp, rank = self.engine.tp_size, self.engine.tp_rank
        if isinstance(msg, _side.Ping):
            return _side.Ok(engine_id=self.engine.engine_id)
        if isinstance(msg, _side.Status):
            self._advance()
            reply = self._layers(msg)
            if (msg.wait > 0 and reply.layers_ready <= msg.after
                    and len(self._parked) < MAX_PARKED):
                return _PARK
            return reply
        if isinstance(msg, _side.Hello):
            if len(msg.secret) < 16:
                self.telemetry.refused("hello")
                return _side.Error(message=f"hello refused: the secret is {len(msg.secret)} "
                                   f"bytes; at least 16 random bytes are needed (every decode "
                                   f"process draws one at start: upgrade that rank's fkv)")
            with self._lock:
                self._table.bind(msg.agent, (msg.engine_id, msg.rank), decode_tp=msg.tp_size,
                                 secret=msg.secret)
            return _side.Ok(engine_id=self.engine.engine_id,
                            outbox=self._open_outbox(msg.agent, msg.outbox))
        if isinstance(msg, _side.Pack):
            if self._packer is None:
                return _side.Error(message=f"prefill rank {rank} serves no pack buffer "
                                   f"(serve(..., pack_bytes=0))", token=msg.token)
            self._advance()  # layers whose publish event completed since the last poll
            with self._lock:  # a pack never carries layers this rank has not published
                held = self._table.holds(msg.request_id)
                published = self._table.layers_ready(msg.request_id) if held else None
            try:
                reply = self._packer.pack(msg, self.lease, sync=False, published=published,
                                          held=held)
                if isinstance(reply, _side.Error) and reply.retry:  # frees may be waiting
                    self._take_notifications()
                    reply = self._packer.pack(msg, self.lease, sync=False, published=published,
                                              held=held)
                return reply
            except Exception as e:
                return _side.Error(message=f"pack failed on prefill rank {rank}: "
                                   f"{type(e).__name__}: {e}", token=msg.token)
        if rank != 0:
            return _side.Error(message=f"prefill rank {rank} answers pack requests only; "
                               f"ask rank 0 for the engine's metadata")
        if isinstance(msg, _side.Fetch):
            missing = [r for r in range(tp) if r not in self._ranks]
            if missing:
                return _side.Error(message=f"prefill engine {self.engine.engine_id!r}: ranks "
                                   f"{missing} of tp_size {tp} have not joined yet", retry=True)
            return _side.Ranks(ranks=[self._ranks[r] for r in range(tp)])
        # Publish from rank k > 0: validate its bytes with the wire decoder before keeping them.
        peer = decode_untrusted(msg.peer)
        e = peer.engine
        problems = []
        if e.engine_id != self.engine.engine_id:
            problems.append(f"engine_id {e.engine_id!r} is not {self.engine.engine_id!r}")
        if e.tp_size != tp:
            problems.append(f"tp_size {e.tp_size} is not {tp}")
        if not 0 < msg.rank < tp or e.tp_rank != msg.rank:
            problems.append(f"rank {msg.rank} (engine says {e.tp_rank}) must be in [1, {tp})")
        if peer.spec != self.spec:
            problems.append(f"spec {peer.spec!r} differs from rank 0's {self.spec!r} (every rank "
                            f"of an engine must share one spec, num_blocks included)")
        digest = hashlib.sha256(msg.secret).digest()
        known = self._secrets.get(msg.rank)
        if not problems and known is not None and not hmac.compare_digest(known, digest):
            problems.append(f"rank {msg.rank} already published with another secret (a rank's "
                            f"entry can be replaced only by that rank; restart the whole prefill "
                            f"engine to replace a rank's process)")
        entry = _side.RankEntry(peer=msg.peer, mem_type=msg.mem_type, address=msg.address,
                                pack_base=msg.pack_base, pack_bytes=msg.pack_bytes)
        if not problems:  # every Fetch answers all ranks in one reply: it must fit one
            reply = len(_side.encode_message(_side.Ranks(
                ranks=list({**self._ranks, msg.rank: entry}.values()))))
            if reply > _side.MAX_SIDE_MESSAGE_BYTES:
                problems.append(f"with this rank's {len(msg.peer)} bytes of metadata the "
                                f"engine's ranks would make a {reply}-byte reply, more than the "
                                f"side channel's {_side.MAX_SIDE_MESSAGE_BYTES}")
        if not problems and len(msg.secret) < 16:
            problems.append(f"the secret is {len(msg.secret)} bytes; at least 16 random bytes "
                            f"are needed (every rank > 0 draws one at start: upgrade that rank's "
                            f"fkv)")
        if problems:
            self.telemetry.refused("publish")
            return _side.Error(message="publish refused: " + "; ".join(problems))
        self._secrets[msg.rank] = digest
        self._ranks[msg.rank] = entry
        return _side.Ok(engine_id=self.engine.engine_id)

    def _layers(self, msg: _side.Status) -> _side.Layers:
        with self._lock:
            if not self._table.holds(msg.request_id):
                return _side.Layers(token=msg.token, layers_ready=0, held=False)
            ready = self._table.layers_ready(msg.request_id)
            if msg.recorded and self._ipc_events:
                ready = self._published.get(msg.request_id, ready)
            return _side.Layers(token=msg.token, layers_ready=ready, held=True)

    def _parked_due(self) -> bool:
        """Whether a parked long poll may have an answer now: something changed since the last
        look, or the earliest wait is over. ``_news`` is set after every change and cleared
        before a look reads the polls' answers, so a change the look missed sets it again."""
        return bool(self._parked) and (self._news or time.monotonic() >= self._parked_until
                                       or self._stop.is_set())

    def _answer_parked(self) -> None:
        """Answer the Status long polls that have news, or whose wait is over."""
        self._news = False  # first: a change from now on is looked at by the next call
        now = time.monotonic()
        keep = []
        for envelope, msg, until in self._parked:
            reply = self._layers(msg)
            if reply.layers_ready > msg.after or now >= until or self._stop.is_set():
                self._send(envelope, reply)
            else:
                keep.append((envelope, msg, until))
        self._parked = keep
        self._parked_until = min((until for _, _, until in keep), default=float("inf"))

    def _expire(self) -> None:
        with self._lock:
            expired = self._table.expire(time.monotonic())
            for release in expired:
                self._published.pop(release.request_id, None)
                self._events.pop(release.request_id, None)
        for release in expired:
            self._released_now(release)
        if expired:
            self.telemetry.lease_expired(len(expired))
        if self._packer is not None:
            self._packer.expire()

    def _released_now(self, release: Any) -> None:
        self._news = True  # a long poll on this id is answered (no longer held)
        with self._lock:
            # The table released it under this lock earlier; if the id was held again since,
            # these entries are the new hold's and stay.
            if not self._table.holds(release.request_id):
                self._published.pop(release.request_id, None)
                self._events.pop(release.request_id, None)
                if self._board is not None:
                    self._board.clear(release.request_id)
        if self._on_release is not None:
            try:  # one failing callback must not lose the others (nor stop the loop)
                self._on_release(release.request_id, release.block_ids, release.reason)
            except Exception as e:
                self.errors.append(f"on_release({release.request_id!r}) raised "
                                   f"{type(e).__name__}: {e}")


def _peer_of(envelope: Any) -> Any:
    """The connection a request came on: a ZMQ envelope's routing id, a frame server's
    connection id."""
    return bytes(envelope[0]) if isinstance(envelope, list) and envelope else envelope


def _check_id(request_id: Any) -> None:
    """A request id of the local user is a non-empty str (FkvError otherwise): a held one was
    checked in full at ``hold``, so this is all a lookup needs, kept cheap for ``publish``."""
    if not isinstance(request_id, str) or not request_id:
        raise field_error("request_id", request_id, "a non-empty str")


class _EventWaiter:
    """A thread that waits, in publish order, for the CUDA events of :meth:`Server.publish`
    (``event.synchronize()`` releases the GIL) and calls ``done`` after each: the layers become
    visible to the long polls as soon as their writes finished, with no polling in between."""

    def __init__(self, done: Callable[[], None], errors: collections.deque[str]) -> None:
        self._done = done
        self._errors = errors  # the server's ``errors``
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fkv-publish-events", daemon=True)
        self._thread.start()

    def put(self, event: Any) -> None:
        self._queue.put(event)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            with contextlib.suppress(Exception):  # the server loop's query() sees it too
                event.synchronize()
            try:
                self._done()
            except Exception as e:  # keep waiting for the next events; the error stays visible
                self._errors.append(f"publish event waiter: {type(e).__name__}: {e}")
