"""The decode side of the transport: a :class:`Client` per decode rank (``fkv.connector.connect``).

A client registers its rank's caches with its own NIXL agent once, fetches every prefill rank's
metadata through the prefill engine's rank-0 side channel, runs the handshake and builds a
:class:`fkv.connector.transport._connection.Connection` (plan, descriptor lists, staging buffer, packed
path). ``read`` validates the block ids against both caches before anything moves, picks the
request's path (:meth:`Connection.choose`: the plan's direct/staging rows, or a packed read) and
notifies the prefill ranks.

Threads: every method takes the client's lock, so NIXL (and the ZMQ sockets of packed reads) are
used by one thread at a time even when several threads read concurrently.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

from fkv.connector.handshake import EngineDesc, check_remote_ranks, handshake
from fkv.connector.plan import TransferPlan, check_block_ids, request_tokens
from fkv.connector.transport import _side
from fkv.connector.transport._agent import Agent, default_progress
from fkv.connector.transport._base import (
    DEFAULT_PACK_THRESHOLD,
    DEFAULT_STAGING_BYTES,
    STRATEGIES,
    HandshakeRejected,
    ReadResult,
    SideChannelError,
    Tally,
    TransferFailed,
    cache_regions,
    check_curve,
    check_engine,
    check_seconds,
    layer_views,
    zmq,
)
from fkv.connector.transport._connection import Connection
from fkv.connector.transport._link import Local
from fkv.connector.wire import Peer, decode_untrusted
from fkv.errors import FkvError, field_error
from fkv.layout import KVCacheSpec

__all__ = ["Client", "failure_kind"]


def failure_kind(error: str) -> str:
    """The telemetry reason of a failed read, from its error text."""
    if "before the read's timeout" in error or "until the read's timeout" in error:
        return "timeout"
    if "NIXL state ERR" in error or "exited during the read" in error or "may have died" in error:
        return "peer_failed"
    if "refused" in error or "pack failed" in error:
        return "refused"
    return "other"


class Client:
    """One decode rank connected to one prefill engine. Use ``fkv.connector.connect``; a context
    manager."""

    def __init__(self, engine: EngineDesc, spec: KVCacheSpec, caches: Any, *, remote_address: str,
                 timeout: float = 10.0, expected_engine: str | None = None, strategy: str = "auto",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, telemetry: bool = False,
                 pack_threshold: int = DEFAULT_PACK_THRESHOLD, curve: Any = None) -> None:
        self.engine = check_engine(engine)
        self._curve = check_curve(curve, client=True)
        self.spec = spec
        self._views = layer_views(spec, caches)
        regions, self._mem_type, self._device_id, self._device = cache_regions(spec, caches)
        self._regions = regions
        self._progress = default_progress(self._mem_type)
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 0:
            raise field_error("staging_bytes", staging_bytes, "a non-negative int")
        if isinstance(pack_threshold, bool) or not isinstance(pack_threshold, int) \
                or pack_threshold < 0:
            raise field_error("pack_threshold", pack_threshold, "a non-negative int")
        if strategy not in STRATEGIES:
            raise field_error("strategy", strategy, f"one of {STRATEGIES}")
        if not isinstance(telemetry, bool):
            raise field_error("telemetry", telemetry, "a bool")
        timeout = check_seconds("timeout", timeout)
        self._staging_bytes_max = staging_bytes
        self._pack_threshold = pack_threshold
        self._expected_engine, self._strategy, self._telemetry = expected_engine, strategy, telemetry
        self._lock = threading.RLock()
        from fkv.telemetry import Telemetry

        self.telemetry = Telemetry("client", engine_id=engine.engine_id)
        self._zctx = zmq().Context()
        # proves to the prefill ranks, in every Hello, that a reconnect is this process
        self._secret = os.urandom(32)
        self._agent: Agent | None = None
        self._state: Connection | None = None
        self.address = remote_address
        try:
            self._agent = Agent("decode", telemetry=telemetry, default_progress=self._progress)
            self._agent.register(regions, self._mem_type, self._device_id)
            self._connect(remote_address, timeout)
        except BaseException:
            self.close()
            raise

    # -- public ------------------------------------------------------------------------------------
    @property
    def plan(self) -> TransferPlan:
        """The accepted plan of the current connection."""
        return self._connected().plan

    @property
    def peers(self) -> tuple[Peer, ...]:
        """Every prefill rank's decoded metadata (rank order)."""
        return self._connected().peers

    @property
    def strategy(self) -> str:
        """What ``connect`` was asked for: ``"auto"``, ``"ipc"``, ``"packed"``, ``"direct"`` or
        ``"staging"`` (each :class:`ReadResult` says which path its request took)."""
        return self._strategy

    @property
    def packed(self) -> bool:
        """Whether this connection can read packed (forced, or picked by ``"auto"``)."""
        return self._connected().packed is not None

    @property
    def ipc(self) -> bool:
        """Whether this connection reads through CUDA IPC (the prefill caches are mapped)."""
        return self._connected().ipc is not None

    def describe(self) -> str:
        """The plan's description and the paths this client takes (and why not the others)."""
        return self._connected().describe()

    def stats(self) -> dict[str, Any]:
        """This client's reads so far as plain dicts: per path count, seconds, bytes,
        descriptors, GB/s and waits (``transfer``, ``pack``), failures by reason (see
        ``fkv.telemetry.Telemetry.stats``)."""
        return self.telemetry.stats()

    def prometheus(self, registry: Any = None) -> Any:
        """Register this client's metrics (``fkv_transfer_*``, label ``role="client"``) on
        ``registry`` (default: a new ``prometheus_client.CollectorRegistry``); returns it."""
        return self.telemetry.prometheus(registry)

    def reconnect(self, remote_address: str | None = None, *, timeout: float = 10.0) -> None:
        """Drop the current prefill engine's state and connect again (e.g. after it restarted),
        to ``remote_address`` or the previous address; the local registration is kept."""
        timeout = check_seconds("timeout", timeout)
        with self._lock:
            self._disconnect()
            self._connect(remote_address or self.address, timeout)

    def read(self, request_id: str, local_block_ids: Any, remote_block_ids: Any, *,
             timeout: float = 30.0, num_tokens: int | None = None,
             stream: bool = False) -> ReadResult:
        """Pull one request's KV from the prefill ranks into the local blocks; never hangs.

        Token ``i`` of the request lives in remote block ``remote_block_ids[i // N_remote]`` and
        lands in local block ``local_block_ids[i // N_local]``. ``num_tokens`` defaults to what
        both lists hold; each list must hold exactly the blocks of those tokens. Bad ids raise
        FkvError before anything moves; a dead, hung or unreachable prefill rank gives
        ``ok=False`` with ``error`` within ``timeout`` seconds. (One exception, on one host: a
        prefill process of this same user that backs its cache with memory whose faults it never
        serves holds a same-host copy in flight; docs/transport.md, "Trust model".)

        Both lists empty (a full prefix hit: the decode rank has every token already) moves
        nothing and only notifies the prefill ranks, which release the request once every
        expected reader notified (``strategy == "none"``, ``bytes == 0``; a streaming request
        once its last layer is published too: a notification before that is kept until then).

        ``stream=True`` reads a *streaming* request (the prefill ranks hold it with
        ``layers_ready=`` and ``publish`` layers as they are written): each layer moves as soon
        as every prefill rank read published it, pipelined with the wait for the next, and
        ``ReadResult.layer_seconds`` says when each landed. A prefill that stops publishing gives
        ``ok=False`` at ``timeout`` naming the last layer received; nothing is reported as done
        and the prefill ranks are not notified.
        """
        t0 = time.perf_counter()  # ``seconds`` and ``layer_seconds`` count the whole call
        if not isinstance(request_id, str) or not request_id:
            raise field_error("request_id", request_id, "a non-empty str")
        timeout = check_seconds("timeout", timeout)
        with self._lock:
            state = self._connected()
            try:  # the plan's checks, before anything moves
                local = check_block_ids("local_block_ids", local_block_ids, self.spec, True)
                remote = check_block_ids("remote_block_ids", remote_block_ids,
                                         state.remote_spec, False)
                tokens = request_tokens(local, remote, self.spec.block_size,
                                        state.remote_spec.block_size, num_tokens)
                done = state.link.notif(request_id)  # made now: after the last byte it only goes
            except FkvError as e:
                raise FkvError(f"{e}; nothing was transferred") from None
            tally = Tally()
            if tokens == 0:  # a full prefix hit: no READ, the prefill ranks are told at once
                try:
                    state.link.notify((*state.plan.remote_ranks, *state.plan.notify_only_ranks),
                                      done)
                except (TransferFailed, SideChannelError) as e:
                    self.telemetry.failure(failure_kind(str(e)))
                    return self._result(False, request_id, tally, t0, "none", str(e))
                result = self._result(True, request_id, tally, t0, "none", None)
                self.telemetry.record_read("none", result.seconds, 0, 0)
                return result
            deadline = time.monotonic() + float(timeout)
            path, rows = state.choose(local, remote, tokens)
            layer_seconds: tuple[float, ...] = ()
            try:
                if stream:
                    layer_seconds = self._stream(state, path, request_id, local, remote, tokens,
                                                 deadline, tally, t0)
                    state.link.notify((*state.plan.remote_ranks, *state.plan.notify_only_ranks),
                                      done)
                else:
                    if rows is not None:
                        path.read(request_id, local, remote, tokens, deadline, tally, rows)
                    else:
                        path.read(request_id, local, remote, tokens, deadline, tally)
                    state.link.notify(state.notify_after(path), done)
            except (TransferFailed, SideChannelError) as e:
                self.telemetry.failure(failure_kind(str(e)))
                return self._result(False, request_id, tally, t0, path.name, str(e))
            result = self._result(True, request_id, tally, t0, path.name, None, layer_seconds)
            self.telemetry.record_read(path.name, result.seconds, result.bytes,
                                       result.descriptors,
                                       (("transfer", tally.transfer_seconds),
                                        ("pack", tally.pack_seconds)))
            return result

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
        return (f"Client(engine_id={self.engine.engine_id!r}, rank={self.engine.tp_rank}, "
                f"strategy={self._strategy!r}, {where})")

    # -- connection --------------------------------------------------------------------------------
    def _result(self, ok: bool, request_id: str, tally: Tally, t0: float, path: str,
                error: str | None, layer_seconds: tuple[float, ...] = ()) -> ReadResult:
        seconds = time.perf_counter() - t0
        if ok and not layer_seconds:
            layer_seconds = (seconds,) * self.spec.num_layers
        return ReadResult(ok, request_id, tally.bytes, tally.descriptors, seconds, error,
                          tally.transfer_seconds, path, tally.pack_seconds, layer_seconds)

    def _stream(self, state: Connection, path: Any, request_id: str, local: Any, remote: Any,
                tokens: int, deadline: float, tally: Tally, t0: float) -> tuple[float, ...]:
        """Move the layers of a streaming request as the prefill ranks publish them: a long
        poll asks for the next layers while the previous ones move."""
        try:
            return self._stream_layers(state, path, request_id, local, remote, tokens, deadline,
                                       tally, t0)
        finally:  # READs created ahead for a layer that came with others, or a read that failed
            if hasattr(path, "discard_unposted"):
                path.discard_unposted()

    def _stream_layers(self, state: Connection, path: Any, request_id: str, local: Any,
                       remote: Any, tokens: int, deadline: float, tally: Tally,
                       t0: float) -> tuple[float, ...]:
        watch = state.watch()
        watch.start(request_id)
        total = state.remote_spec.num_layers
        landed: list[float] = []
        layered = path.layered()
        # ipc with publish events: move what is published, the stream waiting for the writes
        recorded = bool(getattr(path, "waits_on_events", lambda: False)())
        rows = None  # the plan's rows of the request, computed once (each layer range filters them)
        if layered and path.name in ("direct", "staging"):
            rows = path.stream_rows(local, remote, tokens)
        while len(landed) < total:
            done = len(landed)
            got = f"layers 0..{done - 1} landed" if done else "no layer landed"
            after = done if layered else total - 1
            ahead = None  # the READs of layer `done`, created while it is awaited
            try:
                ready = watch.beyond(request_id, after, deadline, recorded, wait=False)
                if ready <= after:
                    ready_for = None  # called as the wait starts spinning ahead of the layer
                    if rows is not None:
                        ahead = path.layer_reads(rows, done)
                        ready_for = functools.partial(path.prime, ahead)
                    ready = watch.beyond(request_id, after, deadline, recorded,
                                         ahead=ready_for)
            except TransferFailed as e:
                raise TransferFailed(f"streaming request {request_id!r}: {got} of {total}; {e}; "
                                     f"nothing is reported as done") from e
            if ready > total:
                raise TransferFailed(f"streaming request {request_id!r}: prefill engine "
                                     f"{state.engine_id!r} announced {ready} layers published of "
                                     f"the {total} its spec has; nothing is reported as done")
            if ready <= done or (not layered and ready < total):
                raise TransferFailed(f"streaming request {request_id!r}: {got}, layer {done} of "
                                     f"{total} was not published by prefill engine "
                                     f"{state.engine_id!r} before the read's timeout; the read "
                                     f"is not complete and nothing is reported as done")
            if recorded:
                # published may run far ahead of written: move every layer whose write finished
                # (its event completed) at once, else queue the next one behind its own event
                ready = max(done + 1, path.written(done, ready))
            if ready < total:
                watch.ask(request_id, ready, recorded)  # the next wait overlaps this move
            if recorded:
                path.read(request_id, local, remote, tokens, deadline, tally,
                          layers=(done, ready), after_events=True)
            elif rows is not None:
                path.read(request_id, local, remote, tokens, deadline, tally, rows,
                          layers=(done, ready), prepared=ahead)
            elif layered:
                path.read(request_id, local, remote, tokens, deadline, tally, layers=(done, ready))
            else:
                path.read(request_id, local, remote, tokens, deadline, tally)
            landed += [time.perf_counter() - t0] * (ready - done)
        return tuple(landed)

    def _connected(self) -> Connection:
        if self._state is None:
            raise FkvError("the client is not connected (a previous reconnect failed or it was "
                           "closed): call reconnect()")
        return self._state

    def _fetch(self, address: str, timeout: float) -> tuple[list[Peer], list[_side.RankEntry]]:
        deadline = time.monotonic() + timeout
        while True:
            reply = _side.request(self._zctx, address, _side.Fetch(),
                                  max(0.05, deadline - time.monotonic()), curve=self._curve)
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
        return peers, list(reply.ranks)

    def _connect(self, address: str, timeout: float) -> None:
        if not isinstance(address, str):
            raise field_error("remote_address", address, "a str like 'tcp://127.0.0.1:5555'")
        deadline = time.monotonic() + timeout
        peers, entries = self._fetch(address, timeout)
        outcome = handshake((self.engine, self.spec), (peers[0].engine, peers[0].spec),
                            expected_remote_engine=self._expected_engine,
                            strategy=self._strategy if self._strategy in ("direct", "staging")
                            else "auto")
        if not outcome.ok:
            raise HandshakeRejected(f"prefill engine {peers[0].engine.engine_id!r} at {address}: "
                                    f"{outcome}", outcome.reasons)
        self.address = address
        local = Local(engine=self.engine, spec=self.spec, views=self._views, regions=self._regions,
                      mem_type=self._mem_type, device_id=self._device_id, device=self._device,
                      agent=self._agent, zctx=self._zctx, strategy=self._strategy,
                      staging_bytes_max=self._staging_bytes_max,
                      pack_threshold=self._pack_threshold, curve=self._curve,
                      secret=self._secret)
        try:
            self._state = Connection(local, outcome.plan, peers, entries, deadline)
        except BaseException:
            if local.tainted:
                self._fresh_agent()
            raise

    def _fresh_agent(self) -> None:
        """Replace the NIXL agent (registration included) after a peer's metadata was loaded
        into it and the connection then failed: NIXL may keep state of a peer it half refused,
        and UCX could later trip over it; a fresh agent carries nothing of that peer."""
        old, self._agent = self._agent, None
        if old is not None:
            old.close()
        self._agent = Agent("decode", telemetry=self._telemetry,
                            default_progress=self._progress)
        self._agent.register(self._regions, self._mem_type, self._device_id)

    def _disconnect(self) -> None:
        state, self._state = self._state, None
        if state is not None:
            state.close()
