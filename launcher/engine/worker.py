"""A non-zero rank of a multi-process engine: `python -m moelaunch.launcher.engine.worker SPEC_JSON`, started
with the torchrun env contract; builds the same engine as rank 0 and follows its commands."""

from __future__ import annotations

import sys

import torch.distributed as dist

from moelaunch.launcher.engine.launch import EngineSpec, build_engine


def main(spec_json: str) -> int:
    engine = build_engine(EngineSpec.from_json(spec_json))
    try:
        engine.worker_loop()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
