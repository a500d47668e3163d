"""Same-host copies of CPU DRAM rows (``fkv.connector.transport._cma``): a real second process
holds the "prefill" memory; every check on it, the copy's bytes, and the failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fkv.connector.transport._base import TransferFailed
from fkv.connector.transport._board import Board
from fkv.connector.transport._cma import IOV_MAX, SameHostCopy, cma_refusal, iovecs
from fkv.connector.transport._ipc import host_identity
from fkv.connector.wire import BoardInfo
from fkv.errors import FkvError

PAGE = 4096
# A process holding 2 regions of 16 pages, or 1024 with "big" (byte i of region r is
# (7 * i + r) % 251); with "hole", the middle page of region 1 is unmapped afterwards (its ends
# stay readable).
HOLDER = textwrap.dedent("""
    import ctypes, json, mmap, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = (1024 if sys.argv[2] == "big" else 16) * 4096
    maps, out = [], []
    for r in range(2):
        m = mmap.mmap(-1, size)
        period = bytes((7 * i + r) % 251 for i in range(251))
        m[:] = (period * (size // 251 + 1))[:size]
        maps.append(m)
        out.append(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    if sys.argv[1] == "hole":
        assert libc.munmap(out[1] + size // 2, 4096) == 0
    print(json.dumps({"pid": __import__("os").getpid(), "bases": out, "size": size}), flush=True)
    sys.stdin.read()
""")


def _pattern(region: int, size: int) -> np.ndarray:
    return ((7 * np.arange(size) + region) % 251).astype(np.uint8)


class Holder:
    def __init__(self, mode: str = "plain", size: str = "small") -> None:
        self.board = Board()  # the "server's" publish board (this process writes it)
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, mode, size], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        info = json.loads(self.proc.stdout.readline())
        self.pid, self.bases, self.size = info["pid"], info["bases"], info["size"]

    def peer(self, pid: int | None = None, bases: list[int] | None = None,
             vouched: bool = True) -> Any:
        """What a server announces for the holder's process (``pid``, ``bases``: something
        else); the board vouches for it unless ``vouched`` is False (metadata relayed under
        another pid or other addresses)."""
        board = BoardInfo(host=host_identity(), name=self.board.name, salt=self.board.salt,
                          pid=self.pid if pid is None else pid)
        regions = tuple((b, self.size) for b in (self.bases if bases is None else bases))
        self.board.vouch_for(board.pid if vouched else self.pid,
                             regions if vouched else tuple((b, self.size) for b in self.bases))
        return types.SimpleNamespace(board=board, regions=regions)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)
        self.proc.stdout.close()
        self.board.close()


@pytest.fixture
def holder() -> Any:
    h = Holder()
    yield h
    h.close()


def _copier(h: Holder, threads: int = 1) -> tuple[np.ndarray, SameHostCopy]:
    """Two zeroed local regions of the holder's size, and a copier from its process into them."""
    local = np.zeros((2, h.size), dtype=np.uint8)
    return local, SameHostCopy([(local[i].ctypes.data, h.size) for i in range(2)], None,
                               {0: h.peer()}, "p", threads)


def _rows(spec: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    """Plan rows (remote rank 0): (remote region, remote offset, local region, local offset,
    length)."""
    return np.array([(0, *r) for r in spec], dtype=np.int64)


def test_rows_become_iovecs_and_rows_outside_a_region_are_refused() -> None:
    bases = np.array([0x10000, 0x90000, 0x200000], dtype=np.uint64)  # two regions, staging
    sizes = np.array([0x1000, 0x1000, 0x800], dtype=np.int64)
    rows = _rows([(1, 0x40, 0, 0x100, 0x20), (0, 0, -1, 0x7E0, 0x20), (1, 0xFE0, 1, 0, 0x20)])
    assert iovecs(rows, bases, sizes, local=True).tolist() == [
        [0x10100, 0x20], [0x2007E0, 0x20], [0x90000, 0x20]]
    assert iovecs(rows, bases[:2], sizes[:2], local=False).tolist() == [
        [0x90040, 0x20], [0x10000, 0x20], [0x90FE0, 0x20]]
    for bad, local, what in [
        ([(0, 0, 0, 0xFF0, 0x20)], True, "leaves its local region"),
        ([(0, 0, -1, 0x7F0, 0x20)], True, "leaves its local region"),   # past the staging end
        ([(0, 0, 2, 0, 0x20)], True, "local region outside 0..1"),      # the staging slot
        ([(0, 0, -2, 0, 0x20)], True, "local region outside 0..1"),
        ([(0, -0x20, 0, 0, 0x20)], False, "leaves its remote region"),
        ([(2, 0, 0, 0, 0x20)], False, "remote region outside 0..1"),
        ([(-1, 0, 0, 0, 0x20)], False, "remote region outside 0..1"),
        ([(0, 0, 0, 0, 0)], True, "leaves its local region"),           # empty rows are bugs
    ]:
        with pytest.raises(FkvError, match=what):
            iovecs(_rows(bad), bases if local else bases[:2], sizes if local else sizes[:2],
                   local=local)
    # no staging buffer: its slot has size 0, so a staging row is refused
    with pytest.raises(FkvError, match="leaves its local region"):
        iovecs(_rows([(0, 0, -1, 0, 0x20)]), np.array([0x10000, 0], dtype=np.uint64),
               np.array([0x1000, 0], dtype=np.int64), local=True)


def test_copies_the_rows_bit_for_bit_in_one_call_or_many(holder: Holder) -> None:
    local = np.zeros((2, holder.size), dtype=np.uint8)
    staging = np.zeros(2 * PAGE, dtype=np.uint8)
    copier = SameHostCopy([(local[i].ctypes.data, holder.size) for i in range(2)],
                          (staging.ctypes.data, staging.size), {0: holder.peer()}, "p")
    try:
        rng = np.random.default_rng(0)
        # 1500 rows of 32 B (two system calls of 1024 and 476), scattered both ways
        n = 1500
        src = rng.permutation(holder.size // 32 * 2)[:n]
        dst = rng.permutation(holder.size // 32 * 2)[:n]
        rows = _rows([(s // (holder.size // 32), s % (holder.size // 32) * 32,
                       d // (holder.size // 32), d % (holder.size // 32) * 32, 32)
                      for s, d in zip(src.tolist(), dst.tolist(), strict=True)]
                     + [(1, 100, -1, 7, 333)])  # an odd row into the staging buffer
        lv, rv, nbytes = copier.vectors(0, rows)
        assert lv.shape == (n + 1, 2) and nbytes == n * 32 + 333 and n + 1 > IOV_MAX
        copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        want = np.zeros_like(local)
        ref = [_pattern(0, holder.size), _pattern(1, holder.size)]
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            rr, ro = divmod(s, holder.size // 32)
            lr, lo = divmod(d, holder.size // 32)
            want[lr, lo * 32:lo * 32 + 32] = ref[rr][ro * 32:ro * 32 + 32]
        assert np.array_equal(local, want)
        assert np.array_equal(staging[7:340], ref[1][100:433])
        assert not staging[:7].any() and not staging[340:].any()
        assert "process_vm_readv" in copier.describe() and f"pid {holder.pid}" in \
            copier.describe()
    finally:
        copier.close()


def test_refusals_before_any_process_is_asked(holder: Holder, monkeypatch: Any) -> None:
    peer = holder.peer()
    assert cma_refusal(peer, 0, "DRAM", "DRAM") == ""
    assert cma_refusal(peer, 1, "VRAM", "DRAM") == "the decode caches are not in CPU DRAM"
    assert cma_refusal(peer, 1, "DRAM", "VRAM") == "prefill rank 1's caches are not in CPU DRAM"
    elsewhere = types.SimpleNamespace(board=BoardInfo(host="other/boot/1", name=peer.board.name,
                                                      salt=bytes(16), pid=holder.pid),
                                      regions=peer.regions)
    assert cma_refusal(elsewhere, 2, "DRAM", "DRAM") == \
        "prefill rank 2 runs on another host ('other/boot/1')"
    assert cma_refusal(holder.peer(pid=0), 0, "DRAM", "DRAM") == \
        "prefill rank 0 announced no process id"
    assert cma_refusal(types.SimpleNamespace(board=None), 3, "DRAM", "DRAM") == \
        "prefill rank 3 announced no publish board (no host identity)"
    monkeypatch.setenv("FKV_CMA", "0")
    assert cma_refusal(peer, 0, "DRAM", "DRAM") == "FKV_CMA=0"


def test_a_process_that_cannot_be_copied_from_is_refused_naming_why(holder: Holder,
                                                                    monkeypatch: Any) -> None:
    mine = np.zeros(holder.size, dtype=np.uint8)
    regions = [(mine.ctypes.data, mine.size)] * 2
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    with pytest.raises(FkvError, match=rf"prefill rank 0's process {dead_pid} does not exist "
                                       rf"on this host \(no /proc/{dead_pid}\)"):
        SameHostCopy(regions, None, {0: holder.peer(pid=dead_pid)}, "p")
    # a region the process does not map (its ends are read when the connection is checked)
    with pytest.raises(FkvError, match=rf"cannot copy from prefill rank 1's process "
                                       rf"{holder.pid}: an announced region is not mapped in "
                                       rf"process {holder.pid} \(EFAULT\)"):
        SameHostCopy(regions, None, {1: holder.peer(bases=[holder.bases[0], 4096])}, "p")
    # a board this process cannot open (another host's name, or removed)
    nowhere = types.SimpleNamespace(board=BoardInfo(host=host_identity(),
                                                    name="fkv-board-" + "0" * 32,
                                                    salt=bytes(16), pid=holder.pid),
                                    regions=holder.peer().regions)
    with pytest.raises(FkvError, match=rf"prefill rank 0's publish board fkv-board-0{{32}} "
                                       rf"cannot be opened here \(its stop could not be seen\)"):
        SameHostCopy(regions, None, {0: nowhere}, "p")
    # an honest server's board relayed with another process of this user, or other addresses
    for pid, bases in ((os.getpid(), None), (None, holder.bases[::-1])):
        relayed = holder.peer(pid=pid, bases=bases, vouched=False)
        with pytest.raises(FkvError) as e:
            SameHostCopy(regions, None, {0: relayed}, "p")
        assert str(e.value) == (
            f"prefill rank 0's publish board {holder.board.name} does not vouch for process "
            f"{relayed.board.pid} and the 2 region(s) announced with it: its server announced "
            f"others (metadata relayed with another pid or other addresses)")
    real = os.getuid()
    from fkv.connector.transport._board import BoardView

    with monkeypatch.context() as m:  # a board another user created
        m.setattr(BoardView, "owner", lambda self: real + 7)
        with pytest.raises(FkvError, match=rf"prefill rank 0's publish board {holder.board.name} "
                                           rf"belongs to uid {real + 7}, not to this process's "
                                           rf"uid {real}"):
            SameHostCopy(regions, None, {0: holder.peer()}, "p")
    monkeypatch.setattr(os, "getuid", lambda: real + 1)
    with pytest.raises(FkvError, match=rf"process {holder.pid} belongs to uid {real}, not to "
                                       rf"this process's uid {real + 1}"):
        SameHostCopy(regions, None, {0: holder.peer()}, "p")


def test_a_short_copy_fails_the_read() -> None:
    """Region 1's ends pass the check, its middle page is gone: a row across it fails."""
    h = Holder("hole")
    try:
        local, copier = _copier(h)
        rows = _rows([(0, 0, 0, 0, 64), (1, 7 * PAGE, 1, 0, 3 * PAGE)])
        lv, rv, nbytes = copier.vectors(0, rows)
        with pytest.raises(TransferFailed, match=rf"copy from prefill rank 0 of engine 'p' "
                                                 rf"\(pid {h.pid}\) failed: it read "
                                                 rf"{64 + PAGE} of {64 + 3 * PAGE} bytes"):
            copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        copier.close()
    finally:
        h.close()


def test_a_prefill_process_that_exited_fails_the_copy(holder: Holder) -> None:
    local, copier = _copier(holder)
    try:
        lv, rv, nbytes = copier.vectors(0, _rows([(0, 0, 0, 0, PAGE)]))
        copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert np.array_equal(local[0, :PAGE], _pattern(0, PAGE))
        assert not copier.sources[0].exited()
        holder.close()  # exits, and is reaped: the pid names nobody now
        assert copier.sources[0].exited()  # its pidfd says so, whoever gets the pid next
        local[:] = 0
        with pytest.raises(TransferFailed, match=rf"prefill rank 0 of engine 'p' \(pid "
                                                 rf"{holder.pid}\) exited: its bytes are not "
                                                 rf"trusted; reconnect once it is back"):
            copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert not local.any()
    finally:
        copier.close()


def test_a_copy_that_ends_after_the_server_stopped_fails(holder: Holder) -> None:
    local, copier = _copier(holder)
    try:
        lv, rv, nbytes = copier.vectors(0, _rows([(1, 0, 1, 0, PAGE)]))
        copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert np.array_equal(local[1, :PAGE], _pattern(1, PAGE))
        holder.board.stop()
        with pytest.raises(TransferFailed, match=rf"prefill rank 0 of engine 'p' \(pid "
                                                 rf"{holder.pid}\) stopped serving \(its "
                                                 rf"publish board says so\)"):
            copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
    finally:
        copier.close()


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_a_large_copy_is_split_between_threads_and_lands_every_byte(threads: int) -> None:
    """8 MiB of 64 KiB rows, reversed and crossed between the regions: copied by one thread,
    or split into runs of about equal bytes copied by this thread and the pool's."""
    h = Holder(size="big")
    try:
        local = np.zeros((2, h.size), dtype=np.uint8)
        copier = SameHostCopy([(local[i].ctypes.data, h.size) for i in range(2)], None,
                              {0: h.peer()}, "p", threads)
        row = 64 << 10
        per = h.size // row
        rows = _rows([(i // per, i % per * row, 1 - i // per, (per - 1 - i % per) * row, row)
                      for i in range(2 * per)])
        lv, rv, nbytes = copier.vectors(0, rows)
        assert nbytes == 8 << 20
        copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        for r in range(2):
            want = _pattern(r, h.size).reshape(per, row)[::-1].ravel()
            assert np.array_equal(local[1 - r], want)
        assert (copier._pool is None) == (threads == 1)
        if threads > 1:
            assert copier._pool._max_workers == threads - 1
        copier.close()
        assert copier._pool is None
    finally:
        h.close()


def test_a_split_copy_with_a_short_run_fails_the_read() -> None:
    h = Holder("hole", size="big")
    try:
        local = np.zeros((2, h.size), dtype=np.uint8)
        copier = SameHostCopy([(local[i].ctypes.data, h.size) for i in range(2)], None,
                              {0: h.peer()}, "p", threads=4)
        rows = _rows([(r, 0, r, 0, h.size) for r in range(2)])  # region 1 holds the hole
        lv, rv, nbytes = copier.vectors(0, rows)
        with pytest.raises(TransferFailed, match=rf"copy from prefill rank 0 of engine 'p' "
                                                 rf"\(pid {h.pid}\) failed: it read "
                                                 rf"{h.size // 2} of {h.size} bytes"):
            copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert np.array_equal(local[0], _pattern(0, h.size))  # the other run landed
        copier.close()
    finally:
        h.close()


@pytest.mark.parametrize("raw", ["0", "65", "four", ""])
def test_a_bad_thread_count_is_refused_naming_the_variable(raw: str, monkeypatch: Any) -> None:
    from fkv.connector.transport._cma import copy_threads

    monkeypatch.setenv("FKV_CMA_THREADS", raw)
    with pytest.raises(FkvError, match=rf"FKV_CMA_THREADS={raw!r}: expected an integer from 1 "
                                       rf"to 64"):
        copy_threads()
    monkeypatch.setenv("FKV_CMA_THREADS", "2")
    assert copy_threads() == 2
    monkeypatch.delenv("FKV_CMA_THREADS")
    assert copy_threads() == 4


def test_regions_smaller_than_the_probe_are_probed_whole() -> None:
    """A spec whose region holds fewer than 8 bytes: the connection check reads what there is
    (no negative offset, no error of another type)."""
    h = Holder()
    try:
        local = np.zeros((2, 4), dtype=np.uint8)
        tiny = types.SimpleNamespace(board=h.peer().board,
                                     regions=((h.bases[0], 4), (h.bases[1] + 5, 4)))
        h.board.vouch_for(h.pid, tiny.regions)
        copier = SameHostCopy([(local[i].ctypes.data, 4) for i in range(2)], None, {0: tiny},
                              "p")
        lv, rv, nbytes = copier.vectors(0, _rows([(1, 0, 0, 0, 4)]))
        copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert local[0].tolist() == _pattern(1, 9)[5:].tolist()
        copier.close()
    finally:
        h.close()


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_iovecs_refuse_exactly_the_rows_that_leave_their_region(data: Any) -> None:
    """Whatever the rows: refused when any row names a region that is not there or leaves its
    region (the staging slot -1 on the local side only), else every address is base + offset."""
    n = data.draw(st.integers(1, 4))
    sizes = np.array(data.draw(st.lists(st.integers(0, 4096), min_size=n + 1, max_size=n + 1)),
                     dtype=np.int64)
    bases = np.array([(i + 1) << 20 for i in range(n + 1)], dtype=np.uint64)
    local = data.draw(st.booleans())
    rows = data.draw(st.lists(st.tuples(st.integers(-2, n + 1), st.integers(-64, 4200),
                                        st.integers(-8, 4200)), min_size=1, max_size=8))
    arr = np.array([(0, r, o, r, o, ln) for r, o, ln in rows], dtype=np.int64)
    count = n if local else n + 1  # the local side's last entry is the staging slot (-1)
    ok = all((-1 if local else 0) <= r < count
             and o >= 0 and ln > 0 and o + ln <= sizes[r if r >= 0 else n]
             for r, o, ln in rows)
    if not ok:
        with pytest.raises(FkvError, match="nothing was copied"):
            iovecs(arr, bases, sizes, local=local)
        return
    out = iovecs(arr, bases, sizes, local=local)
    assert out.tolist() == [[int(bases[r if r >= 0 else n]) + o, ln] for r, o, ln in rows]


def test_page_points_touch_each_page_of_a_row_once() -> None:
    from fkv.connector.transport._cma import _PAGE, _page_points

    iov = np.array([(0x10010, 2 * _PAGE), (0x40000, 5), (0x50000, _PAGE + 4)], dtype=np.uint64)
    assert _page_points(iov).tolist() == [
        [0x10010, 8], [0x10010 + _PAGE, 8],    # a row over two pages (not page-aligned)
        [0x40000, 5],                          # a row shorter than a touch: all of it
        [0x50000, 8], [0x50000 + _PAGE, 4]]    # a touch never reads past its row's end


def test_prime_touches_each_page_on_both_sides_and_writes_no_cache_byte(
        holder: Holder, monkeypatch: Any) -> None:
    """What a streamed read does just before a layer is due: every page of the copy is read a
    few bytes, remote and local, into the copier's scratch buffer only; the copy after it lands
    the same bytes. Skipped over the byte cap, or when the last prime's rate says the budget is
    too short."""
    from fkv.connector.transport import _cma

    local = np.full((2, holder.size), 5, dtype=np.uint8)
    copier = SameHostCopy([(local[i].ctypes.data, holder.size) for i in range(2)], None,
                          {0: holder.peer()}, "p")
    try:
        rows = _rows([(1, 3 * PAGE + 16, 0, 0, 2 * PAGE), (0, 100, 1, 7, 40)])
        lv, rv, nbytes = copier.vectors(0, rows)
        assert copier.prime(0, lv, rv, nbytes)
        assert copier.primed == 1 and (local == 5).all()
        ref = [_pattern(0, holder.size), _pattern(1, holder.size)]
        got = copier._scratch[:8 * 6].reshape(6, 8)  # noqa: SLF001
        # remote: region 1 at 3 pages + 16 and one page on, region 0 at 100; then local
        assert got[0].tolist() == ref[1][3 * PAGE + 16:3 * PAGE + 24].tolist()
        assert got[1].tolist() == ref[1][4 * PAGE + 16:4 * PAGE + 24].tolist()
        assert got[2].tolist() == ref[0][100:108].tolist()
        assert (got[3:] == 5).all()
        copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert np.array_equal(local[0, :2 * PAGE], ref[1][3 * PAGE + 16:5 * PAGE + 16])
        assert np.array_equal(local[1, 7:47], ref[0][100:140])
        # the rate of that prime is known now: no time for it, no touch
        assert not copier.prime(0, lv, rv, nbytes, budget=0.0)
        assert copier.prime(0, lv, rv, nbytes, budget=10.0) and copier.primed == 2
        monkeypatch.setattr(_cma, "_PRIME_BYTES", nbytes - 1)
        assert not copier.prime(0, lv, rv, nbytes) and copier.primed == 2
    finally:
        copier.close()


def test_a_prime_over_an_unmapped_page_leaves_the_failure_to_the_copy() -> None:
    h = Holder("hole")
    try:
        local, copier = _copier(h)
        lv, rv, nbytes = copier.vectors(0, _rows([(1, 7 * PAGE, 1, 0, 3 * PAGE)]))
        assert copier.prime(0, lv, rv, nbytes)  # no error: the touch is best effort
        with pytest.raises(TransferFailed, match=r"failed: it read 4096 of 12288 bytes"):
            copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        copier.close()
    finally:
        h.close()
