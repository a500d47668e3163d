"""Same-host copies of CPU DRAM rows (``fkv.connector.transport._cma``): a real second process
holds the "prefill" memory; every check on it, the copy's bytes, and the failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
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
        local, copier = _copier(h, threads)
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


def test_thread_counts_from_one_to_sixty_four_are_taken(monkeypatch: Any) -> None:
    from fkv.connector.transport._cma import copy_threads

    for raw, want in (("1", 1), ("64", 64), (" 7 ", 7)):
        monkeypatch.setenv("FKV_CMA_THREADS", raw)
        assert copy_threads() == want


def test_only_fkv_cma_zero_turns_the_copies_off(monkeypatch: Any) -> None:
    from fkv.connector.transport._cma import cma_wanted

    monkeypatch.delenv("FKV_CMA", raising=False)
    assert cma_wanted() is True
    for raw, want in (("1", True), ("yes", True), ("2", True), ("", True), ("0", False)):
        monkeypatch.setenv("FKV_CMA", raw)
        assert cma_wanted() is want


def test_refusals_name_the_first_reason_in_order(holder: Holder, monkeypatch: Any) -> None:
    """FKV_CMA first, then the decode side's memory, then the prefill side's."""
    peer = holder.peer()
    assert cma_refusal(peer, 4, "VRAM", "VRAM") == "the decode caches are not in CPU DRAM"
    monkeypatch.setenv("FKV_CMA", "0")
    assert cma_refusal(peer, 4, "VRAM", "VRAM") == "FKV_CMA=0"


def test_each_errno_of_a_failed_call_is_named() -> None:
    import errno

    from fkv.connector.transport._cma import _why

    assert _why(errno.EPERM, 42) == (
        "the kernel refused to let this process read process 42's memory (EPERM: Yama's "
        "/proc/sys/kernel/yama/ptrace_scope above 0, or a container without CAP_SYS_PTRACE)")
    assert _why(errno.ESRCH, 42) == "process 42 is gone (ESRCH)"
    assert _why(errno.EFAULT, 42) == "an announced region is not mapped in process 42 (EFAULT)"
    assert _why(errno.ENOSYS, 42) == "process_vm_readv is not available on this kernel (ENOSYS)"
    assert _why(errno.EINVAL, 42) == "process_vm_readv failed (EINVAL)"
    assert _why(99999, 42) == "process_vm_readv failed (99999)"


def test_describe_names_every_rank_and_its_pid(holder: Holder) -> None:
    mine = np.zeros(holder.size, dtype=np.uint8)
    copier = SameHostCopy([(mine.ctypes.data, mine.size)], None,
                          {0: holder.peer(), 2: holder.peer()}, "p")
    try:
        assert copier.describe() == ("copied with process_vm_readv from the prefill processes "
                                     f"(P0 pid {holder.pid}, P2 pid {holder.pid})")
    finally:
        copier.close()


def test_without_a_staging_buffer_a_staging_row_is_refused(holder: Holder) -> None:
    local, copier = _copier(holder)
    try:
        with pytest.raises(FkvError) as e:
            copier.vectors(0, _rows([(0, 0, -1, 0, 1)]))
        assert str(e.value) == "a plan row leaves its local region; nothing was copied"
    finally:
        copier.close()


def test_read_points_land_in_order_across_several_calls() -> None:
    """1100 points of 8 bytes (two calls of up to 1024), read from this process in reverse:
    each lands 8 bytes after the one before it in the scratch buffer."""
    from fkv.connector.transport._cma import _read_points

    n = 1100
    src = (np.arange(8 * n) % 253).astype(np.uint8)
    points = np.array([(src.ctypes.data + 8 * (n - 1 - i), 8) for i in range(n)],
                      dtype=np.uint64)
    scratch = np.zeros(8 * n, dtype=np.uint8)
    assert _read_points(os.getpid(), points, scratch) == 0
    assert np.array_equal(scratch.reshape(n, 8), src.reshape(n, 8)[::-1])


def _regions_peer(h: Holder, regions: tuple[tuple[int, int], ...]) -> Any:
    """A peer announcing ``regions`` of the holder's process, vouched for by its board."""
    peer = types.SimpleNamespace(board=h.peer().board, regions=regions)
    h.board.vouch_for(h.pid, regions)
    return peer


def test_the_probe_reads_both_ends_of_each_region_and_nothing_past_them() -> None:
    """Region 1's middle page is unmapped: a region ending one byte into it is refused (its
    last bytes are read), one ending right before it or of 4 bytes just before it is not."""
    h = Holder("hole")
    try:
        mine = np.zeros(h.size, dtype=np.uint8)
        local = [(mine.ctypes.data, mine.size)]
        hole = h.bases[1] + h.size // 2
        for regions in (((h.bases[1], h.size // 2),), ((hole - 4, 4),), ((hole - 8, 8),)):
            SameHostCopy(local, None, {0: _regions_peer(h, regions)}, "p").close()
        for regions in (((h.bases[1], h.size // 2 + 1),), ((hole - 4, 5),),
                        ((h.bases[0], h.size), (hole - 7 * PAGE, 7 * PAGE + 1))):
            with pytest.raises(FkvError) as e:
                SameHostCopy(local, None, {3: _regions_peer(h, regions)}, "p")
            assert str(e.value) == (f"cannot copy from prefill rank 3's process {h.pid}: an "
                                    f"announced region is not mapped in process {h.pid} "
                                    f"(EFAULT)")
    finally:
        h.close()


def test_a_process_that_exited_unreaped_is_refused() -> None:
    """A zombie still has its /proc entry and its owner: the pidfd says it exited."""
    h = Holder()
    zombie = subprocess.Popen(["true"])
    try:
        while True:
            with open(f"/proc/{zombie.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.001)
        mine = np.zeros(h.size, dtype=np.uint8)
        with pytest.raises(FkvError) as e:
            SameHostCopy([(mine.ctypes.data, mine.size)], None, {1: h.peer(pid=zombie.pid)}, "p")
        assert str(e.value) == f"prefill rank 1's process {zombie.pid} exited while it was checked"
    finally:
        zombie.wait()
        h.close()


def test_without_pidfds_an_exit_is_seen_through_the_pid(holder: Holder,
                                                         monkeypatch: Any) -> None:
    def no_pidfd(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    local, copier = _copier(holder)
    try:
        assert copier.sources[0].pidfd == -1
        assert not copier.sources[0].exited()
        lv, rv, nbytes = copier.vectors(0, _rows([(0, 0, 0, 0, PAGE)]))
        copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert np.array_equal(local[0, :PAGE], _pattern(0, PAGE))
        holder.close()
        assert copier.sources[0].exited()
        with pytest.raises(TransferFailed, match=rf"prefill rank 0 of engine 'p' \(pid "
                                                 rf"{holder.pid}\) exited: "):
            copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
    finally:
        copier.close()


def _fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def test_a_refused_process_leaves_no_descriptor_open(holder: Holder, monkeypatch: Any) -> None:
    """The refused source's pidfd and board, and every source made before it, are closed."""
    from fkv.connector.transport._board import BoardView

    mine = np.zeros(holder.size, dtype=np.uint8)
    regions = [(mine.ctypes.data, mine.size)]
    good = holder.peer()
    bad = types.SimpleNamespace(board=good.board,
                                regions=((holder.bases[0], holder.size), (4096, holder.size)))
    before = _fds()
    with pytest.raises(FkvError, match="not vouch"):
        SameHostCopy(regions, None, {0: good, 1: bad}, "p")
    assert _fds() == before
    real = os.getuid()
    monkeypatch.setattr(BoardView, "owner", lambda self: real + 7)
    with pytest.raises(FkvError, match=f"belongs to uid {real + 7}"):
        SameHostCopy(regions, None, {0: good}, "p")
    assert _fds() == before


def test_closing_a_copier_closes_each_source_once(holder: Holder) -> None:
    before = _fds()
    local, copier = _copier(holder)
    src = copier.sources[0]
    assert src.pidfd >= 0 and src.board is not None and _fds() != before
    copier.close()
    assert copier.sources == {} and src.pidfd == -1 and src.board is None
    assert _fds() == before
    src.close()
    copier.close()
    assert _fds() == before


def test_a_call_that_fails_with_an_errno_names_it() -> None:
    """A row starting in region 1's unmapped page: the call reads nothing and says EFAULT."""
    h = Holder("hole")
    try:
        local, copier = _copier(h)
        lv, rv, nbytes = copier.vectors(0, _rows([(1, 8 * PAGE, 1, 0, PAGE)]))
        with pytest.raises(TransferFailed) as e:
            copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert str(e.value) == (
            f"copy from prefill rank 0 of engine 'p' (pid {h.pid}) failed: an announced region "
            f"is not mapped in process {h.pid} (EFAULT): the prefill process may have died: "
            f"reconnect once it is back (client.reconnect())")
        assert not local.any()
        copier.close()
    finally:
        h.close()


def test_the_timeout_is_checked_between_calls_only(holder: Holder) -> None:
    """A deadline already past: a copy of one call still lands; one of 1500 rows makes its
    first call (1024 rows land) and fails before the second."""
    local, copier = _copier(holder)
    try:
        per = holder.size // 32
        lv, rv, nbytes = copier.vectors(0, _rows([(0, i * 32, 0, i * 32, 32)
                                                  for i in range(IOV_MAX)]))
        copier.copy(0, lv, rv, nbytes, deadline=0.0)
        assert np.array_equal(local[0, :IOV_MAX * 32], _pattern(0, IOV_MAX * 32))
        local[:] = 0
        lv, rv, nbytes = copier.vectors(0, _rows([(i // per, i % per * 32, i // per,
                                                   i % per * 32, 32) for i in range(1500)]))
        with pytest.raises(TransferFailed) as e:
            copier.copy(0, lv, rv, nbytes, deadline=0.0)
        assert str(e.value) == (
            f"copy from prefill rank 0 of engine 'p' (pid {holder.pid}) failed: it did not "
            f"finish before the read's timeout: the prefill process may have died: reconnect "
            f"once it is back (client.reconnect())")
        flat = local.ravel()
        assert np.array_equal(flat[:IOV_MAX * 32], _pattern(0, IOV_MAX * 32))
        assert not flat[IOV_MAX * 32:].any()
    finally:
        copier.close()


def test_prime_skips_empty_copies_unknown_ranks_and_takes_the_cap_and_budget_inclusive(
        holder: Holder, monkeypatch: Any) -> None:
    from fkv.connector.transport import _cma

    local, copier = _copier(holder)
    try:
        empty = np.empty((0, 2), dtype=np.uint64)
        assert not copier.prime(0, empty, empty, 0)
        lv, rv, nbytes = copier.vectors(0, _rows([(0, 0, 0, 0, 3 * PAGE)]))
        assert not copier.prime(7, lv, rv, nbytes)
        assert copier.primed == 0
        monkeypatch.setattr(_cma, "_PRIME_BYTES", nbytes)
        assert copier.prime(0, lv, rv, nbytes) and copier.primed == 1
        copier._prime_rate = 0.5  # noqa: SLF001
        assert copier.prime(0, lv, rv, nbytes, budget=nbytes * 0.5) and copier.primed == 2
        copier._prime_rate = 0.5  # noqa: SLF001
        assert not copier.prime(0, lv, rv, nbytes, budget=nbytes * 0.5 - 1)
        assert copier.primed == 2 and not local.any()
    finally:
        copier.close()


def _record_runs(monkeypatch: Any) -> list[tuple[int, int]]:
    """Record (rows, bytes) of every ``_copy_rows`` call (each thread's run), then copy."""
    from fkv.connector.transport import _cma

    runs: list[tuple[int, int]] = []
    real = _cma._copy_rows  # noqa: SLF001

    def record(pid: int, local: np.ndarray, remote: np.ndarray, nbytes: int,
               deadline: float) -> str:
        runs.append((local.shape[0], nbytes))
        return real(pid, local, remote, nbytes, deadline)

    monkeypatch.setattr(_cma, "_copy_rows", record)
    return runs


@pytest.mark.parametrize(("threads", "nrows", "want"), [
    (4, 128, [(32, 2 << 20)] * 4),           # 8 MiB: four runs of 2 MiB
    (2, 128, [(64, 4 << 20)] * 2),           # 8 MiB, two threads
    (4, 64, [(32, 2 << 20)] * 2),            # exactly 4 MiB: split in two (2 MiB each at least)
    (4, 63, [(63, 63 << 16)]),               # under 4 MiB: one run in this thread
    (4, 1, [(1, 4 << 20)]),                  # one row: nothing to split
])
def test_a_copy_is_split_into_runs_of_at_least_two_mib(threads: int, nrows: int,
                                                        want: list[tuple[int, int]],
                                                        monkeypatch: Any) -> None:
    h = Holder(size="big")
    try:
        local, copier = _copier(h, threads)
        row = h.size if nrows == 1 else 64 << 10
        per = h.size // row
        rows = _rows([(i // per, i % per * row, i // per, i % per * row, row)
                      for i in range(nrows)])
        lv, rv, nbytes = copier.vectors(0, rows)
        runs = _record_runs(monkeypatch)
        copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert sorted(runs) == sorted(want)
        assert (copier._pool is None) == (len(want) == 1)  # noqa: SLF001
        ref = np.concatenate([_pattern(0, h.size), _pattern(1, h.size)])
        assert np.array_equal(local.ravel()[:nbytes], ref[:nbytes])
        assert not local.ravel()[nbytes:].any()
        copier.close()
    finally:
        h.close()


def test_split_copies_share_one_pool_that_close_shuts_down() -> None:
    h = Holder(size="big")
    try:
        local, copier = _copier(h, 2)
        lv, rv, nbytes = copier.vectors(0, _rows([(r, 0, r, 0, h.size) for r in range(2)]))
        copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        pool = copier._pool  # noqa: SLF001
        copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert copier._pool is pool  # noqa: SLF001
        copier.close()
        with pytest.raises(RuntimeError, match="shutdown"):
            pool.submit(int)
    finally:
        h.close()


@pytest.mark.parametrize("regions", [(0, 1), (1, 0)], ids=["pool's run short", "own run short"])
def test_a_split_copy_with_a_short_run_fails_the_read(regions: tuple[int, int]) -> None:
    """Region 1 holds the hole: the run that crosses it (the pool's, or the one this thread
    copies itself, the first) fails the read, naming the bytes read; the other run lands."""
    h = Holder("hole", size="big")
    try:
        local, copier = _copier(h, 4)
        lv, rv, nbytes = copier.vectors(0, _rows([(r, 0, r, 0, h.size) for r in regions]))
        with pytest.raises(TransferFailed) as e:
            copier.copy(0, lv, rv, nbytes, deadline=float("inf"))
        assert str(e.value) == (
            f"copy from prefill rank 0 of engine 'p' (pid {h.pid}) failed: it read "
            f"{h.size // 2} of {h.size} bytes: the prefill process may have died: reconnect "
            f"once it is back (client.reconnect())")
        assert np.array_equal(local[0], _pattern(0, h.size))
        copier.close()
    finally:
        h.close()


@pytest.mark.parametrize("local", [True, False])
def test_a_row_whose_end_overflows_int64_is_refused(local: bool) -> None:
    """Offset and length each inside int64, their sum not: the row still leaves its region."""
    bases = np.array([0x10000, 0x90000], dtype=np.uint64)
    sizes = np.array([0x1000, 0x1000], dtype=np.int64)
    for offset, length in ((0x800, (1 << 63) - 1), (1 << 62, 1 << 62)):
        rows = np.array([(0, 0, offset, 0, offset, length)], dtype=np.int64)
        with pytest.raises(FkvError) as e:
            iovecs(rows, bases, sizes, local=local)
        side = "local" if local else "remote"
        assert str(e.value) == f"a plan row leaves its {side} region; nothing was copied"
