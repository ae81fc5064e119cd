"""`launch convert KIND SRC DST`: fp8-to-bf16, quantize-fp8, quantize-int8, quantize-w8a8, quantize-int4."""

from __future__ import annotations

import argparse

from moelaunch import kernels
from moelaunch.launcher.commands import count
from moelaunch.tools.convert import fp8_to_bf16, quantize_fp8, quantize_int4, quantize_int8, quantize_w8a8

CONVERSIONS = {
    "fp8-to-bf16": fp8_to_bf16,
    "quantize-fp8": quantize_fp8,
    "quantize-int8": quantize_int8,
    "quantize-w8a8": quantize_w8a8,
    "quantize-int4": quantize_int4,
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint between bf16, block-FP8, int8 and int4")
    p.add_argument("kind", choices=sorted(CONVERSIONS), help="which conversion")
    p.add_argument("src", help="source Hugging Face checkpoint directory")
    p.add_argument("dst", help="destination directory (created)")
    p.add_argument(
        "--group-size",
        type=count,
        default=None,
        help=f"quantize-int4 only: input columns per scale and zero point, a multiple of 16 "
        f"(default {kernels.INT4_GROUP_SIZE})",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.group_size is None:
        out = CONVERSIONS[args.kind](args.src, args.dst)
    elif args.kind == "quantize-int4":
        out = quantize_int4(args.src, args.dst, args.group_size)
    else:
        raise ValueError(f"--group-size applies to quantize-int4 only, not {args.kind}")
    print(f"wrote {out}")
    return 0
