"""``fkv demo``: prefill on TP=a, NIXL hand-off to TP=b, decode, and a check against one process.

Exit codes: 0 the decode output matches the single-process reference, 1 it diverged (or a rank
failed), 2 usage error, 3 fkv refused the pairing (every reason printed, nothing started).
"""

from __future__ import annotations

import argparse
import os

from fkv.cli import output_file, positive_float, positive_int
from fkv.layout import BACKENDS


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo", help="prefill -> NIXL -> decode end to end, checked against one process",
        description="Run a small transformer (random weights, fixed seed) with its prompt "
        "prefilled on a TP=a engine, the request's KV cache read over NIXL by a TP=b decode engine "
        "(any layouts and block sizes), greedy decoding there, and the tokens, logits and "
        "transferred KV checked against the same model in one process. Exit 0 when they match, "
        "1 when they diverge, 3 when fkv refuses the pairing.")
    p.add_argument("--prefill-tp", type=positive_int, default=1, help="prefill ranks (default 1)")
    p.add_argument("--decode-tp", type=positive_int, default=2, help="decode ranks (default 2)")
    p.add_argument("--prefill-layout", default="HND", help="NHD, HND or an alias (default HND)")
    p.add_argument("--decode-layout", default="HND", help="NHD, HND or an alias (default HND)")
    p.add_argument("--backend", default="triton", choices=[b for b in BACKENDS if b != "mla"],
                   help="cache backend layout family of both engines (default triton)")
    p.add_argument("--prefill-block-size", type=positive_int, default=16,
                   help="tokens per prefill block (default 16)")
    p.add_argument("--decode-block-size", type=positive_int, default=16,
                   help="tokens per decode block (default 16)")
    p.add_argument("--tokens", type=positive_int, default=64, help="prompt length (default 64)")
    p.add_argument("--new-tokens", type=positive_int, default=16, help="tokens to generate (default 16)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu runs the Triton kernels in the interpreter (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="KV cache dtype (the model computes in float32; default float32)")
    p.add_argument("--decode-head-size", type=positive_int, default=None, metavar="N",
                   help="give the decode engine another head size: a pairing fkv refuses (exit 3)")
    p.add_argument("--corrupt", action="store_true",
                   help="damage one received KV value to show the check catches it (exit 1)")
    p.add_argument("--stream", action="store_true",
                   help="the decode ranks read each layer as soon as the prefill publishes it "
                   "(reading starts before the forward); the summary compares the time from the "
                   "prefill's last layer to the complete KV with a non-streamed read of the "
                   "same KV")
    p.add_argument("--same-host-copies", action="store_true",
                   help="on CPU, let the decode ranks copy the prefill caches themselves "
                   "(process_vm_readv) instead of NIXL READs, as fkv.connector.connect does by "
                   "default on one host (the demo shows NIXL moving the bytes unless this is "
                   "given)")
    p.add_argument("--seed", type=int, default=0, help="weights, prompt and block tables (default 0)")
    p.add_argument("--timeout", type=positive_float, default=600.0,
                   help="seconds for the whole run, > 0 (default 600)")
    p.add_argument("--json", metavar="PATH", type=output_file,
                   help="also write the summary as JSON, in an existing folder")
    return p


def run(args: argparse.Namespace) -> int:
    if args.device == "cpu":
        # The children inherit this before they import triton (kernels run in the interpreter).
        os.environ["TRITON_INTERPRET"] = "1"
    from rich.console import Console

    from fkv.demo.config import DemoConfig
    from fkv.demo.run import run_demo
    from fkv.errors import FkvError

    console = Console()
    try:
        cfg = DemoConfig(prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                         prefill_layout=args.prefill_layout, decode_layout=args.decode_layout,
                         backend=args.backend, prefill_block_size=args.prefill_block_size,
                         decode_block_size=args.decode_block_size, tokens=args.tokens,
                         new_tokens=args.new_tokens, device=args.device, dtype=args.dtype,
                         decode_head_size=args.decode_head_size, corrupt=args.corrupt,
                         seed=args.seed, timeout=args.timeout, stream=args.stream,
                         same_host_copies=args.same_host_copies)
        cfg.spec("prefill"), cfg.spec("decode")  # validates layouts and sizes
        for flag, tp in (("--prefill-tp", cfg.prefill_tp), ("--decode-tp", cfg.decode_tp)):
            # Beyond 16 the handshake accepts multiples of the 8 KV heads (24, 32, ...) that the
            # model's query heads cannot be split into: every rank would start, then fail.
            if tp > cfg.model.num_q_heads:
                raise FkvError(f"argument {flag}: must be at most {cfg.model.num_q_heads}, the "
                               f"demo model's query heads (got {tp})")
    except FkvError as e:
        Console(stderr=True).print(f"[red]fkv demo: error: {e}[/]")
        return 2
    return run_demo(cfg, console=console, json_path=args.json)
