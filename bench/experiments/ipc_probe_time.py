"""Experiment: what trying a peer's CUDA IPC handles in a probe process costs at connect (two
256 KiB regions, three times; the probe alone, then a whole ``_ipc.Mapping`` with its probe).
Run from the repository root: ``python bench/experiments/ipc_probe_time.py`` (GPU)."""
import json, subprocess, sys, time
sys.path.insert(0, "tests")
import torch
import _ipc_fuzz_worker as w
from fkv.connector.transport import _ipc, _ipc_probe
p = subprocess.Popen([sys.executable, "tests/_ipc_fuzz_worker.py", "export"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
info = json.loads(p.stdout.readline())
torch.cuda.synchronize()
peer = w._peer(info)
rows = []
for i in range(3):
    t = time.perf_counter()
    got = _ipc_probe.probe(0, [bytes.fromhex(info["handles"][0])], [(0, o, w.RB) for o in info["offsets"]], [bytes.fromhex(e) for e in info["events"]])
    t1 = time.perf_counter()
    m = _ipc.Mapping(peer, torch.device("cuda:0"))
    t2 = time.perf_counter()
    m.close()
    rows.append({"probe_s": t1 - t, "mapping_with_probe_s": t2 - t1, "probe": got})
p.stdin.close(); p.wait()
print(json.dumps(rows))
