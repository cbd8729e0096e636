"""Image references for Enroot and Pyxis, the Python twin of containers/lib.sh.

The topology presets' ``[container]`` tables name images the Docker way
(``ghcr.io/nvidia/jax:jax-2026-06-27``); Enroot and Pyxis want the registry split off with
``#`` (``ghcr.io#nvidia/jax:jax-2026-06-27``), otherwise they look the whole name up on Docker
Hub. A launcher passes ``pyxis_image(ref)`` to ``srun --container-image`` (or the path of a
``.sqsh`` made by containers/build.sh or containers/import.sh, which must start with / or ./).
"""

from __future__ import annotations

import re

# Same pattern as IMAGE_RE in containers/lib.sh (tests/test_containers.py keeps them equal).
IMAGE_RE = (
    r"^([A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]+)?[/#])?[a-z0-9][a-z0-9._-]*"
    r"(/[a-z0-9][a-z0-9._-]*)*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$"
)


def validate_image(ref: str) -> bool:
    """Whether ``ref`` is a plain registry reference: no digest, spaces or shell characters."""
    return re.fullmatch(IMAGE_RE, ref) is not None and ref.count("#") <= 1


def pyxis_image(ref: str) -> str:
    """Docker-style ``ref`` -> Enroot/Pyxis form ``[REGISTRY#]IMAGE[:TAG]``."""
    if not validate_image(ref):
        raise ValueError(f"{ref!r} is not a plain image reference (registry/name:tag)")
    if "#" in ref or "/" not in ref:
        return ref
    first, rest = ref.split("/", 1)
    if first in ("docker.io", "index.docker.io"):
        return rest
    if "." in first or ":" in first or first == "localhost":
        return f"{first}#{rest}"
    return ref


def enroot_uri(ref: str) -> str:
    """The ``docker://`` URI ``enroot import`` takes for ``ref``."""
    return "docker://" + pyxis_image(ref)
