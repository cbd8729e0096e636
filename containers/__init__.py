"""Container support: the image definition (Dockerfile), its build and Enroot import scripts,
the in-container node preflight (``python -m containers.preflight``) and image-reference
helpers for the Slurm launcher (``containers.images``)."""
