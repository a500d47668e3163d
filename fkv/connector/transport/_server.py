"""The prefill side of the transport: a :class:`Server` per prefill rank (``fkv.connector.serve``).

A server registers its rank's caches (and its pack buffer) with its own NIXL agent, then runs one
thread that does everything afterwards, so NIXL is only ever called from that thread:

- answers its side-channel socket: rank 0 for the whole engine (``Fetch``, ``Publish`` from ranks
  ``1..tp-1``), every rank with a pack buffer for ``Pack`` requests of packed reads. Packs run on
  this thread between polls: the requests waiting on the socket are taken as one batch and
  answered in order; each pack's gather (one launch for all layers) is launched as its request
  comes up, and its reply goes out as soon as that gather has finished (CUDA: its own event, with
  the gathers behind it already queued; CPU: right after it ran), so a decode rank that keeps
  several chunks in flight READs one while the next is gathered. A pack that finds the buffer
  full first takes in the NIXL notifications that free slots, then asks the requester to retry if
  it still does not fit;
- polls NIXL notifications: ``"<request id>:<decode tp>"`` counts a reader of a request (held
  blocks are released after the expected count, or when the lease runs out); a
  :data:`fkv.connector._pack.FREE_PREFIX` notification frees a pack slot;
- expires leases and pack slots.

Errors inside the loop never stop it: they land in ``server.errors``. ``FKV_TRANSPORT_SPIN``
(seconds, default 0) keeps the loop busy-polling that long after each request instead of sleeping
in ``poll``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from fkv.connector.transport import _side
from fkv.connector.transport._base import (
    DEFAULT_LEASE,
    DEFAULT_PACK_BYTES,
    cache_regions,
    check_engine,
    layer_views,
    spin_seconds,
    zmq,
)
from fkv.connector.transport._agent import Agent
from fkv.connector.transport._base import SideChannelError
from fkv.connector.transport._packer import FREE_PREFIX, Packer
from fkv.connector.handshake import EngineDesc
from fkv.connector.plan import expected_notifications
from fkv.connector.wire import decode_untrusted, encode
from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec

__all__ = ["Server"]


@attrs.define
class _Held:
    block_ids: Any
    deadline: float
    notified: int = 0
    expected: int | None = None


class Server:
    """One prefill rank: its registered caches, notification tracking, its pack buffer and, on
    rank 0, the side channel for the whole engine. Use ``fkv.connector.serve``; a context
    manager."""

    def __init__(self, engine: EngineDesc, spec: KVCacheSpec, caches: Any, *,
                 host: str = "127.0.0.1", port: int = 0, join: str | None = None,
                 lease: float = DEFAULT_LEASE, join_timeout: float = 30.0,
                 on_release: Callable[[str, Any, str], None] | None = None,
                 pack_bytes: int | None = None) -> None:
        self.engine = check_engine(engine)
        self.spec = spec
        if engine.tp_rank == 0 and join is not None:
            raise field_error("join", join, "None on rank 0 (rank 0 answers the side channel)")
        if engine.tp_rank > 0 and not isinstance(join, str):
            raise field_error("join", join, f"rank 0's address (a str) on rank {engine.tp_rank}",
                              "pass join=<the address rank 0's server reports>")
        if not isinstance(lease, int | float) or isinstance(lease, bool) or lease <= 0:
            raise field_error("lease", lease, "a positive number of seconds")
        if pack_bytes is not None and (isinstance(pack_bytes, bool)
                                       or not isinstance(pack_bytes, int) or pack_bytes < 0):
            raise field_error("pack_bytes", pack_bytes, "None (default) or a non-negative int")
        regions, mem_type, device_id, device = cache_regions(spec, caches)
        if pack_bytes is None:
            pack_bytes = min(DEFAULT_PACK_BYTES, spec.region_bytes * spec.num_regions)
        self.lease = float(lease)
        self._on_release = on_release
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._released: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._stop = threading.Event()
        self._sock: Any = None
        self._ranks: dict[int, _side.RankEntry] = {}
        self._packer: Packer | None = None
        self._spin = spin_seconds()
        self.errors: list[str] = []
        self._ctx = zmq().Context()
        self._agent = Agent("prefill")
        try:
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
                self.ipc_reason = "the caches are not on CUDA"
            wire = encode(engine, spec, regions, device_id=device_id,
                          agent_metadata=self._agent.metadata(), ipc=ipc)
            own = self._bind(host, port) if engine.tp_rank == 0 or self._packer else ""
            packer = self._packer
            entry = _side.RankEntry(peer=wire, mem_type=mem_type, address=own if packer else "",
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

    # -- public ------------------------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: Any = None, *, lease: float | None = None) -> None:
        """Hold ``request_id``'s blocks until every expected decode reader notified, or until the
        lease (default: the server's) runs out. Calling it again renews the lease."""
        if not isinstance(request_id, str) or not request_id:
            raise field_error("request_id", request_id, "a non-empty str")
        lease = self.lease if lease is None else lease
        with self._lock:
            held = self._held.get(request_id)
            deadline = time.monotonic() + float(lease)
            if held is None:
                self._released.pop(request_id, None)
                self._held[request_id] = _Held(block_ids, deadline)
            else:
                held.deadline = deadline
                if block_ids is not None:
                    held.block_ids = block_ids

    def pending(self) -> set[str]:
        """Request ids whose blocks this rank still holds."""
        with self._lock:
            return set(self._held)

    def released(self) -> dict[str, str]:
        """Recently released request ids and why: ``"notified"`` or ``"lease expired"``."""
        with self._lock:
            return dict(self._released)

    @property
    def pack_bytes(self) -> int:
        """Size of this rank's pack buffer (0: packed reads are not served)."""
        return 0 if self._packer is None else self._packer.capacity

    def packs_held(self) -> int:
        """Pack slots reserved now (packed reads whose READ has not freed them yet)."""
        packer = self._packer
        return 0 if packer is None else len(packer.slots.held)

    def close(self) -> None:
        """Stop serving, release NIXL resources. Idempotent."""
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()
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
        z = zmq()
        self._sock = self._ctx.socket(z.ROUTER)
        self._sock.setsockopt(z.LINGER, 0)
        self._sock.setsockopt(z.MAXMSGSIZE, _side.MAX_SIDE_MESSAGE_BYTES)
        self._sock.setsockopt(z.ROUTER_MANDATORY, 0)
        try:
            self._sock.bind(f"tcp://{host}:{port if self.engine.tp_rank == 0 and port else '*'}")
        except z.ZMQError as e:
            raise field_error("host/port", f"{host}:{port}", f"an address to bind ({e})") from None
        return self._sock.getsockopt(z.LAST_ENDPOINT).decode()

    def _shutdown(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        agent = getattr(self, "_agent", None)
        if agent is not None:
            agent.close()
            self._agent = None
        self._packer = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _publish(self, address: str, entry: _side.RankEntry, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        msg = _side.Publish(rank=self.engine.tp_rank, peer=entry.peer, mem_type=entry.mem_type,
                            address=entry.address, pack_base=entry.pack_base,
                            pack_bytes=entry.pack_bytes)
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                reply = _side.request(self._ctx, address, msg,
                                      min(2.0, max(0.05, deadline - time.monotonic())))
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
        z = zmq()
        spin, active = self._spin, 0.0
        while not self._stop.is_set():
            try:
                if self._sock is not None:
                    wait = 0 if time.monotonic() - active < spin else 2
                    if self._sock.poll(wait, z.POLLIN):
                        batch = []
                        for _ in range(64):
                            try:
                                batch.append(self._sock.recv_multipart(z.NOBLOCK))
                            except z.Again:
                                break
                        self._answer_all(batch)
                        active = time.monotonic()
                else:
                    self._stop.wait(0.002)
                self._take_notifications()
                self._expire()
            except Exception as e:  # keep serving; the error is visible in server.errors
                self.errors.append(f"{type(e).__name__}: {e}")
                del self.errors[:-100]
                self._stop.wait(0.01)

    def _take_notifications(self) -> None:
        for message in self._agent.notifications():
            if message.startswith(FREE_PREFIX):
                if self._packer is None or not self._packer.free(message):
                    self.errors.append(f"ignored a free of no held slot {message[:40]!r}")
            else:
                self._notified(message)

    def _answer_all(self, batch: list[list[bytes]]) -> None:
        """Answer a batch of requests in order. A pack's reply goes out once its own gather has
        finished: on CPU right after it ran, on CUDA after every gather of the batch is launched
        (each reply waits for its gather's event only)."""
        queued = self._packer is not None and self._packer.asynchronous
        out: list[tuple[list[bytes], Any]] = []
        for frames in batch:
            out.append(self._reply(frames))
            if not queued:
                self._send_replies(out)
        self._send_replies(out)

    def _send_replies(self, out: list[tuple[list[bytes], Any]]) -> None:
        """Send (and drop from ``out``) every reply, a pack's once its gather has finished (a
        gather that failed on the device turns its reply into an error and frees its slot)."""
        for envelope, reply in out:
            if isinstance(reply, _side.Packed):
                try:
                    self._packer.sync(reply.slot)
                except Exception as e:  # the gather may not have run: refuse the pack
                    self._packer.slots.held.pop(reply.slot, None)
                    reply = _side.Error(message=f"pack failed on prefill rank "
                                        f"{self.engine.tp_rank}: {type(e).__name__}: {e}",
                                        token=reply.token)
            try:
                self._sock.send_multipart([*envelope, _side.encode_message(reply)], zmq().NOBLOCK)
            except Exception as e:  # the requester left: nothing to answer
                self.errors.append(f"reply not sent: {e}")
        out.clear()

    def _reply(self, frames: list[bytes]) -> tuple[list[bytes], Any]:
        if len(frames) >= 3 and frames[1] == b"":
            envelope, body = frames[:2], frames[2:]
        else:
            envelope, body = frames[:1], frames[1:]
        if len(body) != 1:
            return envelope, _side.Error(message=f"expected one message frame, got {len(body)}")
        try:
            return envelope, self._handle(_side.decode_request(body[0]))
        except FkvError as e:
            return envelope, _side.Error(message=str(e))
        except Exception as e:
            return envelope, _side.Error(message=f"internal error: {type(e).__name__}: {e}")

    def _handle(self, msg: Any) -> Any:
        tp, rank = self.engine.tp_size, self.engine.tp_rank
        if isinstance(msg, _side.Ping):
            return _side.Ok(engine_id=self.engine.engine_id)
        if isinstance(msg, _side.Pack):
            if self._packer is None:
                return _side.Error(message=f"prefill rank {rank} serves no pack buffer "
                                   f"(serve(..., pack_bytes=0))", token=msg.token)
            try:
                reply = self._packer.pack(msg, self.lease, sync=False)
                if isinstance(reply, _side.Error) and reply.retry:  # frees may be waiting
                    self._take_notifications()
                    reply = self._packer.pack(msg, self.lease, sync=False)
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
        if problems:
            return _side.Error(message="publish refused: " + "; ".join(problems))
        self._ranks[msg.rank] = _side.RankEntry(peer=msg.peer, mem_type=msg.mem_type,
                                                address=msg.address, pack_base=msg.pack_base,
                                                pack_bytes=msg.pack_bytes)
        return _side.Ok(engine_id=self.engine.engine_id)

    def _notified(self, message: bytes) -> None:
        try:
            request_id, _, dtp = message.decode().rpartition(":")
            decode_tp = int(dtp)
            if not request_id or decode_tp < 1:
                raise ValueError(message)
        except (UnicodeDecodeError, ValueError):
            self.errors.append(f"ignored a malformed notification {message[:80]!r}")
            return
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                if request_id in self._released:
                    return  # a late reader of a request already freed
                held = self._held[request_id] = _Held(None, time.monotonic() + self.lease)
            held.notified += 1
            held.expected = expected_notifications(self.engine.tp_size, decode_tp)
            done = held.notified >= held.expected
        if done:
            self._release(request_id, "notified")

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [r for r, h in self._held.items() if h.deadline <= now]
        for request_id in expired:
            self._release(request_id, "lease expired")
        if self._packer is not None:
            self._packer.expire()

    def _release(self, request_id: str, why: str) -> None:
        with self._lock:
            held = self._held.pop(request_id, None)
            if held is None:
                return
            self._released[request_id] = why
            while len(self._released) > 4096:
                self._released.popitem(last=False)
        if self._on_release is not None:
            self._on_release(request_id, held.block_ids, why)
