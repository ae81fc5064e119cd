"""`launch convert fp8-to-bf16 SRC DST` and `launch convert quantize-fp8 SRC DST`."""

from __future__ import annotations

import argparse

from moelaunch.model.convert import fp8_to_bf16, quantize_fp8

CONVERSIONS = {"fp8-to-bf16": fp8_to_bf16, "quantize-fp8": quantize_fp8}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint between block-FP8 and bf16")
    p.add_argument("kind", choices=sorted(CONVERSIONS), help="which conversion")
    p.add_argument("src", help="source Hugging Face checkpoint directory")
    p.add_argument("dst", help="destination directory (created)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = CONVERSIONS[args.kind](args.src, args.dst)
    print(f"wrote {out}")
    return 0
