"""``fkv show``: print a spec (shapes, stride order, strides, page bytes) and its einops patterns."""

from __future__ import annotations

import argparse

from fkv.cli import positive_int
from fkv.errors import FkvError
from fkv.layout import BACKENDS, DTYPE_ALIASES, DTYPES, KVCacheSpec, Layout, rearrange_pattern


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("show", help="print a KV-cache spec and its patterns to every other layout",
                       description="Print a spec's logical shape, stride order, physical shape, "
                       "page bytes and element strides, and the einops pattern to every other "
                       "layout of the same geometry.")
    p.add_argument("--backend", default="triton", choices=BACKENDS, help="(default triton)")
    p.add_argument("--layout", default="NHD", help="NHD, HND or an alias (LBNHC, LBHNC, ...; default NHD)")
    p.add_argument("--blocks", type=positive_int, default=32768, help="num_blocks (default 32768)")
    p.add_argument("--block-size", type=positive_int, default=16,
                   help="tokens per block (default 16)")
    p.add_argument("--heads", type=positive_int, default=8,
                   help="KV heads held by this rank (default 8)")
    p.add_argument("--head-size", type=positive_int, default=128, help="(default 128)")
    p.add_argument("--dtype", default="bfloat16", choices=(*DTYPES, *DTYPE_ALIASES),
                   help="(default bfloat16; the engine names fp8, fp8_e4m3, fp8_e5m2, fp8_inc "
                        "too)")
    p.add_argument("--layers", type=positive_int, default=1, help="num_layers (default 1)")
    p.add_argument("--cross-layer", action="store_true",
                   help="one buffer for all layers (cross_layer=True)")
    return p


def _all_layouts(spec: KVCacheSpec) -> list[KVCacheSpec]:
    out = []
    for backend in BACKENDS:
        if (backend == "mla") != spec.is_mla:
            continue
        for layout in (Layout.NHD,) if backend == "mla" else tuple(Layout):
            for cross in (False, True):
                other = spec.evolve(backend=backend, layout=layout, cross_layer=cross)
                if other != spec and other not in out:
                    out.append(other)
    return out


def _label(spec: KVCacheSpec) -> str:
    label = spec.backend if spec.is_mla else f"{spec.backend} {spec.layout.value}"
    return label + (" + layers" if spec.cross_layer else "")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        spec = KVCacheSpec(backend=args.backend, layout=args.layout, num_blocks=args.blocks,
                           block_size=args.block_size, num_kv_heads=args.heads,
                           head_size=args.head_size, dtype=args.dtype, num_layers=args.layers,
                           cross_layer=args.cross_layer)
    except FkvError as e:  # a usage error: on stderr, as argparse's own and the other commands'
        Console(stderr=True).print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    console.print(repr(spec), highlight=False, soft_wrap=True)
    info = Table(show_header=False)
    info.add_column(style="bold")
    info.add_column()
    for key, value in (
        ("logical axes", " ".join(spec.logical_axes)),
        ("logical shape", str(spec.logical_shape)),
        ("stride order", str(spec.stride_order)),
        ("physical axes", " ".join(spec.physical_axes)),
        ("physical shape", str(spec.physical_shape)),
        ("strides (elements)", str(spec.element_strides)),
        ("page bytes", f"{spec.page_bytes:,}"),
        ("regions", f"{spec.num_regions} × {spec.region_bytes:,} B"),
    ):
        info.add_row(key, value)
    console.print(info, highlight=False)
    patterns = Table(title="einops patterns to every other layout of this geometry",
                     title_justify="left")
    patterns.add_column("to")
    patterns.add_column("rearrange_pattern(this, to)")
    for other in _all_layouts(spec):
        patterns.add_row(_label(other), rearrange_pattern(spec, other))
    console.print(patterns, highlight=False)
    return 0
