"""Slurm launcher for moe-train: submitit job rendering, container launch and the local CI cluster."""
