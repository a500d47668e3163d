"""A thin NIXL agent wrapper for fkv's transport: one agent per rank, regions registered once.

Everything NIXL-specific lives here: loading ``nixl`` (quietly), registering memory, building the
``Nx3`` uint64 descriptor tables ``(address, length, device)``, preparing descriptor lists, posting
READs with a notification, polling them against a deadline and releasing handles. The caller
(the transport's server and client) must call one :class:`Agent` from one thread at a time
(docs/transport.md).

Descriptors are *granules*: each registered region is cut into ``len // granule`` equal pieces, so
a plan row ``(region, offset, nbytes)`` is the index run ``offset // granule`` .. ``+ nbytes //
granule`` of that region's pieces. NIXL merges runs that are contiguous on both sides into one
descriptor when it builds a transfer, so a coalesced row still travels as one descriptor.

>>> import numpy as np
>>> granule_table([(4096, 8192)], 4096, device_id=0).tolist()
[[4096, 4096, 0], [8192, 4096, 0]]
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import numpy as np

from fkv.connector.transport._base import TransferFailed, load_nixl, tensor_memory
from fkv.errors import FkvError

__all__ = ["Agent", "TransferFailed", "UndecodableNotifications", "default_progress",
           "granule_table", "load_nixl",
           "row_indices", "run_indices", "tensor_memory"]




#: ``FKV_NIXL_PROGRESS_DELAY_US`` default: the longest a progress thread sleeps between looks.
PROGRESS_DELAY_US = 1000


def progress_mode(progress_thread: bool | str | None = None, default: str = "1"
                  ) -> tuple[str, int]:
    """``(mode, delay_us)`` of an agent's UCX progress thread: ``"poll"`` (sleeps on the
    workers' event descriptors, wakes at least every ``delay_us``), ``"spin"`` (NIXL's Python
    default: no delay, a core busy-polling) or ``"off"``. ``progress_thread``: True / False /
    ``"spin"``; None: the environment (``FKV_NIXL_PROGRESS_THREAD``: 1, 0 or spin), else
    ``default``. ``FKV_NIXL_PROGRESS_DELAY_US``: the delay (default 1000).

    >>> progress_mode(True), progress_mode(False), progress_mode("spin")
    (('poll', 1000), ('off', 1000), ('spin', 0))
    """
    raw = os.environ.get("FKV_NIXL_PROGRESS_THREAD", default) if progress_thread is None \
        else progress_thread
    value = str(raw).strip().lower()
    if raw is True or value in ("1", "true", "on", "poll"):
        mode = "poll"
    elif raw is False or value in ("0", "false", "off"):
        mode = "off"
    elif value == "spin":
        mode = "spin"
    else:
        raise FkvError(f"FKV_NIXL_PROGRESS_THREAD={raw!r}: expected 1 (a thread that sleeps on "
                       f"UCX's events), spin (a busy-polling thread) or 0 (none)")
    text = os.environ.get("FKV_NIXL_PROGRESS_DELAY_US", "") or str(PROGRESS_DELAY_US)
    try:
        delay_us = int(text)
    except ValueError:
        delay_us = -1
    if not 1 <= delay_us <= 10_000_000:
        raise FkvError(f"FKV_NIXL_PROGRESS_DELAY_US={text!r}: expected an int of microseconds "
                       f"in [1, 10000000]")
    return mode, (0 if mode == "spin" else delay_us)


def default_progress(mem_type: str) -> str:
    """The progress-thread setting a decode rank's agent gets when the environment says none:
    none for DRAM caches (the reading thread's own polling moves the bytes over shared memory;
    a UCX thread beside it only competes for the worker: bench/NOTES.md), the sleeping thread
    otherwise (one-sided RDMA and cuda_ipc complete with an event)."""
    return "0" if mem_type == "DRAM" else "1"


def _make_agent(nixl: Any, name: str, mode: str, delay_us: int, telemetry: bool,
                num_threads: int) -> Any:
    """A ``nixl_agent`` with the UCX backend and the progress thread ``mode`` asks for. NIXL's
    Python wrapper always starts its progress thread with no delay (a busy loop), so for
    ``"poll"`` the wrapper is made without backends and gets a native agent of the same name
    whose configuration says the delay, then its UCX backend."""
    conf = nixl.nixl_agent_config(enable_prog_thread=mode != "off", backends=[],
                                  capture_telemetry=telemetry, num_threads=num_threads)
    agent = nixl.nixl_agent(name, conf)
    if mode == "poll":
        import importlib

        from fkv.connector.transport._metadata import _backend_package

        bindings = importlib.import_module(_backend_package() + "._bindings")
        cfg = bindings.nixlAgentConfig()
        cfg.useProgThread = True
        cfg.useListenThread = False
        cfg.pthrDelay = delay_us
        cfg.captureTelemetry = telemetry
        agent.agent = bindings.nixlAgent(name, cfg)  # the wrapper's own (no backends) is freed
    init = {"num_threads": str(num_threads)} if num_threads > 0 else {}
    if "UCX" in agent.get_plugin_list():
        agent.create_backend("UCX", init)
    return agent


def granule_table(regions: Any, granule: int, *, device_id: int,
                  limit: int | None = None) -> np.ndarray:
    """``Nx3`` uint64 ``(address, granule, device_id)`` rows cutting each ``(base, nbytes)`` region
    into ``nbytes // granule`` pieces, regions one after another. ``limit``: at most about that
    many rows, the first pieces of every region (a sample; nothing larger is allocated)."""
    parts = []
    regions = list(regions)
    per = None if limit is None else max(1, limit // max(1, len(regions)))
    for base, nbytes in regions:
        if nbytes % granule:
            raise FkvError(f"region of {nbytes} bytes is not a multiple of the granule {granule}")
        k = nbytes // granule if per is None else min(per, nbytes // granule)
        t = np.empty((k, 3), dtype=np.uint64)
        t[:, 0] = np.uint64(base) + np.arange(k, dtype=np.uint64) * np.uint64(granule)
        t[:, 1] = granule
        t[:, 2] = device_id
        parts.append(t)
    return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)


def row_indices(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Concatenated runs ``first[i] .. first[i] + count[i] - 1`` as one int32 index array.

    >>> row_indices(np.array([5, 0]), np.array([2, 3])).tolist()
    [5, 6, 0, 1, 2]
    """
    return run_indices((first,), count)[0]


def run_indices(firsts: tuple[np.ndarray, ...], count: np.ndarray) -> tuple[np.ndarray, ...]:
    """:func:`row_indices` of several ``first`` arrays sharing one ``count`` (a READ's local and
    remote sides), the run offsets computed once; runs of one length (the usual case) take a
    broadcast add.

    >>> [a.tolist() for a in run_indices((np.array([5, 0]), np.array([1, 9])), np.array([2, 2]))]
    [[5, 6, 0, 1], [1, 2, 9, 10]]
    """
    if count.size and (count == count[0]).all():
        if count[0] == 0:
            return tuple(np.empty(0, dtype=np.int32) for _ in firsts)
        step = np.arange(count[0], dtype=np.int32)
        return tuple((f.astype(np.int32)[:, None] + step).ravel() for f in firsts)
    total = int(count.sum())
    if total == 0:
        return tuple(np.empty(0, dtype=np.int32) for _ in firsts)
    ends = np.cumsum(count)
    within = np.arange(total, dtype=np.int64) - np.repeat(ends - count, count)
    return tuple((within + np.repeat(f, count)).astype(np.int32) for f in firsts)


class UndecodableNotifications(TransferFailed):
    """NIXL could not decode a batch of notifications (a peer's agent name is not UTF-8)."""


class Xfer:
    """One posted READ: its NIXL handle, the remote it reads and the bytes it moves."""

    __slots__ = ("handle", "remote", "nbytes", "state")

    def __init__(self, handle: Any, remote: str, nbytes: int) -> None:
        self.handle, self.remote, self.nbytes, self.state = handle, remote, nbytes, "PROC"


class Agent:
    """One NIXL agent (UCX backend) owned by one fkv server or client; call from one thread.

    ``progress_thread`` keeps UCX progressing while Python is busy (environment
    ``FKV_NIXL_PROGRESS_THREAD``, else ``default_progress``: ``1`` a thread that sleeps in
    ``poll()`` on the UCX workers' event descriptors and wakes at least every
    ``FKV_NIXL_PROGRESS_DELAY_US`` microseconds (default 1000; UCX misses a wake-up now and
    then, so the thread also looks on its own); ``spin``: NIXL's Python default, the same thread with no delay, which busy-polls a
    whole core per agent; ``0``: no thread, UCX progresses only when fkv polls). ``num_threads``
    (environment ``FKV_NIXL_NUM_THREADS``) asks the UCX backend for that many worker threads (0:
    its default). ``telemetry`` turns on NIXL's per-transfer telemetry (descriptor counts after
    merging). UCX itself reads ``UCX_*`` variables (``UCX_TLS``, ``UCX_NET_DEVICES``) when the
    agent is made.
    """

    def __init__(self, role: str, *, progress_thread: bool | str | None = None,
                 num_threads: int | None = None, telemetry: bool = False,
                 default_progress: str = "1") -> None:
        nixl = load_nixl()
        # unguessable: a notification's sender is bound to a reader by this name
        self.name = f"fkv-{role}-{os.getpid()}-{uuid.uuid4().hex}"
        mode, delay_us = progress_mode(progress_thread, default_progress)
        if num_threads is None:
            num_threads = int(os.environ.get("FKV_NIXL_NUM_THREADS", "0") or 0)
        try:
            self._agent = _make_agent(nixl, self.name, mode, delay_us, telemetry, num_threads)
        except Exception as e:
            raise TransferFailed(f"could not create a NIXL agent with the UCX backend: "
                                 f"{type(e).__name__}: {e}") from e
        self.progress = mode if mode != "poll" else f"poll({delay_us} us)"
        if "UCX" not in self._agent.backends:
            raise TransferFailed(f"NIXL has no UCX backend here (plugins: "
                                 f"{self._agent.get_plugin_list()}); fkv transfers need UCX")
        self._registered: list[Any] = []
        self._dlists: list[Any] = []
        self._remotes: set[str] = set()
        self._leaked: list[Any] = []
        self._kept: list[Any] = []

    # -- memory ------------------------------------------------------------------------------
    def register(self, regions: Any, mem_type: str, device_id: int) -> Any:
        """Register ``[(base, nbytes), ...]`` of one memory type (until :meth:`deregister` or
        :meth:`close`); returns the registration handle (None for no regions)."""
        descs = [(int(b), int(n), int(device_id), "") for b, n in regions]
        if not descs:
            return None
        try:
            reg = self._agent.register_memory(descs, mem_type)
        except Exception as e:
            raise TransferFailed(f"NIXL could not register {len(descs)} {mem_type} region(s): "
                                 f"{type(e).__name__}: {e}") from e
        self._registered.append(reg)
        return reg

    def deregister(self, reg: Any, keep: Any = None) -> None:
        """Deregister what :meth:`register` returned (a no-op for None or an unknown handle).
        While a transfer NIXL could not release is pending the memory stays registered (until
        :meth:`close`), and ``keep`` (the memory's owner, e.g. its tensor) stays referenced until
        then: a late READ must not land in memory that was freed or that UCX no longer maps."""
        if reg is not None and self._leaked:
            self._kept.append(keep)
            return
        if reg is not None and any(r is reg for r in self._registered):
            self._registered = [r for r in self._registered if r is not reg]
            try:
                self._agent.deregister_memory(reg)
            except Exception:  # memory already gone with a dead transfer: nothing left to undo
                return

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info and registered memory) for peers."""
        return bytes(self._agent.get_agent_metadata())

    # -- peers ---------------------------------------------------------------------------------
    def add_remote(self, metadata: bytes, *, timeout: float = 10.0, prep: Any = None) -> str:
        """Load a peer's agent metadata once it passed ``_metadata.check_agent_metadata`` (a
        structural check and a probe in a child process: a corrupt blob costs an FkvError, never
        this process); nothing stays added when anything fails. ``prep``: what the caller will
        prepare on the peer (``_metadata.check_each``'s ``preps``; the cached verdict)."""
        from fkv.connector.transport._metadata import add_remote_checked

        name = add_remote_checked(self._agent, metadata, timeout=timeout, prep=prep)
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        if name in self._remotes:
            self._remotes.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # the peer may be gone already; nothing left to undo on our side
                return

    def prep(self, remote: str | None, table: np.ndarray, mem_type: str) -> Any:
        """Prepare a descriptor list: local (``remote=None``) or one remote agent's memory."""
        try:
            handle = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT" if remote is None else remote,
                                                 table, mem_type)
        except Exception as e:
            where = "local memory" if remote is None else f"remote agent {remote!r}"
            raise TransferFailed(f"NIXL could not prepare {len(table)} descriptors of {where}: "
                                 f"{type(e).__name__}: {e}") from e
        self._dlists.append(handle)
        return handle

    def release_dlist(self, handle: Any) -> None:
        if handle in self._dlists:
            self._dlists.remove(handle)
            handle.release()

    # -- transfers -----------------------------------------------------------------------------
    def read(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
             remote_name: str, nbytes: int, notif: bytes = b"") -> Xfer:
        """Create and post one READ (remote -> local descriptors, index for index)."""
        return self._post(self.create_read(local, local_idx, remote, remote_idx, remote_name,
                                           notif), remote_name, nbytes)

    def create_read(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray,
                    remote_name: str, notif: bytes = b"") -> Any:
        """Create one READ without posting it (NIXL resolves its descriptors now; nothing
        moves): a NIXL handle for :meth:`post`, or for :meth:`discard` if it is never posted."""
        try:
            return self._agent.make_prepped_xfer("READ", local, local_idx, remote, remote_idx,
                                                 notif)
        except Exception as e:
            raise TransferFailed(f"could not create a READ from {remote_name!r}: "
                                 f"{type(e).__name__}: {e}") from e

    def post(self, handle: Any, remote_name: str, nbytes: int) -> Xfer:
        """Post a READ :meth:`create_read` made (on failure its handle is released)."""
        return self._post(handle, remote_name, nbytes)

    def discard(self, handle: Any) -> None:
        """Release a READ :meth:`create_read` made that was never posted."""
        self.release(Xfer(handle, "", 0))

    def read_descs(self, local: np.ndarray, local_mem: str, remote: np.ndarray, remote_mem: str,
                   remote_name: str, nbytes: int, notif: bytes = b"") -> Xfer:
        """Create and post one READ of explicit ``Nx3`` uint64 ``(address, length, device)``
        tables, remote row -> local row (both inside memory the agents registered). Packed reads
        use it: one or a few large descriptors, a different place each time."""
        try:
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(local, local_mem),
                self._agent.get_xfer_descs(remote, remote_mem), remote_name, notif)
        except Exception as e:
            raise TransferFailed(f"could not create a READ of {len(remote)} descriptor(s) from "
                                 f"{remote_name!r}: {type(e).__name__}: {e}") from e
        return self._post(handle, remote_name, nbytes)

    def _post(self, handle: Any, remote_name: str, nbytes: int) -> Xfer:
        xfer = Xfer(handle, remote_name, nbytes)
        try:
            xfer.state = self._agent.transfer(handle)
        except Exception as e:
            self.release(xfer)
            raise TransferFailed(f"could not post a READ from {remote_name!r}: "
                                 f"{type(e).__name__}: {e}") from e
        return xfer

    def poll(self, xfer: Xfer) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"`` (an exception from NIXL counts as ``"ERR"``)."""
        if xfer.state == "PROC":
            try:
                xfer.state = self._agent.check_xfer_state(xfer.handle)
            except Exception:
                xfer.state = "ERR"
        return xfer.state

    def wait(self, xfers: list[Xfer], deadline: float, spin: float = 0.0) -> Xfer | None:
        """Poll until every transfer is DONE (returns None), one failed, or the deadline passes
        (returns the first unfinished one; its state says ``"ERR"`` or ``"PROC"``). The first
        ``spin`` seconds poll without sleeping."""
        pause = 0.0
        busy_until = time.monotonic() + spin
        while True:
            pending = [x for x in xfers if self.poll(x) != "DONE"]
            if not pending:
                return None
            failed = [x for x in pending if x.state == "ERR"]
            if failed:
                return failed[0]
            now = time.monotonic()
            if now >= deadline:
                return pending[0]
            if now < busy_until:
                continue
            time.sleep(pause)
            pause = min(0.001, pause + 0.00005)

    def release(self, xfer: Xfer) -> None:
        """Release a transfer handle; one NIXL cannot cancel yet is kept and retried at close."""
        try:
            xfer.handle.release()
        except Exception:
            self._leaked.append(xfer.handle)

    def telemetry(self, xfer: Xfer) -> int | None:
        """Descriptors NIXL submitted for ``xfer`` after merging (None without telemetry)."""
        try:
            return int(self._agent.get_xfer_telemetry(xfer.handle).descCount)
        except Exception:
            return None

    # -- notifications -------------------------------------------------------------------------
    def notifications(self) -> list[tuple[str, bytes]]:
        """New notifications as ``(sender agent name, message)``. NIXL decodes sender names as
        UTF-8: a peer with a name that is not loses its whole batch (raises
        :class:`UndecodableNotifications`; the requests of that batch wait for their lease)."""
        try:
            batch = self._agent.get_new_notifs()
        except UnicodeDecodeError as e:
            raise UndecodableNotifications(f"a batch of NIXL notifications had a sender name "
                                           f"that is not UTF-8 ({e}); the batch was dropped") from e
        return [(str(name), bytes(m)) for name, msgs in batch.items() for m in msgs]

    def notify(self, remote: str, message: bytes) -> None:
        """Send a notification. Without a progress thread, UCX is progressed once right after
        (NIXL does not track the send; one that could not leave at once goes on the next
        progress: this one, or the next transfer's polling)."""
        try:
            self._agent.send_notif(remote, message)
        except Exception as e:
            raise TransferFailed(f"could not notify {remote!r}: {type(e).__name__}: {e}") from e
        if self.progress == "off":
            try:  # a decode rank expects no notifications: whatever came in is dropped
                self._agent.get_new_notifs()
            except Exception:  # undecodable ones included; the send itself succeeded
                return

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        """Release handles and descriptor lists, drop peers, deregister memory. Idempotent."""
        agent = getattr(self, "_agent", None)
        if agent is None:
            return
        for handle in self._leaked:
            try:
                handle.release()
            except Exception:  # still busy in a dead connection; the agent frees it on destruction
                continue
        self._leaked.clear()
        for handle in self._dlists:
            try:
                handle.release()
            except Exception:
                continue
        self._dlists.clear()
        for name in list(self._remotes):
            self.remove_remote(name)
        for reg in self._registered:
            try:
                agent.deregister_memory(reg)
            except Exception:
                continue
        self._registered.clear()
        self._kept.clear()
        self._agent = None
