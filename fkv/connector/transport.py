"""Real prefill -> decode transfers: NIXL READs planned by the handshake, a ZMQ side channel.

Prefill side, on every rank (rank 0 answers the side channel for the whole engine)::

    server = fkv.connector.serve(engine, spec, caches)                      # rank 0
    server = fkv.connector.serve(engine, spec, caches, join=rank0_address)  # ranks 1..tp-1
    server.hold(request_id, block_ids)   # optional: the lease starts now (else at first notify)
    server.pending()                     # request ids whose blocks are still held

Decode side, on every rank::

    with fkv.connector.connect(engine, spec, caches, remote_address=rank0_address) as client:
        result = client.read(request_id, local_block_ids, remote_block_ids)
        assert result.ok, result.error

``connect`` fetches every prefill rank's metadata through rank 0 (peer bytes go through
``fkv.connector.wire.decode_untrusted`` only), runs :func:`fkv.connector.handshake` (a
:class:`HandshakeRejected` carries every reason), registers the local cache regions once and
prepares NIXL descriptor lists once locally and once per remote rank. ``read`` checks the block ids
against both caches before anything moves, posts one READ per remote rank with the plan's rows,
polls them to DONE within ``timeout``, runs the plan's staging moves (``fkv.ops.move`` from a
registered staging buffer) when the plan has them, and notifies the prefill ranks
(``"<request id>:<decode tp size>"``, also the ``notify_only_ranks``). It returns a
:class:`ReadResult`; ``ok`` is True only when every byte landed.

Caches are ``fkv.allocate(spec, device)`` views (CPU DRAM or CUDA VRAM). NIXL is only ever called
from one thread at a time: the server's own thread after start-up, the client under a lock.

>>> import fkv, torch
>>> from fkv.connector import EngineDesc, serve, connect
>>> spec = fkv.KVCacheSpec(layout="HND", num_blocks=4, block_size=4, num_kv_heads=2, head_size=8)
>>> p = EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=2)
>>> d = EngineDesc(engine_id="d", tp_size=1, tp_rank=0, total_num_kv_heads=2)
>>> src, dst = fkv.allocate(spec), fkv.allocate(spec)
>>> _ = src[0].copy_(torch.randn(src[0].shape))
>>> with serve(p, spec, src) as server, connect(d, spec, dst, remote_address=server.address) as c:
...     result = c.read("req-1", [2, 0], [1, 3])
>>> result.ok, result.bytes, torch.equal(dst[0][2], src[0][1])
(True, 512, True)
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from fkv.connector import _side
from fkv.connector._nixl import Agent, TransferFailed, granule_table, row_indices, tensor_memory
from fkv.connector._side import SideChannelError
from fkv.connector.handshake import EngineDesc, check_remote_ranks, handshake
from fkv.connector.plan import TransferPlan, expected_notifications
from fkv.connector.wire import Peer, decode_untrusted, encode
from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec

__all__ = [
    "Client", "HandshakeRejected", "ReadResult", "Server", "SideChannelError", "TransferFailed",
    "connect", "serve",
]

#: Seconds a prefill rank holds a request's blocks waiting for notifications (configurable).
DEFAULT_LEASE = 120.0
#: Default staging capacity (bytes) when the plan stages; larger reads go in chunks.
DEFAULT_STAGING_BYTES = 64 << 20


class HandshakeRejected(FkvError):
    """``connect`` refused the pair: ``reasons`` holds every :class:`~fkv.connector.Reason`."""

    def __init__(self, message: str, reasons: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.reasons = reasons


@attrs.frozen
class ReadResult:
    """Outcome of :meth:`Client.read`. ``ok`` only when every READ finished, the staging moves ran
    and the prefill ranks were notified; ``bytes`` moved by finished READs; ``descriptors`` the
    coalesced rows posted; ``error`` says what failed (None when ok); ``seconds`` the whole call,
    ``transfer_seconds`` the part spent posting READs and waiting for them (the rest: planning,
    staging moves, notifications)."""

    ok: bool
    request_id: str
    bytes: int
    descriptors: int
    seconds: float
    error: str | None = None
    transfer_seconds: float = 0.0  # of ``seconds``: posting the READs until they were DONE


# -- caches -> registered regions -----------------------------------------------------------------

def _layer_views(spec: KVCacheSpec, caches: Any) -> list[Any]:
    if not isinstance(spec, KVCacheSpec):
        raise field_error("spec", spec, "a KVCacheSpec")
    if hasattr(caches, "shape"):
        caches = [caches]
    try:
        views = list(caches)
    except TypeError:
        raise field_error("caches", type(caches).__name__,
                          "the list of per-layer views fkv.allocate(spec) returns") from None
    if len(views) != spec.num_layers:
        raise field_error("caches", f"{len(views)} views", f"{spec.num_layers} views (spec.num_layers)",
                          "pass the list fkv.allocate(spec, device) returns")
    return views


def cache_regions(spec: KVCacheSpec, caches: Any) -> tuple[list[tuple[int, int]], str, int, Any]:
    """``(regions, mem_type, device_id, device)`` of ``fkv.allocate``-style views of ``spec``.

    Checks shape, dtype, strides (the layout is read from the tensors, never trusted), device and
    that each region's bytes really lie in the tensor's storage.
    """
    from fkv.tensors import torch_dtype

    views = _layer_views(spec, caches)
    dtype = torch_dtype(spec.dtype)
    device = views[0].device
    for i, t in enumerate(views):
        if not hasattr(t, "stride"):
            raise field_error(f"caches[{i}]", type(t).__name__, "a torch.Tensor")
        if tuple(t.shape) != spec.logical_shape or t.dtype != dtype:
            raise field_error(f"caches[{i}]", f"shape {tuple(t.shape)} dtype {t.dtype}",
                              f"shape {spec.logical_shape} dtype {dtype} (the spec's logical view)")
        if tuple(t.stride()) != spec.element_strides:
            raise field_error(f"caches[{i}].stride()", tuple(t.stride()),
                              f"{spec.element_strides} (the {spec.layout.value} layout of the spec)",
                              "allocate caches with fkv.allocate(spec), or pass the spec "
                              "fkv.infer_spec derives from them")
        if t.device != device:
            raise field_error(f"caches[{i}].device", str(t.device), f"{device} like caches[0]")
    mem_type, device_id = tensor_memory(views[0])
    item = spec.itemsize
    if spec.cross_layer:
        base = views[0].data_ptr()
        for layer, t in enumerate(views):
            want = base + layer * spec.layer_stride * item
            if t.data_ptr() != want:
                raise field_error(f"caches[{layer}]", f"data at 0x{t.data_ptr():x}",
                                  f"layer {layer} of one cross-layer buffer at 0x{want:x}")
        regions = [(base, spec.region_bytes)]
        starts = [views[0]]
    else:
        regions = [(t.data_ptr(), spec.region_bytes) for t in views]
        starts = views
    for i, t in enumerate(starts):
        room = t.untyped_storage().nbytes() - t.storage_offset() * item
        if room < spec.region_bytes:
            raise field_error(f"caches[{i}]", f"a view with {room} bytes of storage",
                              f"{spec.region_bytes} bytes (spec.region_bytes)")
    return regions, mem_type, device_id, device


def _check_engine(engine: Any) -> EngineDesc:
    if not isinstance(engine, EngineDesc):
        raise field_error("engine", type(engine).__name__, "an fkv.connector.EngineDesc")
    return engine


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - pyzmq is a declared dependency
        raise FkvError("the fkv side channel needs pyzmq: pip install pyzmq") from e
    return zmq


# -- prefill side ---------------------------------------------------------------------------------

@attrs.define
class _Held:
    block_ids: Any
    deadline: float
    notified: int = 0
    expected: int | None = None


class Server:
    """One prefill rank: its registered caches, notification tracking and, on rank 0, the side
    channel for the whole engine. Use :func:`serve` to create one; a context manager."""

    def __init__(self, engine: EngineDesc, spec: KVCacheSpec, caches: Any, *,
                 host: str = "127.0.0.1", port: int = 0, join: str | None = None,
                 lease: float = DEFAULT_LEASE, join_timeout: float = 30.0,
                 on_release: Callable[[str, Any, str], None] | None = None) -> None:
        self.engine = _check_engine(engine)
        self.spec = spec
        if engine.tp_rank == 0 and join is not None:
            raise field_error("join", join, "None on rank 0 (rank 0 answers the side channel)")
        if engine.tp_rank > 0 and not isinstance(join, str):
            raise field_error("join", join, f"rank 0's address (a str) on rank {engine.tp_rank}",
                              "pass join=<the address rank 0's server reports>")
        if not isinstance(lease, int | float) or isinstance(lease, bool) or lease <= 0:
            raise field_error("lease", lease, "a positive number of seconds")
        regions, mem_type, device_id, _ = cache_regions(spec, caches)
        self.lease = float(lease)
        self._on_release = on_release
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._released: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._stop = threading.Event()
        self._sock: Any = None
        self._ranks: dict[int, _side.RankEntry] = {}
        self.errors: list[str] = []
        zmq = _zmq()
        self._ctx = zmq.Context()
        self._agent = Agent("prefill")
        try:
            self._agent.register(regions, mem_type, device_id)
            wire = encode(engine, spec, regions, device_id=device_id,
                          agent_metadata=self._agent.metadata())
            entry = _side.RankEntry(peer=wire, mem_type=mem_type)
            if engine.tp_rank == 0:
                self._sock = self._ctx.socket(zmq.ROUTER)
                self._sock.setsockopt(zmq.LINGER, 0)
                self._sock.setsockopt(zmq.MAXMSGSIZE, _side.MAX_SIDE_MESSAGE_BYTES)
                self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
                try:
                    self._sock.bind(f"tcp://{host}:{port or '*'}")
                except zmq.ZMQError as e:
                    raise field_error("host/port", f"{host}:{port}", f"an address to bind ({e})"
                                      ) from None
                self.address = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
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
                f"{self.engine.tp_size}, address={self.address!r}, pending={len(self.pending())})")

    # -- internals ---------------------------------------------------------------------------------
    def _shutdown(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        agent = getattr(self, "_agent", None)
        if agent is not None:
            agent.close()
            self._agent = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _publish(self, address: str, entry: _side.RankEntry, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        msg = _side.Publish(rank=self.engine.tp_rank, peer=entry.peer, mem_type=entry.mem_type)
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

    def _run(self) -> None:
        zmq = _zmq()
        while not self._stop.is_set():
            try:
                if self._sock is not None:
                    if self._sock.poll(2, zmq.POLLIN):
                        for _ in range(64):
                            try:
                                frames = self._sock.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self._answer(frames)
                else:
                    self._stop.wait(0.002)
                for message in self._agent.notifications():
                    self._notified(message)
                self._expire()
            except Exception as e:  # keep serving; the error is visible in server.errors
                self.errors.append(f"{type(e).__name__}: {e}")
                del self.errors[:-100]
                self._stop.wait(0.01)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) >= 3 and frames[1] == b"":
            envelope, body = frames[:2], frames[2:]
        else:
            envelope, body = frames[:1], frames[1:]
        if len(body) != 1:
            reply: Any = _side.Error(message=f"expected one message frame, got {len(body)}")
        else:
            try:
                reply = self._handle(_side.decode_request(body[0]))
            except FkvError as e:
                reply = _side.Error(message=str(e))
            except Exception as e:
                reply = _side.Error(message=f"internal error: {type(e).__name__}: {e}")
        try:
            self._sock.send_multipart([*envelope, _side.encode_message(reply)], _zmq().NOBLOCK)
        except Exception as e:  # the requester left: nothing to answer
            self.errors.append(f"reply not sent: {e}")

    def _handle(self, msg: Any) -> Any:
        tp = self.engine.tp_size
        if isinstance(msg, _side.Ping):
            return _side.Ok(engine_id=self.engine.engine_id)
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
        self._ranks[msg.rank] = _side.RankEntry(peer=msg.peer, mem_type=msg.mem_type)
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


def serve(engine: EngineDesc, spec: KVCacheSpec, caches: Any, *, host: str = "127.0.0.1",
          port: int = 0, join: str | None = None, lease: float = DEFAULT_LEASE,
          join_timeout: float = 30.0,
          on_release: Callable[[str, Any, str], None] | None = None) -> Server:
    """Expose one prefill rank's caches; a context manager with ``.address``.

    Rank 0 binds the side channel on ``host:port`` (``port=0``: any free port) and answers for the
    whole engine; ranks ``1..tp-1`` pass ``join=<rank 0's address>`` and publish their metadata
    through it (retrying for ``join_timeout`` seconds). ``caches``: the per-layer views
    ``fkv.allocate(spec, device)`` returns (``[NB, 2, N, H, D]`` each for triton/flashinfer,
    ``[2, NB, N, H, D]`` flash_attn, ``[NB, N, D]`` mla). A request's blocks are held until the
    expected decode readers notified (``"<request id>:<decode tp>"``), or ``lease`` seconds after
    :meth:`Server.hold` / the first notification; ``on_release(request_id, block_ids, why)`` is
    called from the server's thread when that happens.

    >>> import fkv
    >>> from fkv.connector import EngineDesc
    >>> spec = fkv.KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=1, head_size=8)
    >>> engine = EngineDesc(engine_id="p", tp_size=1, tp_rank=0, total_num_kv_heads=1)
    >>> with serve(engine, spec, fkv.allocate(spec)) as server:
    ...     server.hold("req-1", [0, 1]); sorted(server.pending())
    ['req-1']
    """
    return Server(engine, spec, caches, host=host, port=port, join=join, lease=lease,
                  join_timeout=join_timeout, on_release=on_release)


# -- decode side ----------------------------------------------------------------------------------

def _move_op(device: Any) -> Callable[..., None]:
    """The staging move: the Triton kernel on CUDA (or under TRITON_INTERPRET=1), else the torch
    reference (CPU DRAM without the interpreter)."""
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from fkv.ops import move
    else:
        from fkv.ops.reference import move
    return move


def _block_ids(name: str, ids: Any, spec: KVCacheSpec, side: str, unique: bool) -> np.ndarray:
    try:
        a = np.asarray(ids.cpu() if hasattr(ids, "cpu") else ids)
    except Exception as e:
        raise field_error(name, type(ids).__name__, f"a 1-D sequence of block ids ({e})") from None
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise field_error(name, f"shape {a.shape} dtype {a.dtype}", "a 1-D sequence of int block ids")
    a = a.astype(np.int64)
    bad = np.flatnonzero((a < 0) | (a >= spec.num_blocks))
    if bad.size:
        raise FkvError(f"{name!r}[{bad[0]}] = {a[bad[0]]} is outside the {side} cache's "
                       f"[0, num_blocks={spec.num_blocks}); nothing was transferred")
    if unique and np.unique(a).size != a.size:
        raise FkvError(f"{name!r} repeats a block: two tokens would land in one slot; pass each "
                       f"local block once; nothing was transferred")
    return a


class Client:
    """One decode rank connected to one prefill engine. Use :func:`connect`; a context manager."""

    def __init__(self, engine: EngineDesc, spec: KVCacheSpec, caches: Any, *, remote_address: str,
                 timeout: float = 10.0, expected_engine: str | None = None, strategy: str = "auto",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, telemetry: bool = False) -> None:
        self.engine = _check_engine(engine)
        self.spec = spec
        self._views = _layer_views(spec, caches)
        regions, self._mem_type, self._device_id, self._device = cache_regions(spec, caches)
        self._regions = regions
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 0:
            raise field_error("staging_bytes", staging_bytes, "a non-negative int")
        self._staging_bytes_max = staging_bytes
        self._expected_engine, self._strategy, self._telemetry = expected_engine, strategy, telemetry
        self._lock = threading.RLock()
        self._zctx = _zmq().Context()
        self._agent: Agent | None = None
        self._state: _Connection | None = None
        self.address = remote_address
        try:
            self._agent = Agent("decode", telemetry=telemetry)
            self._agent.register(regions, self._mem_type, self._device_id)
            self._connect(remote_address, timeout)
        except BaseException:
            self.close()
            raise

    # -- public ------------------------------------------------------------------------------------
    @property
    def plan(self) -> TransferPlan:
        """The accepted plan of the current connection."""
        if self._state is None:
            raise FkvError("the client is not connected: call reconnect()")
        return self._state.plan

    @property
    def peers(self) -> tuple[Peer, ...]:
        """Every prefill rank's decoded metadata (rank order)."""
        if self._state is None:
            raise FkvError("the client is not connected: call reconnect()")
        return self._state.peers

    def reconnect(self, remote_address: str | None = None, *, timeout: float = 10.0) -> None:
        """Drop the current prefill engine's state and connect again (e.g. after it restarted),
        to ``remote_address`` or the previous address; the local registration is kept."""
        with self._lock:
            self._disconnect()
            self._connect(remote_address or self.address, timeout)

    def read(self, request_id: str, local_block_ids: Any, remote_block_ids: Any, *,
             timeout: float = 30.0, num_tokens: int | None = None) -> ReadResult:
        """Pull one request's KV from the prefill ranks into the local blocks; never hangs.

        Token ``i`` of the request lives in remote block ``remote_block_ids[i // N_remote]`` and
        lands in local block ``local_block_ids[i // N_local]``. ``num_tokens`` defaults to what
        both lists hold; each list must hold exactly the blocks of those tokens. Bad ids raise
        FkvError before anything moves; a dead, hung or unreachable prefill rank gives
        ``ok=False`` with ``error`` within ``timeout`` seconds.
        """
        if not isinstance(request_id, str) or not request_id:
            raise field_error("request_id", request_id, "a non-empty str")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise field_error("timeout", timeout, "a positive number of seconds")
        with self._lock:
            state = self._state
            if state is None:
                raise FkvError("the client is not connected (a previous reconnect failed or it "
                               "was closed): call reconnect()")
            local = _block_ids("local_block_ids", local_block_ids, self.spec, "local", True)
            remote = _block_ids("remote_block_ids", remote_block_ids, state.remote_spec,
                                "remote", False)
            tokens = _tokens(local, remote, self.spec.block_size, state.remote_spec.block_size,
                             num_tokens)
            t0 = time.perf_counter()
            deadline = time.monotonic() + float(timeout)
            tally = [0, 0, 0.0]  # bytes landed, descriptors, seconds in READs
            try:
                chunks = state.chunks(local, remote, tokens)
                for k, (lc, rc, n_tok) in enumerate(chunks):
                    self._read_chunk(state, request_id, lc, rc, n_tok, k == len(chunks) - 1,
                                     deadline, tally)
                for rank in state.plan.notify_only_ranks:
                    self._agent.notify(state.names[rank], state.notif(request_id))
            except TransferFailed as e:
                return ReadResult(False, request_id, tally[0], tally[1], time.perf_counter() - t0,
                                  str(e), tally[2])
            return ReadResult(True, request_id, tally[0], tally[1], time.perf_counter() - t0,
                              None, tally[2])

    def close(self) -> None:
        """Release descriptor lists, peers, registrations and the NIXL agent. Idempotent."""
        with self._lock:
            self._disconnect()
            if self._agent is not None:
                self._agent.close()
                self._agent = None
            if self._zctx is not None:
                self._zctx.term()
                self._zctx = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "closed" if self._state is None else f"{self._state.plan!r}"
        return f"Client(engine_id={self.engine.engine_id!r}, rank={self.engine.tp_rank}, {where})"

    # -- connection --------------------------------------------------------------------------------
    def _fetch(self, address: str, timeout: float) -> tuple[list[Peer], list[str]]:
        deadline = time.monotonic() + timeout
        while True:
            reply = _side.request(self._zctx, address, _side.Fetch(),
                                  max(0.05, deadline - time.monotonic()))
            if isinstance(reply, _side.Ranks):
                break
            message = reply.message if isinstance(reply, _side.Error) else repr(reply)
            if not (isinstance(reply, _side.Error) and reply.retry) or time.monotonic() > deadline:
                raise SideChannelError(f"prefill side channel at {address}: {message}")
            time.sleep(0.05)
        peers = [decode_untrusted(entry.peer) for entry in reply.ranks]
        reasons = check_remote_ranks([(p.engine, p.spec) for p in peers])
        if reasons:
            raise HandshakeRejected(f"prefill side channel at {address}: its ranks disagree:\n"
                                    + "\n".join(f"  - {r}" for r in reasons), reasons)
        if [p.engine.tp_rank for p in peers] != list(range(len(peers))):
            raise SideChannelError(f"prefill side channel at {address} listed ranks "
                                   f"{[p.engine.tp_rank for p in peers]} out of order")
        return peers, [entry.mem_type for entry in reply.ranks]

    def _connect(self, address: str, timeout: float) -> None:
        if not isinstance(address, str):
            raise field_error("remote_address", address, "a str like 'tcp://127.0.0.1:5555'")
        peers, mem_types = self._fetch(address, timeout)
        outcome = handshake((self.engine, self.spec), (peers[0].engine, peers[0].spec),
                            expected_remote_engine=self._expected_engine, strategy=self._strategy)
        if not outcome.ok:
            raise HandshakeRejected(f"prefill engine {peers[0].engine.engine_id!r} at {address}: "
                                    f"{outcome}", outcome.reasons)
        self.address = address
        self._state = _Connection(self, outcome.plan, peers, mem_types)

    def _disconnect(self) -> None:
        state, self._state = self._state, None
        if state is not None:
            state.close()

    def _read_chunk(self, state: _Connection, request_id: str, local: np.ndarray,
                    remote: np.ndarray, tokens: int, last: bool, deadline: float,
                    tally: list[Any]) -> None:
        plan = state.plan
        rows = plan.segments(local, remote, num_tokens=tokens)
        state.ensure_granule(rows)
        tally[1] += int(rows.shape[0])
        xfers = []
        t0 = time.perf_counter()
        try:
            for rank in plan.remote_ranks:
                mine = rows[rows[:, 0] == rank]
                local_idx, remote_idx = state.indices(mine)
                notif = state.notif(request_id) if last else b""
                try:
                    xfers.append(self._agent.read(state.local_dlist, local_idx,
                                                  state.remote_dlists[rank], remote_idx,
                                                  state.names[rank], int(mine[:, 5].sum()), notif))
                except TransferFailed as e:
                    raise TransferFailed(f"prefill rank {rank} of engine {state.engine_id!r}: {e}; "
                                         f"the prefill process may have died: reconnect once it "
                                         f"is back (client.reconnect())") from e
            stuck = self._agent.wait(xfers, deadline)
            if stuck is not None:
                rank = plan.remote_ranks[xfers.index(stuck)]
                who = f"prefill rank {rank} of engine {state.engine_id!r} ({stuck.remote})"
                if stuck.state == "ERR":
                    raise TransferFailed(f"READ from {who} failed (NIXL state ERR): the prefill "
                                         f"process may have died: reconnect once it is back "
                                         f"(client.reconnect())")
                raise TransferFailed(f"READ from {who} did not finish before the read's timeout: "
                                     f"the prefill process is hung, dead or unreachable")
        finally:
            tally[0] += sum(x.nbytes for x in xfers if x.state == "DONE")
            tally[2] += time.perf_counter() - t0
            for x in xfers:
                self._agent.release(x)
        if plan.strategy == "staging":
            state.run_staging(local, remote, tokens)


def _tokens(local: np.ndarray, remote: np.ndarray, nl_tok: int, nr_tok: int, num_tokens: Any) -> int:
    nl, nr = local.size, remote.size
    cap = min(nl * nl_tok, nr * nr_tok)
    if num_tokens is None:
        tokens = cap
    elif isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer) \
            or not 1 <= num_tokens <= cap:
        raise field_error("num_tokens", num_tokens, f"an int in [1, {cap}] (what both id lists hold)")
    else:
        tokens = int(num_tokens)
    if tokens == 0 or (nl, nr) != (-(-tokens // nl_tok), -(-tokens // nr_tok)):
        raise FkvError(f"local_block_ids has {nl} blocks of {nl_tok} tokens and remote_block_ids "
                       f"{nr} blocks of {nr_tok}: pass the blocks of the same tokens on both sides "
                       f"(at least one); nothing was transferred")
    return tokens


class _Connection:
    """A client's state for one prefill engine: plan, peers, NIXL names and descriptor lists."""

    def __init__(self, client: Client, plan: TransferPlan, peers: list[Peer],
                 mem_types: list[str]) -> None:
        self.client, self.plan, self.peers = client, plan, tuple(peers)
        self.mem_types = mem_types
        self.engine_id = peers[0].engine.engine_id
        self.remote_spec = peers[0].spec
        self.names: dict[int, str] = {}
        self.remote_dlists: dict[int, Any] = {}
        self.local_dlist: Any = None
        self.staging: Any = None
        self.staging_blocks = 0
        agent = client._agent
        ls, rs = client.spec, self.remote_spec
        step = math.lcm(ls.block_size, rs.block_size)
        try:
            for rank in (*plan.remote_ranks, *plan.notify_only_ranks):
                self.names[rank] = agent.add_remote(peers[rank].agent_metadata)
            if plan.strategy == "staging":
                per_block = plan.staging_bytes(1)
                blocks = max(client._staging_bytes_max // per_block, step // rs.block_size)
                self.staging_blocks = min(blocks, max(rs.num_blocks, step // rs.block_size))
                import torch

                self.staging = torch.empty(plan.staging_bytes(self.staging_blocks),
                                           dtype=torch.uint8, device=client._device)
                agent.register([(self.staging.data_ptr(), self.staging.numel())],
                               client._mem_type, client._device_id)
            self.granule = 0
            self._prep(self._probe_granule())
        except BaseException:
            self.close()
            raise

    # -- descriptors -------------------------------------------------------------------------------
    def _probe_granule(self) -> int:
        ls, rs = self.client.spec, self.remote_spec
        values = [ls.region_bytes, rs.region_bytes, ls.axis_strides["B"] * ls.itemsize,
                  rs.axis_strides["B"] * rs.itemsize]
        if self.staging is not None:
            values += [self.plan.staging_bytes(1), self.staging.numel()]
        tokens = math.lcm(ls.block_size, rs.block_size)
        nl, nr = tokens // ls.block_size, tokens // rs.block_size
        if nl <= ls.num_blocks and nr <= rs.num_blocks:
            lo = np.arange(nl) + (1 if nl < ls.num_blocks else 0)
            ro = np.arange(nr, 0, -1) - (0 if nr < rs.num_blocks else 1)
            rows = self.plan.segments(lo, ro)
            values += rows[:, 2:6:2].ravel().tolist() + rows[:, 5].tolist()
        return math.gcd(*values)

    def _prep(self, granule: int) -> None:
        agent = self.client._agent
        for handle in [self.local_dlist, *self.remote_dlists.values()]:
            if handle is not None:
                agent.release_dlist(handle)
        self.remote_dlists.clear()
        self.local_dlist = None
        self.granule = granule
        ls, rs = self.client.spec, self.remote_spec
        local = list(self.client._regions)
        if self.staging is not None:
            local.append((self.staging.data_ptr(), self.staging.numel()))
        self.local_per_region = ls.region_bytes // granule
        self.staging_base = ls.num_regions * self.local_per_region
        self.remote_per_region = rs.region_bytes // granule
        self.local_dlist = agent.prep(None, granule_table(local, granule,
                                                          device_id=self.client._device_id),
                                      self.client._mem_type)
        for rank in self.plan.remote_ranks:
            peer = self.peers[rank]
            table = granule_table(peer.regions, granule, device_id=peer.device_id)
            self.remote_dlists[rank] = agent.prep(self.names[rank], table, self.mem_types[rank])

    def ensure_granule(self, rows: np.ndarray) -> None:
        """Re-prepare with a finer granule if a row does not sit on the current one (rare)."""
        if rows.size and (np.any(rows[:, 2:6:2] % self.granule) or np.any(rows[:, 5] % self.granule)):
            self._prep(math.gcd(self.granule, *rows[:, 2:6:2].ravel().tolist(),
                                *rows[:, 5].tolist()))

    def indices(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Local and remote descriptor indices of plan rows (one remote rank's)."""
        g = self.granule
        count = rows[:, 5] // g
        local_base = np.where(rows[:, 3] < 0, self.staging_base, rows[:, 3] * self.local_per_region)
        local = row_indices(local_base + rows[:, 4] // g, count)
        remote = row_indices(rows[:, 1] * self.remote_per_region + rows[:, 2] // g, count)
        return local, remote

    def notif(self, request_id: str) -> bytes:
        return f"{request_id}:{self.client.engine.tp_size}".encode()

    # -- chunks and staging ------------------------------------------------------------------------
    def chunks(self, local: np.ndarray, remote: np.ndarray, tokens: int
               ) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Split a read so each piece's staging mini-caches fit the staging buffer."""
        if self.staging is None or remote.size <= self.staging_blocks:
            return [(local, remote, tokens)]
        nl, nr = self.client.spec.block_size, self.remote_spec.block_size
        step = math.lcm(nl, nr)
        per = (self.staging_blocks * nr) // step * step  # tokens per chunk
        out = []
        for start in range(0, tokens, per):
            n = min(per, tokens - start)
            out.append((local[start // nl: -(-(start + n) // nl)],
                        remote[start // nr: -(-(start + n) // nr)], n))
        return out

    def run_staging(self, local: np.ndarray, remote: np.ndarray, tokens: int) -> None:
        import torch

        from fkv.tensors import wrap

        move = _move_op(self.client._device)
        views = self.client._views
        ls = self.client.spec
        src_ids = torch.arange(remote.size, device=self.client._device)
        dst_ids = torch.as_tensor(local, device=self.client._device)
        for step in self.plan.staging_steps(local, remote, num_tokens=tokens):
            src = wrap(self.staging, step.stage_spec, step.stage_offset)[step.layer]
            move(src, step.stage_spec, src_ids, views[step.layer], ls, dst_ids,
                 src_heads=step.src_heads, dst_heads=step.dst_heads, num_tokens=step.num_tokens)
        if self.client._device.type == "cuda":
            torch.cuda.synchronize(self.client._device)

    def close(self) -> None:
        agent = self.client._agent
        if agent is None:
            return
        for handle in [self.local_dlist, *self.remote_dlists.values()]:
            if handle is not None:
                agent.release_dlist(handle)
        self.remote_dlists.clear()
        self.local_dlist = None
        for name in self.names.values():
            agent.remove_remote(name)
        self.names.clear()


def connect(engine: EngineDesc, spec: KVCacheSpec, caches: Any, *, remote_address: str,
            timeout: float = 10.0, expected_engine: str | None = None, strategy: str = "auto",
            staging_bytes: int = DEFAULT_STAGING_BYTES, telemetry: bool = False) -> Client:
    """Connect one decode rank to a prefill engine through its rank-0 side channel.

    Fetches every prefill rank's metadata within ``timeout`` seconds (waiting for ranks still
    joining), runs the handshake (raises :class:`HandshakeRejected`, an FkvError whose ``reasons``
    lists every reason), and prepares NIXL descriptors once. ``caches``: the per-layer views
    ``fkv.allocate(spec, device)`` returns. ``expected_engine`` checks the prefill engine id;
    ``strategy`` forces ``"direct"`` or ``"staging"``; ``staging_bytes`` caps the registered staging
    buffer (larger reads go in chunks); ``telemetry`` turns on NIXL's transfer telemetry.

    >>> import fkv
    >>> from fkv.connector import EngineDesc
    >>> spec = fkv.KVCacheSpec(num_blocks=2, block_size=4, num_kv_heads=2, head_size=8)
    >>> e = lambda name: EngineDesc(engine_id=name, tp_size=1, tp_rank=0, total_num_kv_heads=2)
    >>> with serve(e("p"), spec, fkv.allocate(spec)) as s:
    ...     try:
    ...         connect(e("d"), spec.evolve(head_size=16), fkv.allocate(spec.evolve(head_size=16)),
    ...                 remote_address=s.address)
    ...     except HandshakeRejected as err:
    ...         [r.code for r in err.reasons]
    ['head_size']
    """
    return Client(engine, spec, caches, remote_address=remote_address, timeout=timeout,
                  expected_engine=expected_engine, strategy=strategy, staging_bytes=staging_bytes,
                  telemetry=telemetry)
