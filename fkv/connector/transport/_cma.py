"""Same-host copies of CPU DRAM caches: the plan's rows read straight from the prefill process.

When a decode rank's caches and a prefill rank's caches are both in CPU DRAM on one host, the
bytes of a request can be copied by the kernel from the prefill process's memory into the decode
caches with ``process_vm_readv`` (cross-memory attach): one system call moves up to 1024 rows.
NIXL's UCX backend copies the same way over its ``cma`` transport, but one call per descriptor,
with UCX's own bookkeeping around each (32 warm rows of 16 KiB: 0.17 ms that way, 0.03 ms in one
call), and a copy of 4 MiB or more is split here between threads (cold rows copy at about 4
GB/s on one thread; bench/NOTES.md, seventeenth session). The plan paths (``direct`` and
``staging``) then copy instead of posting NIXL READs; everything else stays: the plan's rows,
the staging moves, the notifications, NIXL for other hosts and GPU memory.

What a prefill rank says and what is checked before the first copy (:class:`SameHostCopy`):

- its publish board (``wire.BoardInfo``) names its host identity (host name, boot id, PID
  namespace: a pid names the same process here) and its process id, and this process can open
  the board, whose file belongs to this process's user: a server that stops sets the board's
  stopped flag first, and a copy that ends after it fails (as a NIXL READ fails once the
  server's agent is gone);
- that process belongs to this process's user (a reader never copies from a process its user
  could not read itself), and a pidfd is opened on it before that check: the process that exits
  during a read fails that read, and a recycled pid is never copied from afterwards;
- the board vouches for that process id and exactly the announced regions (``_board.vouch``,
  written by the server that made the board): a board's name is public, its contents are
  this user's;
- the first and last bytes of every announced region are read from it: the regions are mapped
  there, and the kernel lets this process read them (Yama's ``ptrace_scope`` or a missing
  ``CAP_SYS_PTRACE`` refuse with ``EPERM``; the connection then uses NIXL and says why).

Whatever a hostile peer announces, a copy writes only into this rank's own regions (or its
staging buffer) at the plan's offsets, checked against their sizes before each call; what it
reads is at the server's word (a wrong region address reads other bytes of that same process,
as a NIXL READ of a wrong address would). Both the named process and the board's file must belong
to this process's user, and the board must vouch for the process and the regions: a peer of
another user (who can neither create nor write a file owned by this user) cannot make this rank
copy from any process at all, not even by relaying an honest server's board under another pid
or other addresses, and a peer of this user could read those processes itself (the same
permission ``process_vm_readv`` needs). A short or failed call fails the read: nothing is
reported as done. ``FKV_CMA=0`` turns these copies off (NIXL READs everywhere).

What is left to a prefill process of this same user, which could as well stop or trace ours:
a call in flight is not cut by the read's timeout, so a region it backs with memory whose
faults are never served (a file system that does not answer, a ``userfaultfd`` it does not
serve) holds the read until that process lets go or exits.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno
import functools
import math
import os
import select
import time
from typing import Any

import numpy as np

from fkv.connector.transport._base import TransferFailed, process_alive
from fkv.errors import FkvError

__all__ = ["IOV_MAX", "SameHostCopy", "cma_refusal", "cma_wanted", "copy_threads", "iovecs"]

#: Most rows one ``process_vm_readv`` takes (the kernel's ``UIO_MAXIOV``).
IOV_MAX = 1024
#: Bytes read from each end of every announced region when the connection is checked.
_PROBE_BYTES = 8
#: A copy of at least this many bytes is split between threads (``FKV_CMA_THREADS``, default
#: 4), each taking at least ``_SPLIT_BYTES // 2``: one thread copies 8 MiB of cold rows at
#: 4.0-4.5 GB/s on the H200 host, four at 7.4-7.8; under 1 MiB the hand-off costs more than it
#: saves (bench/results/raw/cma-threads-exp-20261203T1021.json; bench/NOTES.md, seventeenth
#: session).
_SPLIT_BYTES = 4 << 20
_DEFAULT_THREADS = 4
#: :meth:`SameHostCopy.prime` touches a copy's pages only when the copy is at most this many
#: bytes: what it warms (page-table walks on both sides, a line per page) must still be in the
#: caches when the copy runs; a copy of 8 MiB gained 1-4 % from it, one of 0.5-1 MiB copied in
#: half the time (the same raw file; bench/NOTES.md, seventeenth session).
_PRIME_BYTES = 2 << 20
#: The page size a prime steps by (the kernel's base page).
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def copy_threads() -> int:
    """Threads one large copy is split between (``FKV_CMA_THREADS``, 1 to 64; default 4)."""
    raw = os.environ.get("FKV_CMA_THREADS", str(_DEFAULT_THREADS))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= 64:
        raise FkvError(f"FKV_CMA_THREADS={raw!r}: expected an integer from 1 to 64 (threads one "
                       f"large same-host copy is split between)")
    return value


def cma_wanted() -> bool:
    """Whether this process copies same-host DRAM rows itself (``FKV_CMA``, default on)."""
    return os.environ.get("FKV_CMA", "1") != "0"


@functools.cache
def _readv() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                   ctypes.c_ulong, ctypes.c_ulong]
    return fn


def _call(pid: int, local: np.ndarray, remote: np.ndarray) -> tuple[int, int]:
    """One ``process_vm_readv`` of ``len(local)`` rows (iovec arrays: address, length); the
    bytes it read and the errno when it failed (0 otherwise)."""
    got = _readv()(pid, local.ctypes.data, local.shape[0], remote.ctypes.data, remote.shape[0], 0)
    return (got, 0) if got >= 0 else (0, ctypes.get_errno())


def _why(code: int, pid: int) -> str:
    name = errno.errorcode.get(code, str(code))
    if code == errno.EPERM:
        return (f"the kernel refused to let this process read process {pid}'s memory (EPERM: "
                f"Yama's /proc/sys/kernel/yama/ptrace_scope above 0, or a container without "
                f"CAP_SYS_PTRACE)")
    if code == errno.ESRCH:
        return f"process {pid} is gone (ESRCH)"
    if code == errno.EFAULT:
        return f"an announced region is not mapped in process {pid} (EFAULT)"
    if code == errno.ENOSYS:
        return "process_vm_readv is not available on this kernel (ENOSYS)"
    return f"process_vm_readv failed ({name})"


def cma_refusal(peer: Any, rank: int, local_mem_type: str, peer_mem_type: str) -> str:
    """Why this decode rank cannot copy prefill rank ``rank``'s regions itself ("" if it may
    try: :class:`SameHostCopy` then checks the process)."""
    from fkv.connector.transport._ipc import host_identity

    if not cma_wanted():
        return "FKV_CMA=0"
    if local_mem_type != "DRAM":
        return "the decode caches are not in CPU DRAM"
    if peer_mem_type != "DRAM":
        return f"prefill rank {rank}'s caches are not in CPU DRAM"
    board = peer.board
    if board is None:
        return f"prefill rank {rank} announced no publish board (no host identity)"
    if board.host != host_identity():
        return f"prefill rank {rank} runs on another host ({board.host!r})"
    if board.pid <= 0:
        return f"prefill rank {rank} announced no process id"
    return ""


def iovecs(rows: np.ndarray, bases: np.ndarray, sizes: np.ndarray, *, local: bool) -> np.ndarray:
    """The iovec array (address, length per row, uint64) of one side of plan ``rows``: on the
    local side region ``rows[:, 3]`` at offset ``rows[:, 4]`` (-1: the last entry of ``bases``,
    the staging buffer, of size 0 when there is none), on the remote side region ``rows[:, 1]``
    at ``rows[:, 2]``; length ``rows[:, 5]``. Every row must lie inside its region of ``sizes``
    bytes (FkvError otherwise: nothing is copied)."""
    region, offset = (rows[:, 3], rows[:, 4]) if local else (rows[:, 1], rows[:, 2])
    length = rows[:, 5]
    side, n = ("local", bases.shape[0] - 1) if local else ("remote", bases.shape[0])
    if ((region < (-1 if local else 0)) | (region >= n)).any():
        raise FkvError(f"a plan row names a {side} region outside 0..{n - 1}; nothing was copied")
    index = np.where(region < 0, bases.shape[0] - 1, region)
    size = sizes[index]
    # length against the room left (offset + length could wrap past int64 and pass)
    if ((offset < 0) | (length <= 0) | (offset > size) | (length > size - offset)).any():
        raise FkvError(f"a plan row leaves its {side} region; nothing was copied")
    out = np.empty((rows.shape[0], 2), dtype=np.uint64)
    out[:, 0] = bases[index] + offset.astype(np.uint64)
    out[:, 1] = length
    return out


def _read_points(pid: int, points: np.ndarray, scratch: np.ndarray) -> int:
    """Read ``points`` (an iovec array, at most ``_PROBE_BYTES`` each) from process ``pid``
    into ``scratch``, ``_PROBE_BYTES`` apart, in calls of up to ``IOV_MAX``; stops at the first
    short call and returns its errno (``EFAULT`` if it set none), 0 when every byte came."""
    into = points.copy()
    into[:, 0] = scratch.ctypes.data + np.arange(points.shape[0], dtype=np.uint64) * _PROBE_BYTES
    for start in range(0, points.shape[0], IOV_MAX):
        stop = start + IOV_MAX
        got, code = _call(pid, into[start:stop], points[start:stop])
        if got != int(points[start:stop, 1].sum()):
            return code or errno.EFAULT
    return 0


def _page_points(iov: np.ndarray) -> np.ndarray:
    """An iovec array of up to 8 bytes at every ``_PAGE`` step of each row of ``iov`` (the row's
    start, then one page on, ...): a touch of each page a copy of those rows reads or writes."""
    lengths = iov[:, 1].astype(np.int64)
    counts = (lengths + _PAGE - 1) // _PAGE
    firsts = np.cumsum(counts) - counts
    step = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(firsts, counts)
    offset = step * _PAGE
    out = np.empty((offset.shape[0], 2), dtype=np.uint64)
    out[:, 0] = np.repeat(iov[:, 0], counts) + offset.astype(np.uint64)
    out[:, 1] = np.minimum(np.repeat(lengths, counts) - offset, _PROBE_BYTES)
    return out


def _copy_rows(pid: int, local: np.ndarray, remote: np.ndarray, nbytes: int,
               deadline: float) -> str:
    """Copy rows in calls of up to ``IOV_MAX``; "" when every byte came, else what failed."""
    n = local.shape[0]
    for start in range(0, n, IOV_MAX):
        stop = min(n, start + IOV_MAX)
        want = nbytes if n <= IOV_MAX else int(local[start:stop, 1].sum())
        got, code = _call(pid, local[start:stop], remote[start:stop])
        if got != want:
            return _why(code, pid) if code else f"it read {got} of {want} bytes"
        if stop < n and time.monotonic() > deadline:
            return "it did not finish before the read's timeout"
    return ""


class _Source:
    """One prefill rank's process: its pid, a pidfd on it, its announced regions."""

    def __init__(self, rank: int, peer: Any) -> None:
        from fkv.connector.transport._board import open_board

        pid, regions = peer.board.pid, peer.regions
        self.rank, self.pid = rank, pid
        self.bases = np.array([b for b, _ in regions], dtype=np.uint64)
        self.sizes = np.array([n for _, n in regions], dtype=np.int64)
        self.pidfd = -1
        self._poll: Any = None
        self.board = open_board(peer.board)
        if self.board is None:
            raise FkvError(f"prefill rank {rank}'s publish board {peer.board.name} cannot be "
                           f"opened here (its stop could not be seen)")
        try:
            # the pidfd first: the owner checked below is then the process it names (a pid
            # recycled before the open names the new process in both; one recycled after it
            # shows as an exit)
            try:
                self.pidfd = os.pidfd_open(pid)
            except (OSError, AttributeError):  # no pidfds here: the exit check asks os.kill
                self.pidfd = -1
            if self.pidfd >= 0:
                self._poll = select.poll()
                self._poll.register(self.pidfd, select.POLLIN)
            try:
                owner = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                raise FkvError(f"prefill rank {rank}'s process {pid} does not exist on this "
                               f"host (no /proc/{pid})") from None
            if owner != os.getuid():
                raise FkvError(f"prefill rank {rank}'s process {pid} belongs to uid {owner}, "
                               f"not to this process's uid {os.getuid()}")
            if self.exited():
                raise FkvError(f"prefill rank {rank}'s process {pid} exited while it was checked")
            board_owner = self.board.owner()
            if board_owner != os.getuid():  # the announcer is this user too: see the docstring
                raise FkvError(f"prefill rank {rank}'s publish board {peer.board.name} belongs "
                               f"to uid {board_owner}, not to this process's uid {os.getuid()}")
            if not self.board.vouches(pid, regions):
                raise FkvError(f"prefill rank {rank}'s publish board {peer.board.name} does not "
                               f"vouch for process {pid} and the {len(regions)} region(s) "
                               f"announced with it: its server announced others (metadata "
                               f"relayed with another pid or other addresses)")
            self._probe(regions)
        except BaseException:
            self.close()
            raise

    def _probe(self, regions: tuple[tuple[int, int], ...]) -> None:
        """Read the first and last (up to) 8 bytes of every region from the process."""
        remote = np.array([(b + off, min(_PROBE_BYTES, n)) for b, n in regions
                           for off in (0, max(0, n - _PROBE_BYTES))], dtype=np.uint64)
        code = _read_points(self.pid, remote,
                            np.empty(remote.shape[0] * _PROBE_BYTES, dtype=np.uint8))
        if code:
            raise FkvError(f"cannot copy from prefill rank {self.rank}'s process {self.pid}: "
                           f"{_why(code, self.pid)}")

    def exited(self) -> bool:
        if self._poll is not None:
            return bool(self._poll.poll(0))
        return not process_alive(self.pid)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        self._poll = None
        if self.board is not None:
            self.board.close()
            self.board = None


class SameHostCopy:
    """The prefill processes one decode rank copies from, and its own regions to copy into.

    ``local_regions``: the decode rank's ``(base, nbytes)`` regions; ``staging``: its staging
    buffer's (rows whose local region is -1 land there), or None; ``peers``: rank ->
    the prefill rank's wire ``Peer`` (its board says host and pid); ``threads``: how many
    threads a large copy is split between. Raises FkvError naming what failed when a process
    cannot be copied from."""

    def __init__(self, local_regions: list[tuple[int, int]], staging: tuple[int, int] | None,
                 peers: dict[int, Any], engine_id: str, threads: int = 1) -> None:
        self.engine_id = engine_id
        regions = [*local_regions, staging or (0, 0)]
        self.local_bases = np.array([b for b, _ in regions], dtype=np.uint64)
        self.local_sizes = np.array([n for _, n in regions], dtype=np.int64)
        self.sources: dict[int, _Source] = {}
        self.threads = threads  # a large copy is split between this many (copy_threads())
        self._pool: cf.ThreadPoolExecutor | None = None  # made at the first large copy
        self._scratch = np.empty(0, dtype=np.uint8)  # where prime's touches land
        self.primed = 0  # copies primed (prime), for tests and the bench
        self._prime_rate = 0.0  # seconds per byte the last prime took (0: none yet)
        try:
            for rank, peer in peers.items():
                self.sources[rank] = _Source(rank, peer)
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        pids = ", ".join(f"P{r} pid {s.pid}" for r, s in self.sources.items())
        return f"copied with process_vm_readv from the prefill processes ({pids})"

    def vectors(self, rank: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The local and remote iovec arrays of one prefill rank's plan rows, and their bytes."""
        src = self.sources[rank]
        local = iovecs(rows, self.local_bases, self.local_sizes, local=True)
        remote = iovecs(rows, src.bases, src.sizes, local=False)
        return local, remote, int(rows[:, 5].sum())

    def prime(self, rank: int, local: np.ndarray, remote: np.ndarray, nbytes: int,
              budget: float = math.inf) -> bool:
        """Touch every page the copy of these vectors (:meth:`vectors`) will read or write, a
        few bytes each, without copying: the page-table walks of both processes and a line per
        page are then in the caches when the copy runs (a streamed read calls it as it starts
        spinning ahead of the layer's publish). On a cold host most of a small copy's time is
        those walks, and touching the pages costs more than it saves in the copy, so it is
        worth it only where it is hidden: skipped when the last prime's rate says these bytes
        take longer than ``budget`` seconds, and for copies over ``_PRIME_BYTES``. The touched
        bytes land in a scratch buffer (never in the caches); a failed touch is left for the
        copy to report. Whether it touched."""
        if not 0 < nbytes <= _PRIME_BYTES or rank not in self.sources or \
                nbytes * self._prime_rate > budget:
            return False
        t0 = time.perf_counter()
        far, near = _page_points(remote), _page_points(local)
        split = far.shape[0] * _PROBE_BYTES
        if self._scratch.shape[0] < split + near.shape[0] * _PROBE_BYTES:
            self._scratch = np.empty(split + near.shape[0] * _PROBE_BYTES, dtype=np.uint8)
        # the remote touches land first in the scratch buffer, this process's after them; what
        # fails is left for the copy to report
        _read_points(self.sources[rank].pid, far, self._scratch[:split])
        _read_points(os.getpid(), near, self._scratch[split:])
        self._prime_rate = (time.perf_counter() - t0) / nbytes
        self.primed += 1
        return True

    def copy(self, rank: int, local: np.ndarray, remote: np.ndarray, nbytes: int,
             deadline: float) -> None:
        """Copy the rows of :meth:`vectors` (every byte, or TransferFailed naming the rank and,
        first, a process that exited or a server that stopped, whatever the copy did). A copy
        of ``_SPLIT_BYTES`` or more is split into runs of rows of about equal bytes, copied at
        once by this thread and up to ``threads - 1`` others."""
        src = self.sources[rank]
        who = f"prefill rank {rank} of engine {self.engine_id!r} (pid {src.pid})"
        parts = min(self.threads, nbytes // (_SPLIT_BYTES // 2), local.shape[0])
        if parts < 2:
            failed = _copy_rows(src.pid, local, remote, nbytes, deadline)
        else:
            bounds = np.searchsorted(np.cumsum(local[:, 1]),
                                     np.arange(1, parts) * (nbytes / parts)).tolist()
            edges = [0, *(b + 1 for b in bounds), local.shape[0]]
            runs = [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.threads - 1,
                                                   thread_name_prefix="fkv-copy")
            others = [self._pool.submit(_copy_rows, src.pid, local[a:b], remote[a:b],
                                        int(local[a:b, 1].sum()), deadline)
                      for a, b in runs[1:]]
            a, b = runs[0]
            try:
                failed = _copy_rows(src.pid, local[a:b], remote[a:b],
                                    int(local[a:b, 1].sum()), deadline)
            finally:  # every thread has finished before the read goes on, whatever happened
                done = [future.result() for future in others]
            failed = failed or next((f for f in done if f), "")
        if src.exited():
            raise TransferFailed(f"{who} exited: its bytes are not trusted; reconnect once it "
                                 f"is back (client.reconnect())")
        if src.board.stopped():
            raise TransferFailed(f"{who} stopped serving (its publish board says so): its "
                                 f"bytes are not trusted; reconnect once it is back "
                                 f"(client.reconnect())")
        if failed:
            raise TransferFailed(f"copy from {who} failed: {failed}: the prefill process may "
                                 f"have died: reconnect once it is back (client.reconnect())")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for src in self.sources.values():
            src.close()
        self.sources.clear()
