"""Sharded execution: device mesh, tensor/expert/data/pipeline parallel layers."""
