"""Real NIXL transfers between processes: prefill and decode ranks each in their own process.

The module starts its worker processes once (``cluster``: two prefill-rank processes, four
decode-rank processes, ``tests/_transport_worker.py``); each test case starts servers and clients
for its own configuration inside them (a fresh NIXL agent each) and stops them afterwards. Bytes
on every decode rank are compared bit for bit with the one global KV the prefill ranks were filled
from; decode caches start as NaN so unwritten elements show, and blocks outside a request must stay
NaN. Failure cases use their own prefill processes (they get killed).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.transport

WORKER = Path(__file__).with_name("_transport_worker.py")
HEADS = 8
SEED = 7
# UCX over TCP on loopback: a stopped process cannot serve a READ (shared-memory transports read
# a stopped process's memory directly), so the "killed during a read" case really is in flight.
TCP_LO = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


class Proc:
    """One worker process: JSON commands on stdin, JSON replies on a private pipe."""

    def __init__(self, label: str, logdir: Path, prefix: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.label = label
        read_fd, write_fd = os.pipe()
        self.log_path = logdir / f"{label}.log"
        log = open(self.log_path, "w")
        full_env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", **(env or {})}
        self.proc = subprocess.Popen([*prefix, sys.executable, str(WORKER), str(write_fd)],
                                     stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                     pass_fds=(write_fd,), env=full_env, text=True)
        log.close()
        os.close(write_fd)
        self.fd = read_fd
        self.buf = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, cmd: str, **fields: Any) -> None:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"{self.label}: no reply within {timeout} s\n{self.tail()}")
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise AssertionError(f"{self.label} exited ({self.proc.poll()})\n{self.tail()}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def call(self, cmd: str, *, timeout: float = 90.0, check: bool = True, **fields: Any
             ) -> dict[str, Any]:
        self.send(cmd, **fields)
        return self.result(timeout, check)

    def result(self, timeout: float = 90.0, check: bool = True) -> dict[str, Any]:
        reply = self.recv(timeout)
        if check and not reply["ok"]:
            raise AssertionError(f"{self.label}: {reply['type']}: {reply['error']}\n"
                                 f"{reply['trace']}\n{self.tail()}")
        return reply

    def tail(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdin:
            self.proc.stdin.close()
        os.close(self.fd)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.proc.pid, sig)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    logdir = tmp_path_factory.mktemp("transport")
    procs = {"P": [Proc(f"P{r}", logdir) for r in range(2)],
             "D": [Proc(f"D{r}", logdir) for r in range(4)]}
    try:
        for p in procs["P"] + procs["D"]:
            p.call("ping", timeout=120)
        procs["logdir"] = logdir
        yield procs
    finally:
        for p in procs["P"] + procs["D"]:
            p.close()


# -- configurations -------------------------------------------------------------------------------

def spec_dict(*, tp: int, heads: int = HEADS, **kw: Any) -> dict[str, Any]:
    d = {"backend": "triton", "layout": "HND", "num_blocks": 12, "block_size": 4,
         "num_kv_heads": max(1, heads // tp), "head_size": 16, "dtype": "bfloat16", "num_layers": 2}
    d.update(kw)
    if d["backend"] == "mla":
        d["num_kv_heads"] = 1
    return d


def engine_dict(engine_id: str, tp: int, rank: int, heads: int = HEADS) -> dict[str, Any]:
    return {"engine_id": engine_id, "tp_size": tp, "tp_rank": rank, "total_num_kv_heads": heads,
            "model": "tiny"}


_counter = iter(range(10**6))


class Pair:
    """One prefill engine (P ranks in the cluster's prefill processes) and its decode ranks."""

    def __init__(self, cluster: Any, ptp: int, dtp: int, pspec: dict[str, Any],
                 dspec: dict[str, Any], *, heads: int = HEADS, lease: float = 60.0,
                 p_procs: list[Proc] | None = None, d_procs: list[Proc] | None = None,
                 p_env: dict[str, str] | None = None, d_env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", connect_kw: dict[str, Any] | None = None) -> None:
        self.name = f"c{next(_counter)}"
        self.ptp, self.dtp, self.pspec, self.dspec, self.heads = ptp, dtp, pspec, dspec, heads
        self.P = (p_procs or cluster["P"])[:ptp]
        self.D = (d_procs or cluster["D"])[:dtp]
        self.address = self.P[0].call(
            "serve", name=self.name, spec=pspec, engine=engine_dict(f"P-{self.name}", ptp, 0, heads),
            seed=SEED, lease=lease, env=p_env, host=host)["address"]
        for r, p in enumerate(self.P[1:], 1):
            p.send("serve", name=self.name, spec=pspec, seed=SEED, lease=lease, env=p_env,
                   engine=engine_dict(f"P-{self.name}", ptp, r, heads), join=self.address,
                   host=host)
        for p in self.P[1:]:
            p.result()
        self.connected: list[dict[str, Any]] = []
        for r, d in enumerate(self.D):
            d.send("connect", name=self.name, spec=dspec, engine=engine_dict(f"D-{self.name}", dtp, r,
                                                                               heads),
                   address=self.address, env=d_env, **(connect_kw or {}))
        self.connected = [d.result() for d in self.D]

    def read_all(self, request_id: str, local: list[int], remote: list[int], **kw: Any
                 ) -> list[dict[str, Any]]:
        for d in self.D:
            d.send("read", name=self.name, request_id=request_id, local=local, remote=remote, **kw)
        return [d.result() for d in self.D]

    def verify_all(self, local: list[int], remote: list[int], num_tokens: int | None = None
                   ) -> list[str | None]:
        for d in self.D:
            d.send("verify", name=self.name, local=local, remote=remote, seed=SEED,
                   remote_spec=self.pspec, num_tokens=num_tokens)
        return [d.result()["mismatch"] for d in self.D]

    def pending(self) -> list[dict[str, Any]]:
        return [p.call("pending", name=self.name) for p in self.P]

    def wait_released(self, request_id: str, timeout: float = 10.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            states = self.pending()
            if all(request_id not in s["pending"] for s in states) or time.monotonic() > deadline:
                return [s["released"].get(request_id, "still pending") for s in states]
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.P + self.D:
            p.send("stop", name=self.name)
        for p in self.P + self.D:
            p.result(check=False)


def request_blocks(pspec: dict[str, Any], dspec: dict[str, Any], tokens: int
                   ) -> tuple[list[int], list[int]]:
    """Scattered, out-of-order blocks of ``tokens`` tokens on both sides."""
    nr = -(-tokens // pspec["block_size"])
    nl = -(-tokens // dspec["block_size"])
    remote = [(5 * i + 3) % pspec["num_blocks"] for i in range(nr)]
    local = [(7 * i + 2) % dspec["num_blocks"] for i in range(nl)]
    assert len(set(local)) == nl
    return local, remote


# -- the matrix: P TP x D TP x layouts / block sizes ---------------------------------------------

VARIANTS = {
    # name: (prefill spec overrides, decode spec overrides, connect keywords, expected strategy)
    "HND": ({}, {}, {"strategy": "direct"}, "direct"),
    "NHD": ({"layout": "NHD"}, {"layout": "NHD"}, {}, None),
    "mixed": ({"layout": "NHD"}, {"layout": "HND"}, {}, "staging"),
    "blocks": ({"block_size": 4}, {"block_size": 8, "num_blocks": 8}, {}, "staging"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("ptp,dtp", [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)])
def test_matrix(cluster: Any, ptp: int, dtp: int, variant: str) -> None:
    pover, dover, connect_kw, strategy = VARIANTS[variant]
    if strategy is None:  # NHD: a head slice is not contiguous, so heterogeneous TP stages
        strategy = "direct" if ptp == dtp else "staging"
    pspec, dspec = spec_dict(tp=ptp, **pover), spec_dict(tp=dtp, **dover)
    pair = Pair(cluster, ptp, dtp, pspec, dspec, connect_kw=connect_kw)
    try:
        assert {c["strategy"] for c in pair.connected} == {strategy}
        tokens = 4 * 4 - 2  # a partial last block
        local, remote = request_blocks(pspec, dspec, tokens)
        for p in pair.P:
            p.call("hold", name=pair.name, request_id="r1", blocks=remote)
        results = pair.read_all("r1", local, remote, num_tokens=tokens)
        assert [r["result_ok"] for r in results] == [True] * dtp, results
        assert all(r["bytes"] > 0 and r["descriptors"] > 0 for r in results)
        assert pair.verify_all(local, remote, tokens) == [None] * dtp
        assert pair.wait_released("r1") == ["notified"] * ptp
    finally:
        pair.stop()
