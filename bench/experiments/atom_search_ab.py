"""Experiment (CPU): does pruning the planner's atom search make a first-contact handshake faster?

The candidate (commit 305081c, reverted in the next commit) first computes the axes every side
must split (a fixpoint over each side's span) and returns them when they fit, before walking the
subsets. It was checked equal to the exhaustive search on every spec pair and extent of a grid
(177712 cases). This A/B alternates the two searches call by call, each handshake after clearing
every layout and plan cache (``fkv bench plan``'s "cold"), 3000 calls per configuration, twice.

    python bench/experiments/atom_search_ab.py      # JSON to $OUT (or /tmp)
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import types

CANDIDATE = "305081c"


def main() -> None:
    import fkv.connector.plan as P
    import fkv.layout as L
    from fkv.bench import plan as bp
    from fkv.connector.handshake import handshake

    root = pathlib.Path(__file__).resolve().parents[2]
    text = subprocess.run(["git", "show", f"{CANDIDATE}:fkv/layout.py"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("layout_candidate", f.name)
    cand = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cand)
    os.unlink(f.name)
    # the candidate's two functions, bound to the library's own helpers
    L._forced_splits = types.FunctionType(cand._forced_splits.__code__, L.__dict__)
    searches = {"current": L.fewest_contiguous_atoms,
                "candidate": types.FunctionType(cand.fewest_contiguous_atoms.__code__,
                                                L.__dict__)}
    rows = []
    for rnd in range(2):
        for name, (local, remote) in bp._configs(1024).items():
            times: dict[str, list[float]] = {k: [] for k in searches}
            for i in range(3000):
                tag = "current" if i % 2 else "candidate"
                P.fewest_contiguous_atoms = searches[tag]
                bp._clear_caches()
                t = time.perf_counter()
                handshake(local, remote)
                times[tag].append(time.perf_counter() - t)
            rows.append({"round": rnd, "config": name,
                         **{f"{k}_us": 1e6 * statistics.median(v) for k, v in times.items()}})
            print(rows[-1], flush=True)
    P.fewest_contiguous_atoms = searches["current"]
    out = pathlib.Path(os.environ.get("OUT", "/tmp")) / "atom-search-ab-exp.json"
    out.write_text(json.dumps({"experiment": "first-contact handshake: atom search pruned or not",
                               "candidate": CANDIDATE, "cpus": os.cpu_count(), "rows": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
