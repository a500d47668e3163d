"""Experiment: how much slower a few microseconds of Python run right after the process waited
(slept, spun, or copied), against the same code run hot. Prints one line per state (us, median).

    python bench/experiments/cold_python.py
"""
import time, os, statistics, threading, ctypes
import numpy as np
def work():
    # a few hundred bytecodes, like a result construction
    d = {}
    for i in range(20):
        d[i] = (i, str(i))
    return tuple(d.values())
pc = time.perf_counter
def measure(prep, n=200):
    out = []
    for _ in range(n):
        prep()
        t = pc(); work(); out.append(pc() - t)
    return statistics.median(out) * 1e6
a = np.ones(1 << 20, dtype=np.uint8); b = np.empty_like(a)
big = np.ones(64 << 20, dtype=np.uint8); big2 = np.empty_like(big)
print("hot", measure(lambda: None))
print("after 1MiB copy", measure(lambda: np.copyto(b, a)))
print("after 64MiB copy", measure(lambda: np.copyto(big2, big), 30))
print("after sleep 5ms", measure(lambda: time.sleep(0.005), 100))
ev = threading.Event()
def spin():
    t = pc()
    while pc() - t < 0.005: os.sched_yield()
print("after 5ms yield-spin", measure(spin, 100))
def spin2():
    t = pc()
    while pc() - t < 0.005: pass
print("after 5ms pure spin", measure(spin2, 100))
for dur in (0.00005, 0.0002, 0.001, 0.005, 0.02):
    def s(dur=dur):
        t = pc()
        while pc() - t < dur: pass
    print("after pure spin", dur*1e3, "ms:", round(measure(s, 100),2))
def s3():
    t = pc()
    while pc() - t < 0.005: work()
print("after 5ms spin running work()", measure(s3, 100))
import gc
print("gc enabled", gc.isenabled(), gc.get_threshold())
gc.disable()
print("after 5ms pure spin, gc off", measure(spin2, 100))
