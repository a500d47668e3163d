"""The outbox: a same-host decode rank's notifications to one prefill rank, through a small file
in ``/dev/shm`` instead of NIXL.

A read ends by telling each prefill rank it read (or only notifies) that it is done, so the
rank can free the request's blocks. NIXL's UCX endpoints need peer error handling, which UCX's
shared-memory transports do not provide, so between two processes of one host that message
goes over TCP loopback: 0.03-0.1 ms per send, on the tail of every read (bench/NOTES.md). The
decode rank writes the same message into a file the prefill rank's server loop reads instead:
three system calls. NIXL stays the path that always works: another host, no ``/dev/shm``, a
prefill rank that did not accept the outbox, a message too long for a record, a full ring.

The file (little-endian): a 64-byte header, then ``SLOTS`` records of ``RECORD_BYTES``. Header:
bytes 0-15 the outbox's token (random; the prefill rank opens an outbox only when the Hello that
announced it carries the same token), 16-23 the count of records written (the decode rank's),
24-31 the count of records read and 32-39 a closed flag (the prefill rank's: it sets the flag
when it stops reading, its server closing included, so that the decode rank's next message
goes through NIXL and fails there as it did before outboxes when the rank is gone), 40-47 an
ended flag (the decode rank's, set when it closes the outbox: the prefill rank takes what is
left and drops it). Record ``i`` lives in slot ``i % SLOTS``: a 2-byte length, then the
message.

Both sides use ``pread``/``pwrite`` on a descriptor, never a mapping: a peer that truncates or
scribbles over the file gives short reads, "full" or a refused outbox, never a fault in our
process. The writer writes a record, then the written count; the reader reads the count, then
the records below it, then writes its read count. Each is a system call on one page cache page,
so each side sees the other's writes in the order they were made.

The prefill side treats every byte as hostile: a written count behind its read count or more
than ``SLOTS`` ahead, or a record longer than a record can be, closes the outbox for good
(:class:`OutboxCorrupt`; the decode rank's later messages then fill the ring and go through
NIXL). The messages themselves go where NIXL notifications go, attributed to the NIXL agent
the outbox was announced for: the request table parses and checks them the same way.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from typing import Any

from fkv.connector.transport._board import open_announced, remove_at_exit
from fkv.errors import FkvError

__all__ = ["RECORD_BYTES", "SLOTS", "Outbox", "OutboxCorrupt", "OutboxReader", "outbox_wanted"]

#: Records in the ring, and bytes per record (a 2-byte length, then the message).
SLOTS = 256
RECORD_BYTES = 256
_HEADER = 64
_BYTES = _HEADER + SLOTS * RECORD_BYTES
_TOKEN = slice(0, 16)
_WRITTEN, _READ, _CLOSED, _ENDED = 16, 24, 32, 40
_DIR = "/dev/shm"
_NAME = re.compile(r"fkv-outbox-[0-9a-f]{32}")
#: Longest message a record holds.
MAX_MESSAGE = RECORD_BYTES - 2


def outbox_wanted() -> bool:
    """Whether this process offers outboxes (``FKV_OUTBOX=0`` turns them off: every notification
    goes through NIXL)."""
    return os.environ.get("FKV_OUTBOX", "1") != "0"


class OutboxCorrupt(FkvError):
    """The peer's outbox holds what no fkv writer writes; the reader stops reading it."""


class Outbox:
    """The decode rank's outbox to one prefill rank (created in ``/dev/shm``, readable by this
    user only, its name removed once the prefill rank answered the Hello that announced it).
    Call from one thread at a time (the client's lock)."""

    def __init__(self) -> None:
        self.token = os.urandom(16)
        self.name = f"fkv-outbox-{os.urandom(16).hex()}"
        self.path = os.path.join(_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.ftruncate(fd, _BYTES)
            os.pwrite(fd, self.token, 0)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd: int | None = fd
        self._remove = remove_at_exit(self, self.path)  # a process that never closes it
        self._written = 0
        self.sent = 0  # messages that went through the outbox (tests, the bench)

    def put(self, message: bytes) -> bool:
        """Write ``message`` as the next record; False (nothing written) when it is longer than
        :data:`MAX_MESSAGE`, the reader closed the outbox, the ring is full (the reader is
        behind or gone) or the file misbehaves: then send it some other way."""
        fd = self._fd
        if fd is None or len(message) > MAX_MESSAGE:
            return False
        try:
            raw = os.pread(fd, 16, _READ)
            if len(raw) != 16 or raw[8:] != bytes(8):
                return False
            read = int.from_bytes(raw[:8], "little")
            if not 0 <= self._written - read < SLOTS:
                return False
            record = len(message).to_bytes(2, "little") + message
            if os.pwrite(fd, record, _HEADER + (self._written % SLOTS) * RECORD_BYTES) \
                    != len(record):
                return False
            if os.pwrite(fd, (self._written + 1).to_bytes(8, "little"), _WRITTEN) != 8:
                return False
        except OSError:
            return False
        self._written += 1
        self.sent += 1
        return True

    def unlink(self) -> None:
        """Remove the file's name (the prefill rank opened it, or never will): both sides keep
        their descriptors, nothing is left behind if either process dies, and nobody else can
        open it any more."""
        self._remove()  # removed already (by hand, or a peer): nothing to do

    def close(self) -> None:
        """Say the outbox ended (its reader drops it), close it, remove its name if still there."""
        if self._fd is None:
            return
        # on failure the reader keeps it until the prefill rank closes or evicts it
        with contextlib.suppress(OSError):
            os.pwrite(self._fd, (1).to_bytes(8, "little"), _ENDED)
        os.close(self._fd)
        self._fd = None
        self.unlink()


class OutboxReader:
    """The prefill rank's side of one decode rank's outbox. ``name`` and ``token`` come from a
    peer's Hello: checked before anything is opened (FkvError naming what is wrong)."""

    def __init__(self, name: Any, token: Any) -> None:
        if not isinstance(token, bytes) or len(token) != 16:
            raise FkvError("outbox token: expected 16 bytes")
        fd = open_announced("outbox", name, _NAME, "fkv-outbox-", os.O_RDWR)
        self.name = name
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != _BYTES \
                    or st.st_uid != os.getuid() or st.st_nlink != 1:
                raise FkvError(f"outbox {name}: expected a regular file of {_BYTES} bytes owned "
                               f"by uid {os.getuid()} with one link (got mode "
                               f"0o{st.st_mode:o}, {st.st_size} bytes, uid {st.st_uid}, "
                               f"{st.st_nlink} links)")
            if os.pread(fd, 16, 0) != token:
                raise FkvError(f"outbox {name}: its token is not the one announced")
            raw = os.pread(fd, 32, _WRITTEN)
            written, read, closed, ended = (int.from_bytes(raw[i:i + 8], "little")
                                            for i in (0, 8, 16, 24))
            if len(raw) != 32 or written != read or written > 1 << 62 or closed or ended:
                raise FkvError(f"outbox {name}: announced with {written} records written, {read} "
                               f"read, the closed flag {closed} and the ended flag {ended} "
                               f"(expected an empty, open ring)")
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._read = read
        self.taken = 0  # messages read (tests, stats)
        #: the writer closed the outbox and everything it wrote was taken: drop it
        self.ended = False
        self._ending = False  # the ended flag was seen once (the next look confirms it)
        #: ``time.monotonic()`` of the opening or the last record taken (the server evicts the
        #: least recently active outbox when it has too many)
        self.active = time.monotonic()

    def take(self) -> list[bytes]:
        """The messages written since the last call (oldest first); [] when there are none or the
        file reads short. OutboxCorrupt (the outbox is closed) when its counts or a record's
        length are impossible."""
        fd = self._fd
        if fd is None:
            return []
        try:
            raw = os.pread(fd, 32, _WRITTEN)
        except OSError:
            return []
        if len(raw) != 32:
            return []
        written = int.from_bytes(raw[:8], "little")
        if raw[24:] != bytes(8):
            # ended: what it wrote before is visible by the next look, which starts after this
            # one; a look that sees the flag again and no new record ends the outbox
            self.ended = self._ending and written == self._read
            self._ending = True
        if written == self._read:
            return []
        if not 0 < written - self._read <= SLOTS:
            self.close()
            raise OutboxCorrupt(f"outbox {self.name}: {written} records written with {self._read} "
                                f"read (expected 1 to {SLOTS} more); it is closed")
        out = []
        for i in range(self._read, written):
            try:
                record = os.pread(fd, RECORD_BYTES, _HEADER + (i % SLOTS) * RECORD_BYTES)
            except OSError:
                record = b""
            if len(record) != RECORD_BYTES:
                break  # truncated under us: what is left is taken next time, or never
            n = int.from_bytes(record[:2], "little")
            if n > MAX_MESSAGE:
                self.close()
                raise OutboxCorrupt(f"outbox {self.name}: record {i} is {n} bytes long (at most "
                                    f"{MAX_MESSAGE}); it is closed")
            out.append(bytes(record[2:2 + n]))
        if out:
            self._read += len(out)
            self.taken += len(out)
            self.active = time.monotonic()
            with contextlib.suppress(OSError):  # else the writer sees a full ring: NIXL
                os.pwrite(fd, self._read.to_bytes(8, "little"), _READ)
        return out

    def close(self) -> None:
        """Stop reading, and say so in the file (the writer then uses NIXL)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):  # else the writer finds a full ring instead
                os.pwrite(self._fd, (1).to_bytes(8, "little"), _CLOSED)
            os.close(self._fd)
            self._fd = None
