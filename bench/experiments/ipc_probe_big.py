"""Experiment: the probe of one 16 GiB region (one byte of every 64 KiB read through strided
copies). ``python bench/experiments/ipc_probe_big.py`` (GPU)."""
import json, subprocess, sys, time
import torch
from fkv.connector.transport import _ipc, _ipc_probe
if sys.argv[1:] == ["export"]:
    buf = torch.zeros(16 << 30, dtype=torch.uint8, device="cuda")
    info = _ipc.export_regions([(buf.data_ptr(), 16 << 30)], torch.device("cuda:0"))
    print(json.dumps({"h": info.handles[0].hex(), "o": info.offsets[0]}), flush=True)
    sys.stdin.read(); sys.exit()
p = subprocess.Popen([sys.executable, __file__, "export"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
info = json.loads(p.stdout.readline())
t = time.perf_counter()
got = _ipc_probe.probe(0, [bytes.fromhex(info["h"])], [(0, info["o"], 16 << 30)])
print(json.dumps({"probe_16GiB_s": time.perf_counter() - t, "probe": got}))
p.stdin.close(); p.wait()
