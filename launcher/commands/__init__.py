"""The `launch` subcommands, one module each: batch, bench, convert, eval, plan, slurm."""
