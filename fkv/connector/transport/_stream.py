"""Streaming requests, decode side: how many layers the prefill ranks have published.

A prefill rank serving a streaming request (``server.hold(..., layers_ready=k)`` then
``server.publish(request_id, n)``) answers :class:`~fkv.connector.transport._side.Status` on its
own side-channel address with the layers readers may read now (on CUDA only after the event of
``publish`` completed). A Status is a long poll: the rank keeps it until it has more than
``after`` layers published (its server thread is woken by ``publish``, or by the thread that waits
for the publish's event), so news reaches the decode rank one side-channel message after it
happened, with no polling interval. :class:`Watch` asks every prefill rank a decode rank reads
(except a same-host rank whose publish board holds the request: the reader sleeps on the board
instead, ``_board``) and returns the smallest answer: a layer is readable once every rank holding
a part of it published it.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

from fkv.connector.transport import _side
from fkv.connector.transport._base import SideChannelError, TransferFailed, process_alive

__all__ = ["Watch"]

_tokens = itertools.count(1)

#: Seconds a long poll asks a prefill rank to wait for news (it answers at once when it has some).
LONG_POLL = 0.25
#: With publish boards (same host): seconds a wait reads the boards without sleeping, then how
#: long each nap on the side channel lasts between reads (a long-poll reply ends a nap at once).
BOARD_SPIN = 0.005
BOARD_NAP = 0.0002
#: When every rank still awaited has a board with a futex (Linux): seconds of reading before the
#: first sleep, and the longest sleep on a board's sequence (a publish ends it at once; the long
#: polls of ranks are looked at between sleeps).
BOARD_SPIN_FUTEX = 0.0005
BOARD_SLEEP = 0.002
#: Spinning ahead of the next publish (boards with a futex): once a request's layers have come
#: at a steady pace, the wait for the next layer sleeps until a lead before the time that pace
#: predicts, then reads the boards without sleeping (yielding the GIL between reads) until the
#: layer comes or as long after the predicted time as the lead. News heard through a futex wake-up
#: came 0.10-0.14 ms after the publish on the H200 host's 16 cores, heard spinning 0.04-0.05 ms
#: (medians; bench/results/raw/stream-tail-ab-16cores-exp-20261203T0513.json,
#: bench/results/raw/stream-tail-ab-paced-16cores-exp-20261203T0530.json; bench/NOTES.md).
#: The lead: this fraction of the pace, within [SPIN_AHEAD_MIN, SPIN_AHEAD_MAX] seconds.
SPIN_AHEAD_FRACTION = 0.1
SPIN_AHEAD_MIN = 0.0002
SPIN_AHEAD_MAX = 0.002
#: Seconds between checks, while a wait sleeps on boards, that the processes the boards' ranks
#: announced are alive: a killed prefill process sets no stopped flag and answers no long poll,
#: so without the check its readers would wait for their read's timeout.
ALIVE_CHECK = 0.01

#: Called between two reads of a spin: lets another thread take the GIL (``time.sleep(0)``
#: would nap for the timer slack, ~50 us on Linux).
_yield = os.sched_yield


def spin_window(last_news: float | None, last_count: int, pace: float | None,
                after: int) -> tuple[float, float] | None:
    """``(start, end)`` (monotonic seconds) of the spin before layer ``after`` is expected, or
    None: no pace known yet. ``last_news``: when the news of ``last_count`` layers came after a
    wait; ``pace``: seconds per layer between such news.

    >>> spin_window(10.0, 4, 0.01, 4)          # layer 4 (the 5th) due at 10.01, lead 1 ms
    (10.009, 10.011)
    >>> spin_window(10.0, 4, 0.03, 4)          # the lead at its 2 ms ceiling
    (10.028, 10.032)
    >>> spin_window(10.0, 4, 0.001, 5)         # two layers on, lead at its 0.2 ms floor
    (10.0018, 10.0022)
    >>> spin_window(None, 0, None, 0) is None
    True
    """
    if last_news is None or pace is None or after < last_count:
        return None
    due = last_news + pace * (after + 1 - last_count)
    lead = min(max(pace * SPIN_AHEAD_FRACTION, SPIN_AHEAD_MIN), SPIN_AHEAD_MAX)
    return round(due - lead, 9), round(due + lead, 9)


class Watch:
    """Status requests to the prefill ranks one decode rank reads (one DEALER socket each)."""

    def __init__(self, zctx: Any, entries: list[Any], ranks: tuple[int, ...], engine_id: str,
                 curve: Any = None, boards: dict[int, Any] | None = None) -> None:
        self.engine_id = engine_id
        self.dealers: dict[int, _side.Dealer] = {}
        #: rank -> the rank's publish board (``_board.BoardView``), for the ranks on this host
        self.boards: dict[int, Any] = dict(boards or {})
        self.board_news = 0   # waits the boards ended (for tests and the bench)
        self.spun_news = 0    # ... of them heard while spinning ahead of a predicted publish
        # the pace of the request's news: when the last news after a wait came, the layer count
        # it brought, seconds per layer between such news (None: not known yet)
        self._last_news: float | None = None
        self._last_count = 0
        self._pace: float | None = None
        # rank -> (token, request, whether the rank was seen holding it then) of its long poll
        self._out: dict[int, tuple[int, str, bool]] = {}
        self._request = ""                            # the request _known counts layers of
        self._known: dict[int, int] = {}              # rank -> layers it said are published
        self._held: set[int] = set()                  # ranks seen holding the request
        try:
            for rank in ranks:
                if not entries[rank].address:
                    raise TransferFailed(f"prefill rank {rank} of engine {engine_id!r} announced "
                                         f"no side-channel address: it cannot serve streaming "
                                         f"requests")
                self.dealers[rank] = _side.Dealer(zctx, entries[rank].address, curve)
        except BaseException:
            self.close()
            raise

    def start(self, request_id: str) -> None:
        """A new read of ``request_id``: forget what the ranks said before (a poll still out is
        collected, not re-sent) and the pace of the last request's layers."""
        self._request, self._known, self._held = request_id, {}, set()
        self._last_news, self._last_count, self._pace = None, 0, None

    def _news(self, waited: bool) -> int:
        """The smallest count the ranks published (news past the awaited layer), its time
        noted: after a wait it dates the publish (within a wake-up) and, against the previous
        such news, gives the pace (the faster of the newest interval and its running mean:
        spinning early costs a little CPU, late a wake-up). News that was there at once says
        nothing about when it was published."""
        least = min(self._known.get(rank, 0) for rank in self.dealers)
        self._paced(least, waited, time.monotonic())
        return least

    def _paced(self, least: int, waited: bool, now: float) -> None:
        if not waited:
            self._last_news = None
            return
        if self._last_news is not None and least > self._last_count:
            pace = (now - self._last_news) / (least - self._last_count)
            self._pace = pace if self._pace is None else min(pace, self._pace * 0.5 + pace * 0.5)
        self._last_news, self._last_count = now, least

    def ask(self, request_id: str, after: int, recorded: bool = False) -> None:
        """Start a long poll on every rank not known to have more than ``after`` layers of
        ``request_id`` published (a rank with a poll still out keeps that one): each answers as
        soon as it has news, so the wait overlaps whatever the caller does next. A rank whose
        board holds the request and can be slept on gets none (its server thread is left alone;
        once the board stops holding it, the next look asks). ``recorded``:
        count layers published (writes enqueued before the rank's publish event), for a reader
        whose stream waits for that event."""
        if request_id != self._request:
            self._request, self._known, self._held = request_id, {}, set()
        try:
            for rank, dealer in self.dealers.items():
                if rank in self._out or self._known.get(rank, -1) > after:
                    continue
                board = self.boards.get(rank)
                if board is not None and board.can_wait and \
                        board.layers(request_id, recorded) is not None:
                    continue  # its board holds the request: the next count written wakes us
                token = next(_tokens)
                dealer.send(_side.Status(token=token, request_id=request_id, after=after,
                                         wait=LONG_POLL, recorded=recorded))
                self._out[rank] = (token, request_id, rank in self._held)
        except SideChannelError as e:
            raise TransferFailed(f"layer status from prefill engine {self.engine_id!r}: {e}") \
                from e

    def beyond(self, request_id: str, after: int, deadline: float,
               recorded: bool = False, wait: bool = True,
               ahead: Callable[[float], Any] | None = None) -> int:
        """Block until every rank published more than ``after`` layers of ``request_id`` (the
        smallest count then), or until ``deadline`` (the smallest count known, maybe
        ``<= after``). Long polls, re-asked when a rank's wait ends without news. ``wait=False``:
        only what is known now (the boards, replies already in; polls are still asked).
        ``ahead``: called once when the wait starts spinning ahead of the predicted publish,
        with the seconds left until it (what the caller may spend getting ready for the
        layer: the boards are read again right after it returns)."""
        if not wait:
            deadline = time.monotonic()
        try:
            if self.boards:
                return self._beyond_boards(request_id, after, deadline, recorded, ahead)
            while True:
                self.ask(request_id, after, recorded)
                for rank in list(self._out):
                    self._collect(rank, deadline if wait else None)
                least = min(self._known.get(rank, 0) for rank in self.dealers)
                if least > after or not wait or time.monotonic() >= deadline:
                    return least
        except SideChannelError as e:
            raise TransferFailed(f"layer status from prefill engine {self.engine_id!r}: {e}") \
                from e

    def _beyond_boards(self, request_id: str, after: int, deadline: float,
                       recorded: bool, ahead: Callable[[float], Any] | None = None) -> int:
        """``beyond`` reading the boards of the same-host ranks between non-blocking looks at
        the long polls (out on every rank whose board does not answer: a rank without a board,
        a board that cannot be slept on, a slot another request took). When every rank still
        awaited has a board that can wait (a futex on its sequence, ``_board``): busy for
        ``BOARD_SPIN_FUTEX`` s, then asleep on the sequence of one such board until it moves
        (at most ``BOARD_SLEEP`` s at a time);
        otherwise busy for ``BOARD_SPIN`` s, then in naps of ``BOARD_NAP`` s on a long poll's
        socket. (A rank whose board slot another request took answers only by its long poll,
        which a board sleep then hears within ``BOARD_SLEEP`` s.) Once the request's news has a
        pace (:func:`spin_window`), a futex wait sleeps through to the window instead of
        spinning first, calls ``ahead`` as the window opens and spins through it."""
        started = time.monotonic()
        waited = False  # whether this call found the layer missing (its news then dates a publish)
        window = spin_window(self._last_news, self._last_count, self._pace, after)
        alive_checked = started
        while True:
            # first the counts alone: after a wake-up this is all it takes to go
            if self._heard(request_id, after, recorded):
                return self._news(waited)
            # the sequences before the counts: a count written after this read moves them
            seqs = {rank: board.sequence() for rank, board in self.boards.items()
                    if board.can_wait}
            self.ask(request_id, after, recorded)
            for rank in list(self._out):
                self._collect(rank, None)
            heard = self._read_boards(request_id, recorded)
            least = min(self._known.get(rank, 0) for rank in self.dealers)
            now = time.monotonic()
            if least > after:
                self.board_news += heard
                return self._news(waited)
            if now >= deadline:
                return least
            waited = True
            awaited = [rank for rank in self.dealers if self._known.get(rank, 0) <= after]
            if now >= alive_checked + ALIVE_CHECK:
                alive_checked = now
                self._check_alive(awaited, after)
            sleeper = awaited[0] if all(seqs.get(r) is not None for r in awaited) else None
            if sleeper is not None:
                if window is not None and window[0] <= now < window[1]:
                    if ahead is not None:
                        ahead, ready_for = None, ahead
                        ready_for((window[0] + window[1]) / 2 - now)
                        continue  # the boards first: the layer may have come meanwhile
                    if self._spin(request_id, after, recorded, min(window[1], deadline)):
                        self.spun_news += 1
                        return self._news(True)
                    window = None  # not in the window: the futex from now on
                    continue
                sleep = min(deadline - now, BOARD_SLEEP)
                if window is not None and now < window[0]:
                    sleep = min(sleep, window[0] - now)  # wake for the spin
                elif now < started + BOARD_SPIN_FUTEX:
                    continue
                if not self.boards[sleeper].wait(seqs[sleeper], sleep):
                    started = now - BOARD_SPIN  # that board cannot wait: nap on the sockets
                    window = None
            elif now >= started + BOARD_SPIN and self._out:
                rank = next(iter(self._out))
                self._collect(rank, min(deadline, now + BOARD_NAP))

    def _check_alive(self, ranks: list[int], after: int) -> None:
        """TransferFailed when the process a rank's board announced is gone (a pid the peer
        claimed: a wrong one costs that peer's reads only)."""
        for rank in ranks:
            board = self.boards.get(rank)
            pid = getattr(board, "pid", 0)
            if pid > 0 and not process_alive(pid):
                raise TransferFailed(f"prefill rank {rank} of engine {self.engine_id!r} (process "
                                     f"{pid}) exited before it published layer {after}")

    def _spin(self, request_id: str, after: int, recorded: bool, until: float) -> bool:
        """Read the boards without sleeping until every rank is past ``after`` (True) or
        ``until`` (False), yielding the GIL between reads."""
        while True:
            if self._heard(request_id, after, recorded):
                return True
            if time.monotonic() >= until:
                return False
            _yield()

    def _read_boards(self, request_id: str, recorded: bool) -> bool:
        """Take the counts the boards hold for ``request_id``; whether one raised a count."""
        heard = False
        for rank, board in self.boards.items():
            n = board.layers(request_id, recorded)
            if n is None:
                continue
            self._held.add(rank)
            if n > self._known.get(rank, 0):
                self._known[rank] = n
                heard = True
        return heard

    def _heard(self, request_id: str, after: int, recorded: bool) -> bool:
        """Whether the boards alone show every rank past ``after`` (the counts they hold are
        kept either way; the long polls are left for the full look)."""
        heard = self._read_boards(request_id, recorded)
        if all(self._known.get(rank, 0) > after for rank in self.dealers):
            self.board_news += heard
            return True
        return False

    def _collect(self, rank: int, deadline: float | None) -> None:
        """Take rank's long-poll reply: waiting until ``deadline``, or (None) only if it is
        there already."""
        token, request_id, held = self._out[rank]
        dealer = self.dealers[rank]
        reply = dealer.ready(token) if deadline is None else dealer.wait(token, deadline)
        if reply is None:  # the deadline: the caller says which layer never came
            return
        del self._out[rank]
        if not isinstance(reply, _side.Layers):
            raise TransferFailed(f"prefill rank {rank} of engine {self.engine_id!r} refused "
                                 f"the layer status: {getattr(reply, 'message', reply)}")
        if request_id == self._request:
            if not reply.held and held:
                # held earlier in this read (before the poll went out), not now: released
                # before this reader notified (its lease ran out, or the server released it); no
                # layer will come. A poll sent before the rank was seen holding the request may
                # be answered "not held" from before the hold (its board showed the hold first)
                raise TransferFailed(f"prefill rank {rank} of engine {self.engine_id!r} no longer "
                                     f"holds the request (released before this read ended: its "
                                     f"lease ran out, or its server released it)")
            if reply.held:
                self._held.add(rank)
            n = reply.layers_ready if reply.held else 0
            self._known[rank] = max(n, self._known.get(rank, 0))

    def close(self) -> None:
        for board in self.boards.values():
            board.close()
        self.boards.clear()
        for dealer in self.dealers.values():
            dealer.close()
        self.dealers.clear()
        self._out.clear()
