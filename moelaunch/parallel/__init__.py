"""Sharded execution; every tensor/expert/pipeline-parallel rule lives here.

mesh.py: the dp x pp x tp mesh and its groups; group.py: a group's collectives; layers.py: TP layers;
expert_parallel.py: expert placement and token dispatch; stages.py: layers per pipeline stage;
parallelize.py: one rank's shard (check, build, load); shard_tensors.py: what a rank holds, found without
starting anything (for `launch plan`).
"""
