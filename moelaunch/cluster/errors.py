"""The one error type the cluster backends raise for problems a user can fix (a missing node, a dead
rank, mismatched versions): its message names what is wrong and what to do."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """The cluster cannot run (or keep running) the deployment; the message says why and the fix."""


def is_peer_failure(error: BaseException) -> bool:
    """Whether a collective failed because another rank died or did not answer in time: gloo raises
    plain RuntimeErrors from its transport, NCCL raises DistErrors."""
    import torch.distributed as dist  # here: the rest of this module is needed without torch

    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "/gloo/" in str(error))
