"""Model check: the mbarrier protocol of prefill_gluon.py's warp-specialized kernels, on the CPU.

A wrong barrier phase in a Gluon kernel hangs the GPU rather than failing, and each GPU run costs
device time, so this replays the protocol of ``_ws_producer`` and ``_ws_consumer`` (modes
``ws``, ``ws-pipe``, ``ws-fa3``, ``ws-fa3-pp``) with threads: the producer and the two consumers
issue their waits, arrivals and MMAs in the kernel's order, each MMA reading its shared-memory
slot when issued and again when waited for, with random delays everywhere. An mbarrier is
modelled as PTX defines it: ``count`` arrivals complete a phase, and a wait for parity ``P``
returns once the phase of that parity has completed (the barrier's current phase parity is not
``P``). Checked: no wait ever blocks for good (a deadlock), and every read finds the tile it
expects in its slot (the producer never refills a slot an MMA may still read).

    python bench/experiments/gluon_barriers_model.py      # prints one line per case, exit 1 on a fault
"""

from __future__ import annotations

import itertools
import random
import sys
import threading
import time


class Barrier:
    def __init__(self, count: int) -> None:
        self.count, self.pending, self.done = count, count, 0  # done: phases completed
        self.cv = threading.Condition()

    def arrive(self) -> None:
        with self.cv:
            self.pending -= 1
            if self.pending == 0:
                self.done += 1
                self.pending = self.count
                self.cv.notify_all()

    def wait(self, parity: int, timeout: float = 2.0) -> None:
        with self.cv:  # returns once the current phase's parity differs from `parity`
            if not self.cv.wait_for(lambda: (self.done & 1) != parity, timeout):
                raise TimeoutError(f"wait(parity={parity}) never returned (done={self.done})")


def _nap(rng: random.Random) -> None:
    time.sleep(rng.random() * 2e-4)


def run(mode: str, stages: int, n_tiles: int, seed: int) -> str | None:
    """One replay; None when clean, else what went wrong."""
    k_slot = [-1] * stages  # the tile each slot holds (K and V land together)
    full = [Barrier(1) for _ in range(stages)]
    empty = [Barrier(2) for _ in range(stages)]
    turn = [Barrier(1) for _ in range(2)]
    faults: list[str] = []
    pipe, fa3, pingpong = mode == "ws-pipe", mode.startswith("ws-fa3"), mode == "ws-fa3-pp"
    if pingpong:
        turn[0].arrive()
    n_fill = n_tiles + 1 if pipe else max(n_tiles, 1)

    def producer(rng: random.Random) -> None:
        for j in range(n_fill):
            slot = j % stages
            if j >= stages:
                empty[slot].wait(((j // stages) & 1) ^ 1)
            _nap(rng)
            k_slot[slot] = j  # the copies land
            _nap(rng)
            full[slot].arrive()

    def consumer(me: int, rng: random.Random) -> None:
        flight: list[tuple[str, int]] = []  # MMAs in flight, oldest first: (what, tile)

        def issue(tile: int) -> None:
            if k_slot[tile % stages] != tile:
                faults.append(f"consumer {me}: issued on tile {tile}, slot holds "
                              f"{k_slot[tile % stages]}")
            flight.append(("mma", tile))

        def wait(outstanding: int) -> None:  # wgmma.wait_group: the oldest ones complete
            while len(flight) > outstanding:
                _, tile = flight.pop(0)
                _nap(rng)
                if k_slot[tile % stages] != tile:
                    faults.append(f"consumer {me}: MMA on tile {tile} still reading, slot now "
                                  f"holds {k_slot[tile % stages]}")

        def release(tile: int) -> None:
            empty[tile % stages].arrive()

        if pipe:
            full[0].wait(0)
            issue(0)  # S(0)
            for j in range(n_tiles):
                full[(j + 1) % stages].wait(((j + 1) // stages) & 1)
                issue(j + 1)        # S(j+1)
                wait(2)             # S(j)
                _nap(rng)           # softmax
                wait(1)             # PV(j-1)
                if j > 0:
                    release(j - 1)
                issue(j)            # PV(j)
            wait(0)
        elif fa3:
            full[0].wait(0)
            issue(0)
            wait(0)
            _nap(rng)
            for j in range(1, n_tiles):
                if pingpong:
                    turn[me].wait((j - 1) & 1)
                full[j % stages].wait((j // stages) & 1)
                issue(j)            # S(j)
                issue(j - 1)        # PV(j-1)
                if pingpong:
                    turn[1 - me].arrive()
                wait(1)             # S(j)
                _nap(rng)
                wait(0)             # PV(j-1)
                release(j - 1)
            issue(max(n_tiles, 1) - 1)  # PV(last)
            wait(0)
        else:
            for j in range(n_tiles):
                full[j % stages].wait((j // stages) & 1)
                issue(j)            # S(j)
                wait(0)             # S(j) and PV(j-1)
                if j > 0:
                    release(j - 1)
                _nap(rng)
                issue(j)            # PV(j)
            wait(0)

    rng = random.Random(seed)
    errors: list[BaseException] = []

    def guard(fn, *a):
        try:
            fn(*a)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(producer, random.Random(rng.random()))),
               *(threading.Thread(target=guard, args=(consumer, c, random.Random(rng.random())))
                 for c in range(2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    if errors:
        return f"{type(errors[0]).__name__}: {errors[0]}"
    if any(t.is_alive() for t in threads):
        return "a thread never finished"
    return faults[0] if faults else None


def main() -> int:
    bad = 0
    for mode, stages, n in itertools.product(("ws", "ws-pipe", "ws-fa3", "ws-fa3-pp"), (3, 4, 5),
                                             (0, 1, 2, 3, 4, 7, 12)):
        results = [run(mode, stages, n, seed) for seed in range(6)]
        fault = next((r for r in results if r), None)
        bad += fault is not None
        print(f"{mode:10} stages {stages} tiles {n:2}: {fault or 'clean (6 replays)'}", flush=True)
    print("faults:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
