"""Experiment: where the warp-specialized Gluon prefill tile (B=4 x 4096 causal) spends its time,
from Nsight Compute: the kernel's pipe utilizations and warp stall reasons, and the sampled stall
reasons per SASS instruction (which wait the consumers sit in: a ``full`` slot, the other
consumer's turn, an MMA wait, the P barrier).

    python bench/experiments/prefill_profile.py            # GPU with ncu on the PATH; to $OUT
    python bench/experiments/prefill_profile.py --child HND  # (what ncu runs: three launches)

Writes, per layout, ``prefill-profile-<layout>-details.csv`` (ncu's details page) and
``prefill-profile-<layout>-source.csv`` (the SASS page with sampling), then
``prefill-profile-summary.json``: a few details metrics and, for each consumer's key-tile loop
(the two runs of hot SASS that hold warpgroup MMAs), where its warps' stall samples fall: the
wait for the consumer's turn and for a full slot (the first two sampled mbarrier retry branches
of the loop), MMA issue, the MMA waits, the arrives after the warpgroup barrier, fences, the
exponentials (MUFU) and the rest of the softmax and rescale.

    python bench/experiments/prefill_profile.py --summarize DIR   # the summary of DIR's CSVs
                                                                  # (source pages may be .csv.gz)
"""

from __future__ import annotations

import collections
import csv
import gzip
import json
import os
import pathlib
import shutil
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))


def child(layout: str) -> None:
    import torch

    from fkv.bench.attention import Problem, Shape
    from fkv.ops import _attention_gluon

    shape = Shape()
    p = Problem(shape, layout, shape.prefill[0], shape.prefill[1], shape.prefill[1], "cuda",
                dense=False)
    for _ in range(3):
        p.kernel()
    torch.cuda.synchronize()
    print(f"{layout}: gluon launches {_attention_gluon.launches()}", flush=True)


DETAILS = ("Duration", "SM Frequency", "Compute (SM) Throughput", "L1/TEX Cache Throughput",
           "L2 Cache Throughput", "DRAM Throughput", "Issue Slots Busy",
           "Warp Cycles Per Issued Instruction", "Local Memory Spilling Requests",
           "Theoretical Active Warps per SM", "Grid Size", "Registers Per Thread")


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def _kind(src: str) -> str:
    for key, kind in (("HGMMA", "mma issue"), ("DEPBAR", "mma wait"), ("ARRIVE", "arrive"),
                      ("FENCE", "fence"), ("MEMBAR", "fence"), ("BAR.SYNC", "bar.sync"),
                      ("MUFU", "exp2 (MUFU)"), ("LDL", "spill"), ("STL", "spill")):
        if key in src:
            return kind
    return "softmax and rescale (other)"


def _loops(rows: list[dict]) -> list[tuple[int, int]]:
    """Index ranges of the two consumers' key-tile loops: maximal runs of instructions executed
    at least 10^7 times (per warp) that hold warpgroup MMAs."""
    runs, start = [], None
    for i, r in enumerate(rows + [{"Instructions Executed": "0", "Source": ""}]):
        hot = _num(r["Instructions Executed"]) >= 1e5
        if hot and start is None:
            start = i
        elif not hot and start is not None:
            if any("HGMMA" in rows[j]["Source"] for j in range(start, i)):
                runs.append((start, i))
            start = None
    return runs


def summarize(out: pathlib.Path) -> dict:
    summary: dict = {}
    for layout in ("NHD", "HND"):
        details = {r["Metric Name"]: f"{r['Metric Value']} {r['Metric Unit']}".strip()
                   for r in csv.DictReader(open(out / f"prefill-profile-{layout}-details.csv"))
                   if r["Metric Name"] in DETAILS}
        src = out / f"prefill-profile-{layout}-source.csv"
        with (open(src) if src.exists() else gzip.open(f"{src}.gz", "rt")) as f:
            f.readline()  # the kernel's name
            rows = list(csv.DictReader(f))
        total = sum(_num(r["Warp Stall Sampling (All Samples)"]) for r in rows)
        loops = []
        for lo, hi in _loops(rows):
            kinds: collections.Counter = collections.Counter()
            waits = 0
            for r in rows[lo:hi]:
                s = _num(r["Warp Stall Sampling (All Samples)"])
                if "BRA" in r["Source"] and s and _num(r["stall_long_sb"]) > s / 2:
                    waits += 1  # an mbarrier try-wait's retry branch (waits on its result)
                    kind = {1: "turn wait", 2: "full-slot wait"}.get(waits, "other wait")
                else:
                    kind = _kind(r["Source"])
                kinds[kind] += s
            n = sum(kinds.values())
            loops.append({"instructions": hi - lo, "share_of_all_samples": round(n / total, 4),
                          "samples": {k: round(v / n, 4) for k, v in kinds.most_common()}})
        summary[layout] = {"details": details, "consumer_loops": loops}
    (out / "prefill-profile-summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main() -> None:
    out = pathlib.Path(os.environ.get("OUT", "/tmp"))
    ncu = shutil.which("ncu")
    if ncu is None:
        sys.exit("ncu is not on the PATH")
    for layout in ("NHD", "HND"):
        rep = out / f"prefill-profile-{layout}"
        cmd = [ncu, "--kernel-name", "regex:prefill_ws", "--launch-skip", "2",
               "--launch-count", "1", "--set", "full", "--import-source", "no",
               "--clock-control", "none", "-f", "-o", str(rep),
               sys.executable, __file__, "--child", layout]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        print(res.stdout[-3000:], res.stderr[-3000:], flush=True)
        for page, extra in (("details", []), ("source", ["--print-source", "sass"])):
            got = subprocess.run([ncu, "-i", f"{rep}.ncu-rep", "--page", page, "--csv", *extra],
                                 capture_output=True, text=True, timeout=300)
            (out / f"prefill-profile-{layout}-{page}.csv").write_text(got.stdout)
            print(page, got.returncode, len(got.stdout), got.stderr[-1000:], flush=True)
    print(json.dumps(summarize(out), indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    elif len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        print(json.dumps(summarize(pathlib.Path(sys.argv[2])), indent=1))
    else:
        main()
