"""Regenerate the synthetic sample result files of tests/data (NOT measurements: fixed numbers
for the report and plot tests): ``python tests/data/make_samples.py tests/data``."""
import sys
from fkv.bench import results, write, attention, convert, plan
ENV = {"gpu": "SAMPLE GPU (synthetic numbers, not a measurement)", "gpu_count": 1, "device": "cuda",
       "torch": "2.11.0", "triton": "3.6.0", "nixl": "1.5.1", "cuda": "13.0", "driver": "580.00",
       "git_commit": "0000000000000000000000000000000000000000", "git_dirty": False,
       "date": "2026-01-01T00:00:00Z", "host": "sample", "machine": "x86_64", "cpu_count": 16,
       "env_vars": {}}
CFG = {"sample": "synthetic numbers for fkv's tests; not a measurement"}
out = sys.argv[1]

def stamp(run, t):
    run.created = t
    return run

w = []
for kind, tokens, layout, dtype, gbps, base in [
        ("prefill", 65536, "NHD", "bfloat16", 3600.0, 700.0), ("prefill", 65536, "HND", "bfloat16", 3500.0, 650.0),
        ("prefill", 8192, "NHD", "bfloat16", 3000.0, 600.0), ("prefill", 8192, "HND", "bfloat16", 2400.0, 600.0),
        ("decode", 256, "NHD", "bfloat16", 400.0, 100.0), ("decode", 256, "HND", "bfloat16", 380.0, 100.0),
        ("prefill", 65536, "NHD", "float8_e4m3fn", 3100.0, 250.0)]:
    c = write.Case(kind, tokens, layout, dtype)
    c.bytes = tokens * 2 * 8 * 128 * (2 + (1 if "float8" in dtype else 2))
    c.gbps, c.baseline_gbps = gbps, base
    c.ms, c.baseline_ms = c.bytes / gbps / 1e6, c.bytes / base / 1e6
    c.pct_of_copy, c.speedup_vs_baseline = 100 * gbps / 4000.0, gbps / base
    c.extra = {"kernel_us": c.ms * 1e3, "eager_us": 12.0 if kind == "decode" else c.ms * 1e3,
               "baseline_eager_us": 40.0}
    if kind == "decode":
        c.extra |= {"graph1_us": 6.0, "graph_per_call_us": 3.0 if layout == "NHD" else 4.5,
                    "baseline_graph_per_call_us": None}
    w.append(c)
run = stamp(write.to_run(w, write.Shape(), 4000.0, "cuda", CFG, ENV), "2026-01-01T00:00:00Z")
results.write(run, f"{out}/sample-write.json")

a = []
for kind, b, t, layout, gbps, sdpa in [("decode", 64, 8192, "NHD", 4000.0, 4200.0),
                                       ("decode", 64, 8192, "HND", 3900.0, 4200.0),
                                       ("decode", 8, 32768, "NHD", 3000.0, 4000.0),
                                       ("prefill", 4, 4096, "NHD", 0.0, 0.0), ("prefill", 4, 4096, "HND", 0.0, 0.0)]:
    r = attention.Result(kind, b, t, layout)
    r.bytes = 2 * b * t * 8 * 128 * 2
    if kind == "decode":
        r.gbps, r.sdpa_gbps = gbps, sdpa
        r.ms, r.sdpa_ms = r.bytes / gbps / 1e6, r.bytes / sdpa / 1e6
        r.ratio = gbps / sdpa
    else:
        r.ms, r.sdpa_ms = (1.4 if layout == "NHD" else 1.6), 1.0
        r.gbps, r.sdpa_gbps = r.bytes / r.ms / 1e6, r.bytes / r.sdpa_ms / 1e6
        r.ratio = r.ms / r.sdpa_ms
    r.pct_of_read_ceiling = 100 * r.gbps / 4300.0
    r.max_err_vs_reference, r.max_err_vs_sdpa = 0.004, 0.008
    r.extra = {"ms_repeat": r.ms, "sdpa_baseline": "CUDNN_ATTENTION"}
    a.append(r)
run = stamp(attention.to_run(a, attention.Shape(), 4300.0, "cuda", CFG, ENV), "2026-01-01T00:00:00Z")
results.write(run, f"{out}/sample-attention.json")

cv = []
for op, src, dst, gbps, base in [("convert", "triton NHD", "triton HND", 4000.0, 1500.0),
                                 ("convert", "triton HND", "triton NHD", 3900.0, 1400.0),
                                 ("gather", "triton NHD", "", 3300.0, 600.0),
                                 ("gather", "triton HND", "", 3200.0, 700.0)]:
    c = convert.Case(op, src, dst)
    c.bytes = 1 << 30
    c.gbps, c.baseline_gbps = gbps, base
    c.ms = c.ms_repeat = c.bytes / gbps / 1e6
    c.baseline_ms = c.bytes / base / 1e6
    c.pct_of_copy, c.speedup_vs_baseline = 100 * gbps / 4000.0, gbps / base
    c.target_gbps = convert.TARGETS[op]
    c.meets_target = gbps >= c.target_gbps
    cv.append(c)
run = stamp(convert.to_run(cv, convert.Shape(), 4000.0, "cuda", CFG, ENV), "2026-01-01T00:00:00Z")
results.write(run, f"{out}/sample-convert.json")

hs = [{"case": "A: P1->D2 HND", "strategy": "direct", "warm_us": 30.0, "cold_us": 80.0, "target_us": 50.0, "ok": True},
      {"case": "MLA P4->D2", "strategy": "direct", "warm_us": 20.0, "cold_us": 40.0, "target_us": 50.0, "ok": True}]
seg = [{"case": "A: P1->D2 HND", "ids": "random", "blocks": 100000, "strategy": "direct", "rows": 200000,
        "ms": 4.0, "baseline_ms": 2000.0, "ceiling_ms": 0.4, "x_baseline": 500.0, "target_ms": 20.0, "ok": True}]
cpu_env = ENV | {"gpu": None, "gpu_count": 0, "device": "cpu", "cpu_count": 2}
run = stamp(plan.to_run(hs, seg, CFG, cpu_env), "2026-01-01T00:00:00Z")
results.write(run, f"{out}/sample-plan.json")

run = stamp(results.Run("transfer", config=CFG | {"blocks": 4096, "layers": 1}, env=ENV | {"gpu_count": 2}),
            "2026-01-01T00:00:00Z")
run.ceiling("copy_gbps", 4200.0)
for path, mib, gbps in [("direct", 32, 3.0), ("direct", 128, 3.2), ("packed", 32, 15.0),
                        ("packed", 128, 48.0), ("link", 32, 90.0), ("link", 128, 200.0)]:
    peer, nccl = (300.0, 180.0) if mib == 32 else (380.0, 340.0)
    run.add(f"{path} P1->D2 HND, {mib} MiB requests, 2 GPUs",
            params={"path": path, "prefill_tp": 1, "decode_tp": 2, "layout": "HND", "layers": 1,
                    "request_bytes": mib << 20, "ucx_tls": "cuda_ipc,cuda_copy,tcp"},
            metrics={"gbps": gbps, "peer_copy_gbps": peer, "nccl_gbps": nccl,
                     "of_peer_copy_x": gbps / peer, "ms": (mib << 20) / gbps / 1e6})
results.write(run, f"{out}/sample-transfer.json")

run = stamp(results.Run("tests", config=CFG | {"args": ["-m", "gpu"]}, env=ENV), "2026-01-01T00:00:00Z")
run.add("pytest -m gpu", params={"markers": "gpu"},
        metrics={"passed_count": 380, "failed_count": 0, "errors_count": 0, "skipped_count": 2,
                 "xfailed_count": 0, "deselected_count": 410, "duration_s": 312.5})
results.write(run, f"{out}/sample-tests.json")
