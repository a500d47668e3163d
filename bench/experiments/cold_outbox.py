"""Experiment: an outbox put (a pread and two pwrites on a /dev/shm file, as the outbox does, plus
the reader's count kept up) against the same stores through a mapping, hot and after a 5 ms spin
that yields (us, median).

    python bench/experiments/cold_outbox.py
"""
import time, os, statistics, mmap
pc = time.perf_counter
fd = os.open("/dev/shm/fkv-test-cold", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 64 + 256 * 256)
m = mmap.mmap(fd, 64 + 256*256)
mv = memoryview(m)
st = {"w": 0}
def put_sys():
    raw = os.pread(fd, 16, 24)
    w = st["w"]
    rec = (10).to_bytes(2, "little") + b"x" * 10
    os.pwrite(fd, rec, 64 + (w % 256) * 256)
    os.pwrite(fd, (w + 1).to_bytes(8, "little"), 16)
    os.pwrite(fd, (w + 1).to_bytes(8, "little"), 24)  # keep the reader caught up (not timed normally)
    st["w"] = w + 1
def put_map():
    raw = bytes(mv[24:40])
    w = st["w"]
    rec = (10).to_bytes(2, "little") + b"x" * 10
    o = 64 + (w % 256) * 256
    mv[o:o + len(rec)] = rec
    mv[16:24] = (w + 1).to_bytes(8, "little")
    mv[24:32] = (w + 1).to_bytes(8, "little")
    st["w"] = w + 1
def spin():
    t = pc()
    while pc() - t < 0.005: os.sched_yield()
def measure(f, prep, n=200):
    out = []
    for _ in range(n):
        prep(); t = pc(); f(); out.append(pc() - t)
    return round(statistics.median(out) * 1e6, 2)
for f in (put_sys, put_map, put_sys, put_map):
    print(f.__name__, "hot", measure(f, lambda: None), "after 5ms spin", measure(f, spin, 100))
os.unlink("/dev/shm/fkv-test-cold")
