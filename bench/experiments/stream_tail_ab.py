"""Experiment: the streamed read's tail (``stream_tail_cpu.py``) under two source trees, run
alternately on the same machine (CPU, no GPU).

Each round runs this tree's ``bench/experiments/stream_tail_cpu.py --ahead-only`` once per tree,
in fresh processes, with ``PYTHONPATH`` naming the tree, so the same measuring code times both
trees' fkv. Kept: every row of every round (16 and 256 blocks, two rows each: the first reads
of a process, then the second), and per tree the median over rounds of each second row's tail,
news, one layer and step spans after the news.

    python bench/experiments/stream_tail_ab.py --tree before=PATH --tree after=. [--rounds 4]
        [--paced]   # passed on to stream_tail_cpu.py (and the JSON named -paced-)
        [--env LABEL:NAME=VALUE]   # an environment variable for one tree's runs (repeatable;
                                   # the same path may appear under two labels)
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


PACED = "--paced" in sys.argv


def _run(tree: str, extra: dict[str, str]) -> list[dict]:
    rest = os.environ.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, **extra, "OUT": out,
               "PYTHONPATH": os.path.abspath(tree) + (os.pathsep + rest if rest else "")}
        subprocess.run([sys.executable, str(HERE / "stream_tail_cpu.py"), "--ahead-only",
                        *(["--paced"] if PACED else [])],
                       env=env, check=True, capture_output=True)
        name = "stream-tail-cpu-paced-exp.json" if PACED else "stream-tail-cpu-exp.json"
        return json.loads((pathlib.Path(out) / name).read_text())["rows"]


def _summary(rounds: list[list[dict]], blocks: int) -> dict:
    second = [[r for r in rows if r["blocks"] == blocks][1] for rows in rounds]
    med = statistics.median
    spans = sorted({k for r in second for k in r["after_news_ms"]})
    return {"tail_ms": med(r["tail_ms"] for r in second),
            "tail_ms_rounds": [r["tail_ms"] for r in second],
            "news_ms": med(r["news_ms"] for r in second),
            "one_layer_ms": med(r["one_layer_ms"] for r in second),
            "tail_over_layer_x": med(r["tail_over_layer_x"] for r in second),
            "after_news_ms": {k: {"starts": med(r["after_news_ms"][k]["starts"] for r in second
                                                if k in r["after_news_ms"]),
                                  "takes": med(r["after_news_ms"][k]["takes"] for r in second
                                               if k in r["after_news_ms"])} for k in spans}}


def main() -> None:
    args = sys.argv[1:]
    trees = [args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--tree"]
    rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 4
    envs: dict[str, dict[str, str]] = {label: {} for label, _ in trees}
    for i, a in enumerate(args):
        if a == "--env":
            label, pair = args[i + 1].split(":", 1)
            name, value = pair.split("=", 1)
            envs[label][name] = value
    if len(trees) < 2:
        raise SystemExit(__doc__)
    runs: dict[str, list] = {label: [] for label, _ in trees}
    for _ in range(rounds):
        for label, path in trees:
            runs[label].append(_run(path, envs[label]))
            last = [r for r in runs[label][-1] if r["blocks"] == 16][1]
            print(label, {k: round(last[k], 3) for k in ("tail_ms", "news_ms", "one_layer_ms")},
                  flush=True)
    out = {"experiment": "streamed read tail, two trees alternately (stream_tail_cpu.py)",
           "paced": PACED,
           "cpus": os.cpu_count(), "rounds": rounds, "trees": dict(trees), "env": envs,
           "summary": {label: {str(n): _summary(reps, n) for n in (16, 256)}
                       for label, reps in runs.items()},
           "runs": runs}
    path = pathlib.Path(os.environ.get("OUT", "/tmp")) / (
        "stream-tail-ab-paced-exp.json" if PACED else "stream-tail-ab-exp.json")
    path.write_text(json.dumps(out, indent=1))
    for label in runs:
        s = out["summary"][label]["16"]
        print(label, "16 blocks:", {k: round(s[k], 3) for k in ("tail_ms", "news_ms",
                                                                 "one_layer_ms")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
