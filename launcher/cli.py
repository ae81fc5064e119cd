"""The `launch` command: `launch [CONFIG.yaml]` runs a deployment; `launch SUBCOMMAND ...` runs a tool.

Each subcommand lives in its own module exposing `register(subparsers)`; adding one is one line in
SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module that defines it (imported only when used, so `launch --help` stays fast)
SUBCOMMANDS: dict[str, str] = {
    "convert": "launcher.convert_cmd",
    "demo": "launcher.demo",
    "plan": "launcher.plan_cmd",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch",
        description="Place and run DeepSeek-V3-architecture MoE models. With no arguments: a local demo.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if only is None or only == name:
            importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["demo"]
    parser = build_parser(argv[0] if argv[0] in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        # User-caused errors (bad paths, configs, checkpoints) carry a message that names the fix.
        print(f"launch {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
