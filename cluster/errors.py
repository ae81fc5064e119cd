"""The one error type the cluster backends raise for problems a user can fix (a missing node, a dead
rank, mismatched versions): its message names what is wrong and what to do."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """The cluster cannot run (or keep running) the deployment; the message says why and the fix."""
