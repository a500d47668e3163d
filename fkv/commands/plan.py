"""``fkv plan --local K=V,... --remote K=V,...``: run the pure handshake and print the plan.

Keys (both sides): ``tp``, ``rank``, ``heads`` (total KV heads of the model), ``head_size``,
``block_size``, ``layout``, ``backend``, ``dtype``, ``layers``, ``cross_layer``, ``model``,
``num_blocks``, and for experiments ``kv_heads`` (heads this rank holds; default
``max(1, heads // tp)``), ``model_dtype``, ``protocol``, ``engine`` (engine id).

Prints ``Accept`` with ``plan.describe()`` and a table of the first rows of an example request, or
every reason of the ``Reject``. Exit status: 0 accept, 3 reject, 2 usage.

    fkv plan --local tp=2,rank=1 --remote tp=1          # docs/handshake.md worked example A, D rank 1
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fkv.errors import FkvError

__all__ = ["KEYS", "add_parser", "parse_side", "run"]

# key -> (type, default); None default = derived (see parse_side)
KEYS: dict[str, tuple[type, Any]] = {
    "tp": (int, 1), "rank": (int, 0), "heads": (int, None), "head_size": (int, None),
    "block_size": (int, 16), "layout": (str, "HND"), "backend": (str, "triton"),
    "dtype": (str, "bfloat16"), "layers": (int, 1), "cross_layer": (bool, False), "model": (str, ""),
    "num_blocks": (int, 1024), "kv_heads": (int, None), "model_dtype": (str, ""),
    "protocol": (int, None), "engine": (str, None),
}
# int keys that must be >= 1 (the rest: rank >= 0, protocol any)
_POSITIVE = ("tp", "heads", "head_size", "block_size", "layers", "num_blocks", "kv_heads")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="check a prefill/decode pair and print the transfer plan",
        description="Run the pure handshake between a decode rank (--local) and a prefill engine "
        "(--remote) and print the plan, or every reason it is rejected. Keys: "
        + ", ".join(KEYS) + ". Exit 0 accept, 3 reject, 2 usage.",
        epilog="example: fkv plan --local tp=2,rank=1,layout=HND --remote tp=1,layout=HND")
    p.add_argument("--local", required=True, metavar="K=V,...", help="the reading (decode) rank")
    p.add_argument("--remote", required=True, metavar="K=V,...", help="the prefill engine (rank 0)")
    p.add_argument("--strategy", default="auto", choices=("auto", "direct", "staging"),
                   help="the plan's strategy (default auto: the handshake picks)")
    p.add_argument("--blocks", type=int, default=4, help="remote blocks in the example request (default 4)")
    p.add_argument("--rows", type=int, default=12, help="rows of the example to print (default 12)")
    return p


def parse_side(name: str, text: str) -> tuple[Any, Any]:
    """``"tp=2,rank=1,layout=NHD"`` -> ``(EngineDesc, KVCacheSpec)``; FkvError on bad input."""
    from fkv.connector.handshake import PROTOCOL_VERSION, EngineDesc
    from fkv.layout import KVCacheSpec

    values: dict[str, Any] = {}
    given: dict[str, str] = {}  # key -> the item that gave it
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise FkvError(f"--{name}: {item!r} must be KEY=VALUE")
        if key not in KEYS:
            raise FkvError(f"--{name}: unknown key {key!r}; keys are {', '.join(KEYS)}")
        if key in given:
            raise FkvError(f"--{name}: key {key!r} given twice ({given[key]}, then {item}); "
                           f"give each key once")
        given[key] = item
        kind, raw = KEYS[key][0], raw.strip()
        if kind is int:
            try:
                values[key] = int(raw)
            except ValueError:
                raise FkvError(f"--{name}: {key}={raw!r} must be an integer") from None
            least = 1 if key in _POSITIVE else 0 if key == "rank" else None
            if least is not None and values[key] < least:
                raise FkvError(f"--{name}: {key}={values[key]} must be "
                               f"{'a positive' if least else 'a non-negative'} integer")
        elif kind is bool:
            if raw.lower() not in _TRUE + _FALSE:
                raise FkvError(f"--{name}: {key}={raw!r} must be true or false")
            values[key] = raw.lower() in _TRUE
        elif not raw and KEYS[key][1] != "":
            raise FkvError(f"--{name}: {key}= must have a value (drop the key for its default)")
        else:
            values[key] = raw
    v = {k: d for k, (_, d) in KEYS.items()} | values
    if v["rank"] >= v["tp"]:
        raise FkvError(f"--{name}: rank={v['rank']} must be below tp={v['tp']} (ranks 0.."
                       f"{v['tp'] - 1})")
    mla = v["backend"] == "mla"
    heads = v["heads"] if v["heads"] is not None else (1 if mla else 8)
    try:
        engine = EngineDesc(
            engine_id=(v["engine"] if v["engine"] is not None
                       else "decode" if name == "local" else "prefill"),
            tp_size=v["tp"], tp_rank=v["rank"], total_num_kv_heads=heads, model=v["model"],
            model_dtype=v["model_dtype"],
            protocol=PROTOCOL_VERSION if v["protocol"] is None else v["protocol"])
        spec = KVCacheSpec(
            backend=v["backend"], layout=v["layout"], num_blocks=v["num_blocks"],
            block_size=v["block_size"],
            num_kv_heads=(v["kv_heads"] if v["kv_heads"] is not None
                          else 1 if mla else max(1, heads // max(1, v["tp"]))),
            head_size=v["head_size"] if v["head_size"] is not None else 576 if mla else 128,
            dtype=v["dtype"],
            num_layers=v["layers"], cross_layer=v["cross_layer"])
    except FkvError as e:
        raise FkvError(f"--{name}: {e}") from None
    return engine, spec


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from fkv.connector.handshake import Accept, handshake

    out, err = Console(soft_wrap=True, highlight=False), Console(stderr=True, highlight=False)
    try:
        local, remote = parse_side("local", args.local), parse_side("remote", args.remote)
        if args.blocks < 1 or args.rows < 0:
            raise FkvError(f"--blocks must be >= 1 and --rows >= 0 (got {args.blocks}, {args.rows})")
    except FkvError as e:
        err.print(f"[bold red]error:[/] {e}", soft_wrap=True)
        return 2
    result = handshake(local, remote, strategy=args.strategy)
    if not isinstance(result, Accept):
        out.print(f"[bold red]Reject[/]: {len(result.reasons)} reason"
                  f"{'s' if len(result.reasons) != 1 else ''}")
        for r in result.reasons:
            out.print(f"  - [bold]{r.path}[/] ({r.code}): {r.message}; local {r.local!r}, "
                      f"remote {r.remote!r}\n    fix: {r.fix}")
        return 3
    plan = result.plan
    out.print("[bold green]Accept[/]")
    out.print(plan.describe())
    n_l, n_r = plan.local_spec.block_size, plan.remote_spec.block_size
    blocks = min(args.blocks, plan.remote_spec.num_blocks)
    tokens = min(blocks * n_r, plan.local_spec.num_blocks * n_l)
    local_ids, remote_ids = range(-(-tokens // n_l)), range(-(-tokens // n_r))
    rows = plan.segments(local_ids, remote_ids)
    table = Table(title=f"example request: {tokens} tokens, remote blocks 0..{len(remote_ids) - 1} "
                  f"-> local blocks 0..{len(local_ids) - 1}: {len(rows)} rows, "
                  f"{int(rows[:, 5].sum())} B", title_justify="left")
    for col in ("remote\nrank", "remote\nregion", "remote\noffset", "local\nregion", "local\noffset",
                "\nnbytes"):
        table.add_column(col, justify="right")
    for row in rows[:args.rows].tolist():
        table.add_row(*(str(x) for x in row))
    if len(rows) > args.rows:
        table.caption = f"... {len(rows) - args.rows} more rows"
    out.print(table)
    for step in plan.staging_steps(local_ids, remote_ids):
        out.print(f"move: staging[{step.remote_index}] (+{step.stage_offset} B) layer {step.layer} "
                  f"heads {step.src_heads} -> local heads {step.dst_heads}, "
                  f"{step.num_tokens} tokens")
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="fkv")
    add_parser(parser.add_subparsers()).set_defaults(_run=run)
    ns = parser.parse_args(["plan", *sys.argv[1:]])
    raise SystemExit(ns._run(ns))
