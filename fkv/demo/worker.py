"""The demo's child processes: ``python -m fkv.demo.worker ROLE RANK COLLECTOR WORKDIR CONFIG_JSON``.

ROLE is ``prefill``, ``decode`` or ``reference``. Each rank is its own process; the ranks of one
engine join a gloo group (file rendezvous in WORKDIR) to all-gather attention head outputs.
Progress and results go to the parent's collector (msgpack over ZMQ, :mod:`fkv.demo.channel`);
decode ranks read their go-ahead (the prefill engine's address and first token) as one JSON line
on stdin.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from fkv.demo.channel import Reporter, pack_array
from fkv.demo.config import REQUEST_ID, DemoConfig


def _setup(cfg: DemoConfig) -> Any:
    if cfg.device == "cpu":
        # Before triton is imported anywhere in this process: kernels run in the interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.set_num_threads(1)
    return torch


def _device(torch: Any, cfg: DemoConfig, slot: int) -> str:
    """``cpu``, or the GPU of this process: ranks go round-robin over the visible GPUs
    (prefill ranks first, then decode ranks; several ranks share a GPU when there are fewer)."""
    if cfg.device == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        from fkv.errors import FkvError

        raise FkvError("'--device' must be 'cpu' on a machine without a CUDA device (got 'cuda')")
    index = slot % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def _group(torch: Any, workdir: str, side: str, rank: int, tp: int) -> Any:
    """The all-gather of this engine's ranks (identity for one rank)."""
    if tp == 1:
        return None
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, side + '.store')}",
                            rank=rank, world_size=tp)

    def all_gather(x: Any) -> Any:
        local = x.detach().to("cpu").contiguous()
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=1).to(x.device)

    return all_gather


def _broadcast_str(torch: Any, text: str, rank: int, tp: int) -> str:
    """Rank 0's string to every rank of the engine (bytes in a tensor; no pickle)."""
    if tp == 1:
        return text
    import torch.distributed as dist

    buf = torch.zeros(512, dtype=torch.uint8)
    if rank == 0:
        raw = text.encode()
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return bytes(buf.tolist()).rstrip(b"\0").decode()


def _poisoned_caches(torch: Any, spec: Any, device: str) -> list[Any]:
    import fkv

    caches = fkv.allocate(spec, device=device)
    for c in caches:
        c.fill_(float("nan"))  # anything not written or transferred shows up
    return caches


def _generate(torch: Any, model: Any, kv: Any, cfg: DemoConfig, first: int, rep: Reporter,
              report: bool) -> None:
    tok = first
    for step in range(1, cfg.new_tokens):
        pos = cfg.tokens + step - 1
        logits = model.forward(torch.tensor([tok], device=model.device),
                               torch.tensor([pos], device=model.device), kv)[-1]
        tok = int(logits.argmax())
        if report:
            rep.send("step", step=step, token=tok, logits=pack_array(logits.float()))


def run_reference(cfg: DemoConfig, rep: Reporter) -> None:
    torch = _setup(cfg)
    from fkv.demo.model import DemoModel, DenseKV
    from fkv.tensors import torch_dtype

    device = _device(torch, cfg, 0)
    model = DemoModel(cfg.model, device=device)
    kv = DenseKV(cfg.model.num_layers, torch_dtype(cfg.dtype))
    prompt = torch.tensor(cfg.prompt(), device=device)
    logits = model.forward(prompt, torch.arange(cfg.tokens, device=device), kv)[-1]
    first = int(logits.argmax())
    rep.send("prefilled", token=first, logits=pack_array(logits.float()))
    dump = torch.stack([torch.stack([k, v], dim=1) for k, v in zip(kv.k, kv.v)])  # L T 2 H D
    rep.send("kv", heads=[0, cfg.model.num_kv_heads], kv=pack_array(dump.float()))
    _generate(torch, model, kv, cfg, first, rep, report=True)


def run_prefill(cfg: DemoConfig, rank: int, workdir: str, rep: Reporter) -> None:
    torch = _setup(cfg)
    import fkv.connector
    from fkv.demo.model import DemoModel, PagedKV

    tp = cfg.prefill_tp
    device = _device(torch, cfg, rank)
    model = DemoModel(cfg.model, tp=tp, rank=rank, device=device,
                      all_gather=_group(torch, workdir, "prefill", rank, tp))
    spec = cfg.spec("prefill")
    caches = _poisoned_caches(torch, spec, device)
    kv = PagedKV(caches, spec, cfg.block_ids("prefill"))
    prompt = torch.tensor(cfg.prompt(), device=device)
    t0 = time.perf_counter()
    logits = model.forward(prompt, torch.arange(cfg.tokens, device=device), kv,
                           on_layer=lambda i: rep.send("layer", layer=i))[-1]
    rep.send("prefilled", token=int(logits.argmax()), logits=pack_array(logits.float()),
             seconds=time.perf_counter() - t0)
    engine = cfg.engine("prefill", rank)
    join = None
    if rank == 0:
        server = fkv.connector.serve(engine, spec, caches)
        _broadcast_str(torch, server.address, rank, tp)
    else:
        join = _broadcast_str(torch, "", rank, tp)
        server = fkv.connector.serve(engine, spec, caches, join=join)
    with server:
        server.hold(REQUEST_ID, cfg.block_ids("prefill"))
        rep.send("serving", address=server.address)
        deadline = time.monotonic() + cfg.timeout
        parent = os.getppid()
        while REQUEST_ID in server.pending():
            if os.getppid() != parent:
                raise RuntimeError(f"prefill rank {rank}: the demo's parent process went away")
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill rank {rank}: {REQUEST_ID!r} still pending after "
                                   f"{cfg.timeout} s (decode ranks never notified)")
            time.sleep(0.01)
        rep.send("freed")


def run_decode(cfg: DemoConfig, rank: int, workdir: str, rep: Reporter) -> int:
    torch = _setup(cfg)
    import fkv.connector
    from fkv.demo.model import DemoModel, PagedKV, head_ranges
    from fkv.testing import token_major

    tp = cfg.decode_tp
    device = _device(torch, cfg, cfg.prefill_tp + rank)
    model = DemoModel(cfg.model, tp=tp, rank=rank, device=device,
                      all_gather=_group(torch, workdir, "decode", rank, tp))
    spec = cfg.spec("decode")
    caches = _poisoned_caches(torch, spec, device)
    local_ids = cfg.block_ids("decode")
    rep.send("ready")
    go = json.loads(sys.stdin.readline())
    engine = cfg.engine("decode", rank)
    with fkv.connector.connect(engine, spec, caches, remote_address=go["address"],
                               expected_engine=cfg.engine("prefill", 0).engine_id) as client:
        result = client.read(REQUEST_ID, local_ids[: cfg.decode_prompt_blocks()],
                             cfg.block_ids("prefill"), timeout=cfg.timeout)
        stats = client.stats()
    rep.send("transferred", ok=bool(result.ok), bytes=int(result.bytes),
             descriptors=int(result.descriptors), seconds=float(result.seconds),
             nixl_seconds=float(result.transfer_seconds), path=result.strategy,
             stats={"reads": stats["total"]["count"], "failures": stats["failures"],
                    "gbps": stats["total"]["gbps"].get("overall")},
             error=None if result.error is None else str(result.error))
    if not result.ok:
        return 1
    if cfg.corrupt and rank == 0:
        # --corrupt: damage one received value to show the verification catches it.
        # Token 5's K, head 0, channel 3 in layer 1 (a view in canonical axis order).
        axes = spec.logical_axes
        canon = caches[1].permute(*[axes.index(a) for a in ("B", "N", "two", "H", "C")])
        n = spec.block_size
        canon[local_ids[5 // n], 5 % n, 0, 0, 3] += 1.0
    heads = head_ranges(cfg.model, tp, rank)[1]
    dump = torch.stack([token_major(c, spec, local_ids, num_tokens=cfg.tokens) for c in caches])
    rep.send("kv", heads=list(heads), kv=pack_array(dump.float()))
    _generate(torch, model, PagedKV(caches, spec, local_ids), cfg, int(go["first_token"]), rep,
              report=rank == 0)
    return 0


def main(argv: list[str]) -> int:
    role, rank, collector, workdir, config = argv
    cfg = DemoConfig.from_json(config)
    rep = Reporter(collector, role, int(rank))
    try:
        if role == "reference":
            run_reference(cfg, rep)
            code = 0
        elif role == "prefill":
            run_prefill(cfg, int(rank), workdir, rep)
            code = 0
        else:
            code = run_decode(cfg, int(rank), workdir, rep)
        rep.send("exit", code=code)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        return code
    except BaseException as e:
        rep.send("error", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        rep.close()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
