"""Sharded execution; every tensor/expert/pipeline-parallel rule lives here.

mesh.py: the tp x dp x pp mesh, its groups and the pipeline's send/recv; group.py: a group's
collectives; layers.py: TP layers; expert_parallel.py: expert placement and the all-to-all expert
dispatcher; eplb.py: placements balanced from measured expert load; stages.py: layers per pipeline
stage; parallelize.py: one rank's shard (MeshShard, the model/sharding.py ModelShard the model is
built from) and its load; shard_tensors.py: what a rank holds, found without starting anything (for
`launch plan`).
"""
