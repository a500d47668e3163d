"""What the same-host copy experiments share: a child process holding the "prefill cache" they
copy from, the copier's view of it, and anonymous buffers on huge pages or not."""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from fkv.connector.transport._board import Board
from fkv.connector.transport._ipc import host_identity
from fkv.connector.wire import BoardInfo

_HUGE = 2 << 20


def anonymous(size: int, huge: bool) -> tuple[mmap.mmap, np.ndarray]:
    """``size`` bytes of private anonymous memory starting on a 2 MiB boundary, marked
    ``MADV_HUGEPAGE`` (``huge``) or ``MADV_NOHUGEPAGE`` before the first touch, then filled with
    ones. Keep the mmap until the array is dropped."""
    m = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    arr = np.frombuffer(m, dtype=np.uint8)
    skip = (-arr.ctypes.data) % _HUGE
    arr = arr[skip:skip + size]
    arr[:] = 1
    return m, arr


@contextlib.contextmanager
def holder(target: Callable[..., None], *args: Any, size: int
           ) -> Iterator[tuple[Any, Any, tuple[Any, ...]]]:
    """Start ``target(conn, *args)`` in a child process; it first sends ``(pid, base, ...)``
    (its buffer of ``size`` bytes at ``base``) and stops when it receives None. Yields ``(conn,
    peer, hello)``: ``peer`` is what ``SameHostCopy`` takes for that process (a publish board
    of this process names its pid), ``hello`` the child's first message."""
    a, b = mp.Pipe()
    child = mp.Process(target=target, args=(b, *args))
    child.start()
    hello = a.recv()
    board = Board()
    board.vouch_for(hello[0], ((hello[1], size),))
    peer = types.SimpleNamespace(board=BoardInfo(host=host_identity(), name=board.name,
                                                 salt=board.salt, pid=hello[0]),
                                 regions=((hello[1], size),))
    try:
        yield a, peer, hello
    finally:
        board.close()
        a.send(None)
        child.join()
