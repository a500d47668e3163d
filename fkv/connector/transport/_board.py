"""The publish board: how many layers of each streaming request a prefill rank has published,
in a small shared-memory file that same-host decode ranks read without asking.

A streaming read learns of each published layer through the side channel's long poll: the
prefill's server thread has to wake up, take the GIL from a main thread that is busy computing
the next layer, and answer; the decode's thread has to wake up too. On one host the count can be
read directly instead: :meth:`Server.publish` writes it into the board in the caller's own thread
(one 8-byte store), and the decode rank polls it while it waits. The long poll stays the path
that always works (other hosts, another user, no ``/dev/shm``, a slot two requests share); the
board is only ever a faster way to the same answer.

The board is ``SLOTS`` slots of two 64-bit words, a request's slot chosen by a keyed hash of its
id (the key is the board's own random salt). Each word is ``tag << 16 | layers``: the request's
48-bit tag and a layer count (the first word: layers published, the second: layers whose writes
finished). One aligned 8-byte store writes a word, so a reader sees a whole word of one request
or of another, never a mix, and takes a count only under its own request's tag. A released
request's words are cleared, so a request id used again starts from nothing.

The decode side reads with ``pread`` on a read-only descriptor, not through a mapping: a peer
that truncates its file gives short reads (counted as "no news"), never a fault in our process.
The name is checked against ``fkv-board-<32 hex>`` before anything is opened, the file must be
a regular file of exactly the board's size, and the counts read are bounded by the caller.

Waiting without polling (Linux): after the slots, the board holds a 32-bit *sequence* that every
``set`` increments before it wakes the futex on that word (``FUTEX_WAKE``, one system call). A
decode rank with nothing new reads the sequence (``pread``), then the counts, and sleeps in
``FUTEX_WAIT`` on the sequence's address for as long as it still holds the value it read: a
publish after the read ends the sleep at once, one before it shows in the counts, so no news is
lost. The decode side maps the file read-only (``mmap`` through libc) only to give the kernel
that address; Python never reads the mapping, and the kernel's own access to a page the peer has
truncated away fails with ``EFAULT`` (then the view stops using the futex) instead of raising a
fault. A peer can wake us spuriously; a wait then costs one more look at the counts.
``FKV_BOARD_FUTEX=0`` turns the futex off (waits nap on the side channel's sockets instead).

Stopping: 8 bytes after the sequence hold a *stopped* flag, set first when the prefill rank's
server closes. A decode rank that copies the rank's memory itself (``_cma``) reads it after each
copy: bytes copied from a server that stopped meanwhile are not trusted (a NIXL READ fails
there, the agent being gone).

Vouching: the 32 bytes after the stopped flag hold a digest of the process id and the cache
regions the server announced (:func:`vouch`, written once before the board is announced). The
board's name and salt travel in public metadata, so anyone can *name* a board; only this user
can write one. A decode rank copies a process's memory only where the board it opened vouches
for exactly that process and those regions, so a peer that relays an honest server's board with
another pid or other addresses gets NIXL READs, not copies from a process of its choosing.

The server's own stores go through its mapping (one 8-byte store per word, which readers need
whole); a same-user process that truncates the file would turn the next store into a fault, so
:meth:`Board.set` checks the file's size first and stops writing the board when it shrank
(readers then ask through the side channel, which always works).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import mmap
import operator
import os
import platform
import re
import stat
import struct
import sys
import weakref
from typing import Any

from fkv.connector.transport._base import process_alive
from fkv.errors import FkvError

__all__ = ["Board", "BoardView", "SLOTS", "open_announced", "open_beneath", "remove_at_exit",
           "remove_stale_boards", "vouch"]

#: Slots per board (two 8-byte words each: 64 KiB), then the 32-bit sequence and padding.
SLOTS = 4096
_SEQ = SLOTS * 16
_STOPPED = _SEQ + 8
_VOUCH = _SEQ + 16  # 32 bytes: vouch(pid, regions) of the server that made the board
#: 16 bytes: the process that made the board, for :func:`remove_stale_boards` only (its pid as a
#: u32, its PID namespace's inode as a u32, its start time in clock ticks as a u64; zeros where
#: ``/proc`` cannot say). Readers never read it.
_OWNER = _SEQ + 48
_BYTES = _SEQ + 64
_DIR = "/dev/shm"
_NAME = re.compile(r"fkv-board-[0-9a-f]{32}")
_MAX_LAYERS = (1 << 16) - 1
_SLOT_MEMO = 4 * SLOTS  # most request ids a board remembers the slot of


# -- futexes (Linux; anything else leaves the board without them) ---------------------------------
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine()) if sys.platform == "linux" \
    else None
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the waker is another process


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> Any:
    if _SYS_FUTEX is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def _futex_wake_args(address: int) -> tuple[Any, ...] | None:
    """The arguments of ``syscall`` that wake every waiter on the futex at ``address`` (built
    once per board; None without a futex)."""
    if _LIBC is None:
        return None
    return (ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_int(_FUTEX_WAKE),
            ctypes.c_int(0x7FFFFFFF), None, None, ctypes.c_int(0))


def _futex_wait(address: int, expected: int, seconds: float) -> bool:
    """Sleep while the 32-bit word at ``address`` holds ``expected``, at most ``seconds`` (the
    GIL is released meanwhile). False when the futex cannot be used at all (EFAULT: the page is
    gone; ENOSYS, EINVAL, EPERM): the caller stops using it."""
    seconds = max(0.0, seconds)
    ts = _Timespec(int(seconds), int((seconds - int(seconds)) * 1e9))
    r = _LIBC.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address),
                      ctypes.c_int(_FUTEX_WAIT), ctypes.c_uint(expected & 0xFFFFFFFF),
                      ctypes.byref(ts), None, ctypes.c_int(0))
    return r == 0 or ctypes.get_errno() in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT)


def vouch(pid: int, regions: Any) -> bytes:
    """The digest a board holds of what its server announced: its process id and its cache
    regions ``((base, nbytes), ...)``, in order."""
    h = hashlib.blake2b(digest_size=32, person=b"fkv-board-vouch")
    h.update(operator.index(pid).to_bytes(8, "little", signed=True))
    for base, nbytes in regions:
        h.update(operator.index(base).to_bytes(8, "little")
                 + operator.index(nbytes).to_bytes(8, "little"))
    return h.digest()


def _slot(salt: bytes, request_id: str) -> tuple[int, int]:
    """``(slot, tag)`` of a request: a keyed hash, 48 bits of tag (never 0: 0 is an empty word)
    and the slot from the other 16."""
    digest = int.from_bytes(hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"),
                                            key=salt, digest_size=8).digest(), "little")
    tag = digest & ((1 << 48) - 1) or 1
    return (digest >> 48) % SLOTS, tag


def _remove(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not from a forked child: the name is its parent's
        with contextlib.suppress(OSError):
            os.unlink(path)


def remove_at_exit(holder: object, path: str) -> weakref.finalize:
    """Remove the file ``path`` that ``holder`` created in ``/dev/shm`` when ``holder`` is
    collected or the interpreter exits, whichever comes first, in the process that created it
    only (a forked child exiting leaves its parent's file alone). A process that exits without
    closing what made the file (a server never closed, a notebook kernel shut down) would
    otherwise leave it behind; a killed one still does (nothing runs). Calling the returned
    finalizer removes the file at once (idempotent)."""
    return weakref.finalize(holder, _remove, path, os.getpid())


def _start_time(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks after boot, ``/proc/<pid>/stat`` field 22), or
    None when there is no such process or ``/proc`` cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_namespace() -> int:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``), 0 when unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def _owner_record() -> bytes:
    pid, start, ns = os.getpid(), _start_time(os.getpid()), _pid_namespace()
    if start is None or not ns or pid > 0xFFFFFFFF:
        return bytes(16)
    return struct.pack("<IIQ", pid, ns, start)


def remove_stale_boards() -> tuple[str, ...]:
    """Remove the boards in ``/dev/shm`` that a process of this user made and that outlived it
    (killed before it could close them: SIGKILL, SIGTERM without a handler, a crash); return
    their names. A board is removed only when it is a regular file of a board's size owned by
    this user, its owner record names a process of this PID namespace, and that process is gone
    (no such pid, or a pid now held by a process that started at another time). Anything
    unsure is left: a board without an owner record, one made in another PID namespace (a
    container sharing ``/dev/shm``), a process ``/proc`` cannot tell about."""
    ns = _pid_namespace()
    try:
        names = os.listdir(_DIR) if ns else []
    except OSError:
        return ()
    removed = []
    for name in names:
        if not _NAME.fullmatch(name):
            continue
        path = os.path.join(_DIR, name)
        try:  # as an announced board is opened: a mount on the name is never asked anything
            fd = open_beneath(_DIR, name, os.O_RDONLY)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() \
                    or st.st_size != _BYTES:
                continue
            raw = os.pread(fd, 16, _OWNER)
        except OSError:
            continue
        finally:
            os.close(fd)
        if len(raw) != 16:
            continue
        pid, owner_ns, start = struct.unpack("<IIQ", raw)
        if pid == 0 or owner_ns != ns or pid == os.getpid():
            continue
        now = _start_time(pid)
        if now == start or (now is None and process_alive(pid)):
            continue  # alive, or alive and unreadable: not ours to judge
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(name)
    return tuple(removed)


class Board:
    """The prefill rank's board (created in ``/dev/shm``, readable by this user only, removed
    at :meth:`close`). Call under the server's lock."""

    def __init__(self) -> None:
        with contextlib.suppress(Exception):  # best effort: a board is made either way
            remove_stale_boards()
        self.salt = os.urandom(16)
        self.name = f"fkv-board-{os.urandom(16).hex()}"
        self.path = os.path.join(_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, _BYTES)
            os.pwrite(fd, bytes(8), _STOPPED)  # its page exists now: stop() needs no space
            os.pwrite(fd, _owner_record(), _OWNER)
            import mmap

            self._map = mmap.mmap(fd, _BYTES)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd: int | None = fd  # kept for the stopped flag (a pwrite cannot fault)
        self._remove = remove_at_exit(self, self.path)
        # Item assignment of a memoryview cast to "Q" is one 8-byte store into the mapping (an
        # aligned word: whole for any reader); cheaper than numpy's scalar path, which matters
        # because publish runs in the prefill's forward pass, often right after a sleep.
        self._words: memoryview | None = memoryview(self._map).cast("Q")
        self._seq: memoryview | None = memoryview(self._map)[_SEQ:_SEQ + 4].cast("I")
        anchor = ctypes.c_char.from_buffer(self._map)  # its address only; released at once
        self._seq_address = ctypes.addressof(anchor) + _SEQ
        del anchor
        self._wake_args = _futex_wake_args(self._seq_address)
        #: request id -> (slot, tag) of the requests written here (hashed once per request)
        self._slots: dict[str, tuple[int, int]] = {}

    def _slot_of(self, request_id: str) -> tuple[int, int]:
        got = self._slots.get(request_id)
        if got is None:
            if len(self._slots) >= _SLOT_MEMO:  # ids nobody cleared (a bound, not a cache policy)
                self._slots.clear()
            got = self._slots[request_id] = _slot(self.salt, request_id)
        return got

    def vouch_for(self, pid: int, regions: Any) -> None:
        """Write :func:`vouch` of the process and regions the server announces with this board
        (before the board's name is sent anywhere)."""
        if self._fd is not None:
            os.pwrite(self._fd, vouch(pid, regions), _VOUCH)

    def _intact(self) -> bool:
        """Whether the file still has the board's size (a store into a page someone truncated
        away would be a fault); once it shrank, the board is written no more."""
        fd = self._fd
        with contextlib.suppress(OSError):  # a descriptor that fails fstat: stop writing too
            if fd is not None and os.fstat(fd).st_size >= _BYTES:
                return True
        for view in (self._words, self._seq):
            if view is not None:
                view.release()
        self._words = self._seq = None
        return False

    def set(self, request_id: str, published: int, written: int) -> None:
        """Write a request's counts (layers published, layers whose writes finished), then
        advance the sequence and wake its waiters."""
        words, seq = self._words, self._seq
        if words is None or seq is None or max(published, written) > _MAX_LAYERS \
                or not self._intact():
            return
        slot, tag = self._slot_of(request_id)
        words[2 * slot] = tag << 16 | published
        words[2 * slot + 1] = tag << 16 | written
        seq[0] = (seq[0] + 1) & 0xFFFFFFFF
        if self._wake_args is not None:
            _LIBC.syscall(*self._wake_args)

    def clear(self, request_id: str) -> None:
        """Forget a released request (unless its slot now holds another's)."""
        words = self._words
        if words is None or not self._intact():
            return
        slot, tag = self._slots.pop(request_id, None) or _slot(self.salt, request_id)
        if words[2 * slot] >> 16 == tag:
            words[2 * slot] = 0
            words[2 * slot + 1] = 0

    def stop(self) -> None:
        """Set the stopped flag (the server is closing; idempotent), then clear every count,
        advance the sequence and wake its waiters, and write the board no more. A reader asleep
        on a request's count would otherwise wait for a publish that never comes until its
        read's timeout; with the count gone it asks the long poll, which hears at once that the
        server went away. Written with ``pwrite``, not through the mapping: a file someone
        truncated gives no fault here (nor is it grown back)."""
        for view in (self._words, self._seq):
            if view is not None:
                view.release()
        self._words = self._seq = None  # a publish racing the close writes nothing now
        fd = self._fd
        if fd is None:
            return
        # only an I/O error can fail here (the page exists since creation); readers then
        # still have their exit check and their read's notification
        with contextlib.suppress(OSError):
            os.pwrite(fd, (1).to_bytes(8, "little"), _STOPPED)
            if os.fstat(fd).st_size >= _BYTES:
                os.pwrite(fd, bytes(_SEQ), 0)
                seq = int.from_bytes(os.pread(fd, 4, _SEQ), "little")
                os.pwrite(fd, ((seq + 1) & 0xFFFFFFFF).to_bytes(4, "little"), _SEQ)
                if self._wake_args is not None:
                    _LIBC.syscall(*self._wake_args)

    def close(self) -> None:
        if self._fd is None:  # closed already (a board that shrank is closed all the same)
            return
        self.stop()
        os.close(self._fd)
        self._fd = None
        self._slots.clear()
        # a view still alive somewhere: the unmap waits for the process
        with contextlib.suppress(BufferError):
            self._map.close()
        self._remove()  # removed already (earlier close, by hand): nothing to do


# openat2(2) (Linux 5.6; the same number on x86-64 and aarch64) and its resolve flags
_SYS_OPENAT2 = 437 if sys.platform == "linux" else None
_RESOLVE_NO_XDEV, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x01, 0x04, 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def open_beneath(directory: str, name: str, flags: int) -> int:
    """``os.open(directory/name, flags)`` that never crosses a mount point or follows a link:
    with ``openat2`` and ``RESOLVE_NO_XDEV``, a name someone mounted a file system on is refused
    (``EXDEV``) before that file system is asked anything, so an announced name cannot make the
    open wait on a FUSE server that never answers. Where the kernel has no ``openat2``
    (``ENOSYS``; a sandbox may say ``EPERM``), a plain ``O_NOFOLLOW`` open. OSError as
    ``os.open``."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if _LIBC is not None and _SYS_OPENAT2 is not None:
        dirfd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            how = _OpenHow(flags, 0, _RESOLVE_NO_XDEV | _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH)
            fd = _LIBC.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd),
                               ctypes.c_char_p(os.fsencode(name)), ctypes.byref(how),
                               ctypes.c_size_t(ctypes.sizeof(how)))
            code = ctypes.get_errno() if fd < 0 else 0
        finally:
            os.close(dirfd)
        if fd >= 0:
            return int(fd)
        if code not in (errno.ENOSYS, errno.EPERM):
            raise OSError(code, os.strerror(code))
    return os.open(os.path.join(directory, name), flags)


def open_announced(what: str, name: Any, pattern: re.Pattern[str], prefix: str,
                   flags: int) -> int:
    """A descriptor of ``/dev/shm/<name>``, a file a peer announced (its publish board, its
    outbox): the name must match ``pattern`` (``prefix`` and 32 hex digits) before anything is
    opened, and neither a symlink nor a mount point there is followed (:func:`open_beneath`).
    FkvError naming ``what`` otherwise."""
    if not isinstance(name, str) or not pattern.fullmatch(name):
        raise FkvError(f"{what} name {str(name)[:64]!r}: expected '{prefix}' and 32 hex digits")
    try:
        return open_beneath(_DIR, name, flags)
    except OSError as e:
        why = "a file system is mounted there" if e.errno == errno.EXDEV else e.strerror
        raise FkvError(f"{what} {name}: cannot open it ({why})") from None


class BoardView:
    """A decode rank's read-only view of one prefill rank's board (see the module docstring)."""

    def __init__(self, name: str, salt: bytes, pid: int = 0) -> None:
        if not isinstance(salt, bytes) or len(salt) != 16:
            raise FkvError("publish board salt: expected 16 bytes")
        fd = open_announced("publish board", name, _NAME, "fkv-board-", os.O_RDONLY)
        self.name, self.salt = name, salt
        #: the process the rank announced (0: not said): a reader asleep on the board checks it
        #: is alive, since a killed process sets no stopped flag and answers no long poll
        self.pid = pid
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != _BYTES:
                raise FkvError(f"publish board {name}: expected a regular file of {_BYTES} bytes "
                               f"(got mode 0o{st.st_mode:o}, {st.st_size} bytes)")
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._last: tuple[str, int, int] = ("", 0, 0)  # request id, slot, tag (a wait polls one)
        #: the file mapped read-only for FUTEX_WAIT's address (0: no futex here)
        self._address = 0
        if _LIBC is not None and os.environ.get("FKV_BOARD_FUTEX", "1") != "0":
            address = _LIBC.mmap(None, _BYTES, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address not in (None, ctypes.c_void_p(-1).value):
                self._address = address

    @property
    def can_wait(self) -> bool:
        """Whether :meth:`wait` sleeps on a futex (else the caller naps some other way)."""
        return bool(self._address) and self._fd is not None

    def sequence(self) -> int | None:
        """The board's sequence (advanced by every count written), or None (a short read: the
        file was cut, and the view stops using the futex). A board cut below its sequence may
        still hold the request's slot, whose stale count would keep a reader from asking the
        long poll (:attr:`can_wait` and a count there); with no sequence to sleep on, the reader
        would spin on that count until its deadline instead."""
        if self._fd is None:
            return None
        try:
            raw = os.pread(self._fd, 4, _SEQ)
        except OSError:
            raw = b""
        if len(raw) != 4:
            self._unmap()
            return None
        return int.from_bytes(raw, "little")

    def owner(self) -> int | None:
        """The uid owning the board's file (None: no longer open)."""
        if self._fd is None:
            return None
        return os.fstat(self._fd).st_uid

    def vouches(self, pid: int, regions: Any) -> bool:
        """Whether the board's server announced exactly this process and these regions
        (:func:`vouch`)."""
        if self._fd is None:
            return False
        try:
            return os.pread(self._fd, 32, _VOUCH) == vouch(pid, regions)
        except (OSError, OverflowError, TypeError, ValueError):  # a region not (int, int)
            return False

    def stopped(self) -> bool:
        """Whether the board's server said it stopped (or the board cannot be read any more)."""
        if self._fd is None:
            return True
        try:
            raw = os.pread(self._fd, 8, _STOPPED)
        except OSError:
            return True
        return len(raw) != 8 or raw != bytes(8)

    def wait(self, sequence: int, seconds: float) -> bool:
        """Sleep until the board's sequence is no longer ``sequence`` (a count was written), at
        most ``seconds``; at once if it already moved on. False when this view cannot wait (no
        futex, or the peer's page is gone: the view stops trying)."""
        if not self.can_wait:
            return False
        if _futex_wait(self._address + _SEQ, sequence, seconds):
            return True
        self._unmap()
        return False

    def _unmap(self) -> None:
        if self._address:
            _LIBC.munmap(ctypes.c_void_p(self._address), _BYTES)
            self._address = 0

    def layers(self, request_id: str, published: bool) -> int | None:
        """The count the board holds for ``request_id`` (``published``: layers announced, else
        layers written), or None: no word of this request there (not held, cleared, a slot
        another request took, a short read)."""
        fd = self._fd
        if fd is None:
            return None
        rid, slot, tag = self._last
        if rid != request_id or not rid:  # hashed once per request, not once per look
            slot, tag = _slot(self.salt, request_id)
            self._last = (request_id, slot, tag)
        try:
            raw = os.pread(fd, 8, 16 * slot + (0 if published else 8))
        except OSError:
            return None
        if len(raw) != 8:
            return None
        word = int.from_bytes(raw, "little")
        return word & 0xFFFF if word >> 16 == tag else None

    def close(self) -> None:
        self._unmap()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_board(info: Any) -> BoardView | None:
    """A view of a peer's board when it is on this host and readable here, else None."""
    if info is None:
        return None
    from fkv.connector.transport._ipc import host_identity

    if info.host != host_identity():
        return None
    try:
        return BoardView(info.name, info.salt, getattr(info, "pid", 0) or 0)
    except FkvError:
        return None
