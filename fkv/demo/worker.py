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
from fkv.demo.config import PLAIN_REQUEST_ID, REQUEST_ID, DemoConfig


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


def _serve(torch: Any, cfg: DemoConfig, rank: int, spec: Any, caches: list[Any]) -> Any:
    """This rank's server (rank 0 binds; the others join the address it broadcasts)."""
    import fkv.connector

    tp = cfg.prefill_tp
    engine = cfg.engine("prefill", rank)
    if rank == 0:
        server = fkv.connector.serve(engine, spec, caches)
        _broadcast_str(torch, server.address, rank, tp)
        return server
    join = _broadcast_str(torch, "", rank, tp)
    return fkv.connector.serve(engine, spec, caches, join=join)


def _wait_freed(cfg: DemoConfig, rank: int, server: Any, request_ids: tuple[str, ...]) -> None:
    deadline = time.monotonic() + cfg.timeout
    parent = os.getppid()
    while any(r in server.pending() for r in request_ids):
        if os.getppid() != parent:
            raise RuntimeError(f"prefill rank {rank}: the demo's parent process went away")
        if time.monotonic() > deadline:
            raise TimeoutError(f"prefill rank {rank}: {request_ids[0]!r} still pending after "
                               f"{cfg.timeout} s (decode ranks never notified)")
        time.sleep(0.01)


def run_prefill(cfg: DemoConfig, rank: int, workdir: str, rep: Reporter) -> None:
    torch = _setup(cfg)
    from fkv.demo.model import DemoModel, PagedKV

    tp = cfg.prefill_tp
    device = _device(torch, cfg, rank)
    model = DemoModel(cfg.model, tp=tp, rank=rank, device=device,
                      all_gather=_group(torch, workdir, "prefill", rank, tp))
    spec = cfg.spec("prefill")
    caches = _poisoned_caches(torch, spec, device)
    kv = PagedKV(caches, spec, cfg.block_ids("prefill"))
    prompt = torch.tensor(cfg.prompt(), device=device)
    if cfg.stream:
        _prefill_streamed(torch, cfg, rank, model, kv, spec, caches, prompt, rep)
        return
    t0 = time.perf_counter()
    logits = model.forward(prompt, torch.arange(cfg.tokens, device=device), kv,
                           on_layer=lambda i: rep.send("layer", layer=i))[-1]
    rep.send("prefilled", token=int(logits.argmax()), logits=pack_array(logits.float()),
             seconds=time.perf_counter() - t0)
    server = _serve(torch, cfg, rank, spec, caches)
    with server:
        server.hold(REQUEST_ID, cfg.block_ids("prefill"))
        rep.send("serving", address=server.address)
        _wait_freed(cfg, rank, server, (REQUEST_ID,))
        rep.send("freed")


def _prefill_streamed(torch: Any, cfg: DemoConfig, rank: int, model: Any, kv: Any, spec: Any,
                      caches: list[Any], prompt: Any, rep: Reporter) -> None:
    """--stream: serve and hold the request (no layer written) before the forward, wait for the
    go-ahead (every decode rank connected and reading), publish after each layer's write_kv.

    The same KV is also held fully written as PLAIN_REQUEST_ID (just before the last layer's
    publish, so it is held before any decode rank can finish the streamed read) for the
    non-streamed comparison read."""
    device = prompt.device
    L = cfg.model.num_layers
    blocks = cfg.block_ids("prefill")
    server = _serve(torch, cfg, rank, spec, caches)
    with server:
        server.hold(REQUEST_ID, blocks, layers_ready=0)
        rep.send("serving", address=server.address)
        json.loads(sys.stdin.readline())  # every decode rank is connected and reading
        published: list[float] = []
        cuda = device.type == "cuda"

        def on_layer(i: int) -> None:
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record()
            if i == L - 1:
                server.hold(PLAIN_REQUEST_ID, blocks)
            published.append(time.perf_counter())  # before publish: a reader sees it after this
            server.publish(REQUEST_ID, i + 1, event=event)
            rep.send("layer", layer=i)

        t0 = time.perf_counter()
        logits = model.forward(prompt, torch.arange(cfg.tokens, device=device), kv,
                               on_layer=on_layer)[-1]
        rep.send("prefilled", token=int(logits.argmax()), logits=pack_array(logits.float()),
                 seconds=time.perf_counter() - t0, forward_start=t0, published=published)
        _wait_freed(cfg, rank, server, (REQUEST_ID, PLAIN_REQUEST_ID))
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
    streamed: dict[str, Any] = {}
    with fkv.connector.connect(engine, spec, caches, remote_address=go["address"],
                               expected_engine=cfg.engine("prefill", 0).engine_id) as client:
        if cfg.stream:
            rep.send("connected")
            result, streamed = _read_streamed(torch, cfg, spec, caches, client)
        else:
            result = client.read(REQUEST_ID, local_ids[: cfg.decode_prompt_blocks()],
                                 cfg.block_ids("prefill"), timeout=cfg.timeout)
        stats = client.stats()
        moved_by = ("the ipc kernels" if result.strategy == "ipc" else "process_vm_readv"
                    if "process_vm_readv" in client.describe() else "NIXL")
    rep.send("transferred", ok=bool(result.ok), bytes=int(result.bytes),
             descriptors=int(result.descriptors), seconds=float(result.seconds),
             nixl_seconds=float(result.transfer_seconds), path=result.strategy,
             moved_by=moved_by,
             stats={"reads": stats["total"]["count"], "failures": stats["failures"],
                    "gbps": stats["total"]["gbps"].get("overall")},
             error=None if result.error is None else str(result.error), **streamed)
    if not result.ok or (cfg.stream and not streamed["plain"]["ok"]):
        return 1
    if cfg.stream:
        go = json.loads(sys.stdin.readline())  # the first token, once the prefill finished
    if cfg.corrupt and rank == 0:
        # --corrupt: damage one received value to show the verification catches it.
        # Token 5's K (the last token's, of a shorter prompt), head 0, channel 3 in layer 1 (a
        # view in canonical axis order).
        axes = spec.logical_axes
        canon = caches[1].permute(*[axes.index(a) for a in ("B", "N", "two", "H", "C")])
        n, tok = spec.block_size, min(5, cfg.tokens - 1)
        canon[local_ids[tok // n], tok % n, 0, 0, 3] += 1.0
    heads = head_ranges(cfg.model, tp, rank)[1]
    dump = torch.stack([token_major(c, spec, local_ids, num_tokens=cfg.tokens) for c in caches])
    rep.send("kv", heads=list(heads), kv=pack_array(dump.float()))
    _generate(torch, model, PagedKV(caches, spec, local_ids), cfg, int(go["first_token"]), rep,
              report=rank == 0)
    return 0


def _read_streamed(torch: Any, cfg: DemoConfig, spec: Any, caches: list[Any],
                   client: Any) -> tuple[Any, dict[str, Any]]:
    """--stream: the streamed read (started before the prefill's forward), then the same KV read
    non-streamed (PLAIN_REQUEST_ID, into other blocks). Times are perf_counter (CLOCK_MONOTONIC,
    comparable across the demo's processes): when each layer landed and when each read ended."""
    from fkv.testing import token_major

    local_ids, remote_ids = cfg.block_ids("decode"), cfg.block_ids("prefill")
    prompt_ids = local_ids[: cfg.decode_prompt_blocks()]
    result = client.read(REQUEST_ID, prompt_ids, remote_ids, timeout=cfg.timeout, stream=True)
    done = time.perf_counter()
    # The read's own start: not earlier than this (so no landing is placed before its publish).
    started = done - float(result.seconds)
    out: dict[str, Any] = {"stream": True, "completed": done,
                           "landed": [started + float(t) for t in result.layer_seconds],
                           "plain": {"ok": False, "seconds": None, "bytes": 0, "error": None},
                           "plain_equal": None}
    if not result.ok:
        return result, out
    plain_ids = cfg.plain_block_ids()
    t = time.perf_counter()
    plain = client.read(PLAIN_REQUEST_ID, plain_ids, remote_ids, timeout=cfg.timeout)
    out["plain"] = {"ok": bool(plain.ok), "seconds": float(plain.seconds),
                    "started": t, "completed": time.perf_counter(), "bytes": int(plain.bytes),
                    "error": None if plain.error is None else str(plain.error)}
    if plain.ok:
        out["plain_equal"] = all(
            torch.equal(token_major(c, spec, local_ids, num_tokens=cfg.tokens),
                        token_major(c, spec, plain_ids, num_tokens=cfg.tokens)) for c in caches)
    return result, out


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
