"""Slurm: the sbatch script that brings Ray up over an allocation and runs the deployment on it."""
