"""``fkv demo``'s parent process: handshake first, then the ranks as processes, then the verdict.

The parent never imports torch or triton: it runs the pure handshake (exit 3 on Reject, before any
process starts), starts the reference, prefill and decode ranks (:mod:`fkv.demo.worker`), follows
their progress on a collector socket, hands the decode ranks the prefill engine's address, and
compares what came back (:mod:`fkv.demo.verify`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from fkv.demo.channel import Collector, unpack_array
from fkv.demo.config import DemoConfig
from fkv.demo.summary import print_reject, print_summary, summary_dict
from fkv.demo.verify import compare_kv, compare_run, tolerance

__all__ = ["precheck", "run_demo"]


def precheck(cfg: DemoConfig) -> tuple[list[Any], Any]:
    """The handshake of every decode rank against the prefill engine: ``(results, first Reject)``."""
    from fkv.connector.handshake import handshake

    remote = (cfg.engine("prefill", 0), cfg.spec("prefill"))
    results = [handshake((cfg.engine("decode", r), cfg.spec("decode")), remote)
               for r in range(cfg.decode_tp)]
    return results, next((r for r in results if not r.ok), None)


class _Children:
    """The demo's own child processes (started and, on failure, stopped by pid only)."""

    def __init__(self, cfg: DemoConfig, collector: str, workdir: str) -> None:
        self.cfg, self.collector, self.workdir = cfg, collector, workdir
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.env = dict(os.environ)
        if cfg.device == "cpu":
            self.env["TRITON_INTERPRET"] = "1"  # inherited before any triton import in a child
        self.env.setdefault("OMP_NUM_THREADS", "1")
        if not cfg.same_host_copies:  # the demo shows NIXL moving the bytes (see --help)
            self.env["FKV_CMA"] = "0"

    def start(self, role: str, rank: int) -> None:
        log = open(os.path.join(self.workdir, f"{role}{rank}.log"), "wb")  # noqa: SIM115
        self.procs[(role, rank)] = subprocess.Popen(
            [sys.executable, "-m", "fkv.demo.worker", role, str(rank), self.collector, self.workdir,
             self.cfg.to_json()],
            stdin=subprocess.PIPE if role == "decode" or (role == "prefill" and self.cfg.stream)
            else subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()

    def tell(self, role: str, rank: int, message: dict[str, Any]) -> None:
        proc = self.procs[(role, rank)]
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(message) + "\n").encode())
        proc.stdin.flush()

    def failed(self) -> list[tuple[str, int, int]]:
        return [(role, rank, p.returncode) for (role, rank), p in self.procs.items()
                if p.poll() is not None and p.returncode != 0]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def log_tail(self, role: str, rank: int, lines: int = 15) -> str:
        with open(os.path.join(self.workdir, f"{role}{rank}.log"), "rb") as f:
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])

    def wait(self, timeout_s: float) -> None:
        """Give children that reported their exit time to finish (interpreter teardown)."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()
            if p.stdin:
                p.stdin.close()


def run_demo(cfg: DemoConfig, *, console: Console | None = None, json_path: str | None = None) -> int:
    """Run the demo; returns the exit code (0 verified, 1 diverged or failed, 3 refused)."""
    console = console or Console()
    results, reject = precheck(cfg)
    if reject is not None:
        print_reject(console, cfg, reject)
        if json_path:
            _write_json(json_path, summary_dict(cfg, results, None, None, None, exit_code=3))
        return 3
    state: dict[str, Any] = {"transfers": {}, "kv": {}, "steps": {}, "ref_steps": {}, "errors": [],
                             "exited_ok": set()}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fkv-demo-") as workdir:
        collector = Collector()
        children = _Children(cfg, collector.address, workdir)
        try:
            _drive(cfg, children, collector, console, state)
            if not state["errors"]:
                children.wait(30.0)
            failed = children.failed()  # before stop(): the ones we kill are not failures
        finally:
            children.stop()
            collector.close()
        for role, rank, code in failed:
            if (role, rank) in state["exited_ok"]:
                continue  # it reported success and was only slow to tear down
            if not any(e["role"] == role and e["rank"] == rank for e in state["errors"]):
                state["errors"].append({"role": role, "rank": rank,
                                        "error": f"exited with code {code}",
                                        "log": children.log_tail(role, rank)})
    state["wall_seconds"] = time.perf_counter() - t_start
    verdict = _verdict(cfg, state)
    code = 0 if verdict["ok"] and not state["errors"] else 1
    summary = summary_dict(cfg, results, state, verdict, state["errors"], exit_code=code)
    print_summary(console, summary)
    if json_path:
        _write_json(json_path, summary)
    return code


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def _drive(cfg: DemoConfig, children: _Children, collector: Collector, console: Console,
           state: dict[str, Any]) -> None:
    L, n_new = cfg.model.num_layers, cfg.new_tokens
    progress = Progress(TextColumn("{task.description:<14}"), BarColumn(bar_width=12),
                        TimeElapsedColumn(), TextColumn("{task.fields[note]}"), console=console,
                        transient=False)
    with progress:
        t_ref = progress.add_task("reference", total=n_new, note="")
        t_pre = progress.add_task(f"prefill TP={cfg.prefill_tp}", total=L,
                                  note="starting")
        t_xfer = progress.add_task("transfer",
                                   total=cfg.decode_tp, note="waiting")
        t_dec = progress.add_task(f"decode TP={cfg.decode_tp}",
                                  total=max(1, n_new - 1), note="waiting")
        children.start("reference", 0)
        for r in range(cfg.prefill_tp):
            children.start("prefill", r)
        for r in range(cfg.decode_tp):
            children.start("decode", r)
        serving: dict[int, str] = {}
        connected: set[int] = set()
        told = started = told_token = False
        exited: set[tuple[str, int]] = set()
        deadline = time.monotonic() + cfg.timeout
        total = 1 + cfg.prefill_tp + cfg.decode_tp
        while len(exited) < total:
            if time.monotonic() > deadline:
                state["errors"].append({"role": "demo", "rank": 0,
                                        "error": f"timed out after {cfg.timeout} s"})
                return
            for ev in collector.poll(0.2):
                role, rank, kind = ev["role"], ev["rank"], ev["kind"]
                if kind == "exit":
                    exited.add((role, rank))
                    if ev["code"] == 0:
                        state["exited_ok"].add((role, rank))
                    else:  # a decode rank whose read failed: the prefill ranks wait for it
                        state["errors"].append({"role": role, "rank": rank,
                                                "error": f"exited with code {ev['code']}",
                                                "log": None})
                elif kind == "error":
                    exited.add((role, rank))
                    state["errors"].append({"role": role, "rank": rank, "error": ev["error"],
                                            "log": None})
                elif role == "reference":
                    _on_reference(ev, state, progress, t_ref)
                elif role == "prefill":
                    if kind == "layer" and rank == 0:
                        progress.update(t_pre, completed=ev["layer"] + 1,
                                        note=f"layer {ev['layer'] + 1}/{L}")
                    elif kind == "prefilled" and rank == 0:
                        state["prefill"] = ev
                        progress.update(t_pre, note=f"first token {ev['token']}, serving")
                    elif kind == "serving":
                        serving[rank] = ev["address"]
                    if kind == "prefilled":
                        state.setdefault("prefill_ranks", {})[rank] = {
                            k: ev.get(k) for k in ("forward_start", "published", "seconds")}
                    elif kind == "freed" and rank == 0:
                        progress.update(t_pre, note="request freed after notifications")
                else:
                    if kind == "connected":
                        connected.add(rank)
                    _on_decode(ev, state, progress, t_xfer, t_dec)
            if state["errors"]:
                return  # a rank failed: the others may wait forever for it (stopped by the caller)
            if cfg.stream:
                # Serving (nothing written yet) -> decode ranks connect and start reading -> the
                # prefill ranks start their forward, publishing each layer -> the first token.
                if not told and len(serving) == cfg.prefill_tp:
                    for r in range(cfg.decode_tp):
                        children.tell("decode", r, {"address": serving[0]})
                    progress.update(t_xfer, note="connecting")
                    told = True
                if told and not started and len(connected) == cfg.decode_tp:
                    for r in range(cfg.prefill_tp):
                        children.tell("prefill", r, {"go": True})
                    progress.update(t_xfer, note="streaming while prefill computes")
                    started = True
                if started and not told_token and "prefill" in state:
                    for r in range(cfg.decode_tp):
                        children.tell("decode", r, {"first_token": state["prefill"]["token"]})
                    told_token = True
            elif not told and len(serving) == cfg.prefill_tp and "prefill" in state:
                for r in range(cfg.decode_tp):
                    children.tell("decode", r, {"address": serving[0],
                                                "first_token": state["prefill"]["token"]})
                progress.update(t_xfer, note="reading")
                told = True
            failed = [f for f in children.failed() if (f[0], f[1]) not in exited]
            if failed:
                for role, rank, code in failed:
                    state["errors"].append({"role": role, "rank": rank,
                                            "error": f"exited with code {code}",
                                            "log": children.log_tail(role, rank)})
                return
            if not children.running() and len(exited) < total:
                time.sleep(0.2)  # a last event may still be in flight
                for ev in collector.poll(0.5):
                    if ev["kind"] in ("exit", "error"):
                        exited.add((ev["role"], ev["rank"]))
                if len(exited) < total:
                    state["errors"].append({"role": "demo", "rank": 0,
                                            "error": "a process exited without reporting"})
                    return


def _on_reference(ev: dict[str, Any], state: dict[str, Any], progress: Progress, task: Any) -> None:
    kind = ev["kind"]
    if kind == "prefilled":
        state["ref_prefill"] = ev
        progress.update(task, completed=1, note=f"first token {ev['token']}")
    elif kind == "kv":
        state["ref_kv"] = unpack_array(ev["kv"])
    elif kind == "step":
        state["ref_steps"][ev["step"]] = ev
        progress.update(task, completed=ev["step"] + 1, note=f"token {ev['token']}")


def _on_decode(ev: dict[str, Any], state: dict[str, Any], progress: Progress, t_xfer: Any,
               t_dec: Any) -> None:
    kind, rank = ev["kind"], ev["rank"]
    if kind == "transferred":
        state["transfers"][rank] = ev
        done = len(state["transfers"])
        mb = sum(t["bytes"] for t in state["transfers"].values()) / 2**20
        progress.update(t_xfer, completed=done, note=f"{mb:.2f} MiB in {done} read(s)")
    elif kind == "kv":
        state["kv"][rank] = (tuple(ev["heads"]), unpack_array(ev["kv"]))
    elif kind == "step" and rank == 0:
        state["steps"][ev["step"]] = ev
        progress.update(t_dec, completed=ev["step"], note=f"token {ev['token']}")


def _verdict(cfg: DemoConfig, state: dict[str, Any]) -> dict[str, Any]:
    ref_tokens, ref_logits, tokens, logits = [], [], [], []
    if "ref_prefill" in state:
        ref_tokens.append(state["ref_prefill"]["token"])
        ref_logits.append(unpack_array(state["ref_prefill"]["logits"]))
        for s in sorted(state["ref_steps"]):
            ref_tokens.append(state["ref_steps"][s]["token"])
            ref_logits.append(unpack_array(state["ref_steps"][s]["logits"]))
    if "prefill" in state:
        tokens.append(state["prefill"]["token"])
        logits.append(unpack_array(state["prefill"]["logits"]))
        for s in sorted(state["steps"]):
            tokens.append(state["steps"][s]["token"])
            logits.append(unpack_array(state["steps"][s]["logits"]))
    rtol, atol = tolerance(cfg.dtype)
    kv_checks = []
    if "ref_kv" in state:
        for rank in sorted(state["kv"]):
            heads, got = state["kv"][rank]
            kv_checks.append(compare_kv(state["ref_kv"], got, heads, rtol, atol))
    if "ref_kv" not in state:
        kv_checks.append((float("inf"), "the reference sent no KV"))
    elif len(kv_checks) != cfg.decode_tp:
        kv_checks.append((float("inf"), f"received KV from {len(state['kv'])} of {cfg.decode_tp} "
                                        "decode ranks"))
    if cfg.stream:  # the same KV read twice: when the reads disagree, one delivered wrong bytes
        kv_checks += [(0.0, f"decode rank {rank}: the non-streamed read of the same KV differs "
                            "from the streamed read")
                      for rank in sorted(state["transfers"])
                      if state["transfers"][rank].get("plain_equal") is False]
    state["tokens"], state["ref_tokens"] = tokens, ref_tokens
    return compare_run(ref_tokens, ref_logits, tokens, logits, kv_checks, cfg.dtype, cfg.tokens)
