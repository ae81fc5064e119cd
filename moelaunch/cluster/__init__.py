"""Where processes run: Ray, torchrun-style rendezvous, Slurm, local processes."""
