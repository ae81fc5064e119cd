"""A non-zero rank of a multi-process engine: `python -m moelaunch.engine.worker SPEC_JSON`, started
with the torchrun env contract; builds the same engine as rank 0 and follows its commands."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from moelaunch.cluster.errors import is_peer_failure
from moelaunch.cluster.local import PEER_FAILED_EXIT
from moelaunch.engine.build import EngineSpec, build_engine


def main(spec_json: str) -> int:
    try:
        build_engine(EngineSpec.from_json(spec_json)).worker_loop()
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        # Quietly (rank 0 names the rank at fault, once), and without the interpreter's teardown: a
        # process group that cannot be destroyed cleanly aborts it, which would hide this exit code.
        sys.stderr.flush()
        os._exit(PEER_FAILED_EXIT)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
