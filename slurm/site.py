"""Site settings for ``python -m slurm.submit``: what a cluster's users share but presets do not.

A site file is a small TOML file, found in this order: ``--site FILE``, ``$MOE_TRAIN_SITE``,
``~/.config/moe-train/site.toml`` (the last one only when it exists). Every key is optional;
command-line flags override the file::

    partition = "batch"            # sbatch --partition
    account = "my-project"         # sbatch --account
    qos = "normal"                 # sbatch --qos
    time = "04:00:00"              # default wall-clock limit ([D-]HH:MM:SS or minutes)
    image = "/shared/moe-train.sqsh"  # default container image (a .sqsh path or a registry ref)
    mounts = ["/datasets:/datasets:ro"]  # extra Pyxis mounts, src:dst[:flags]
    container_workdir = "/opt/moe-train"  # where the kit lives inside the image
    container_python = "python3"   # the image's Python
    max_requeues = 3               # requeues after preemption, timeout or a hung step

Unknown keys, values of the wrong type and numbers out of range are refused (exit 2, one line
naming the key) like everything else. The one number, ``max_requeues``, is an integer in
[0, 1000]: TOML's ``nan`` and ``inf`` are floats, refused as not an integer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from moe_train.base.tomlfile import read_toml

SITE_ENV = "MOE_TRAIN_SITE"
DEFAULT_SITE = Path("~/.config/moe-train/site.toml")
DEFAULT_WORKDIR = "/opt/moe-train"
DEFAULT_CONTAINER_PYTHON = "python3"
DEFAULT_MAX_REQUEUES = 3
MAX_REQUEUES = 1000  # a job requeued more often than this cannot run; a larger bound is a typo


class SiteError(ValueError):
    """A site file that cannot be read or has bad keys/values: one line, exit 2."""


@dataclass(frozen=True)
class Site:
    """Site-wide defaults for job submission; empty strings mean "not set"."""

    path: str = ""  # the file these settings came from; "" when no site file was used
    partition: str = ""  # sbatch --partition
    account: str = ""  # sbatch --account
    qos: str = ""  # sbatch --qos
    time: str = ""  # default wall-clock limit, e.g. "04:00:00"
    image: str = ""  # default container image: a .sqsh path or a registry reference
    mounts: tuple[str, ...] = ()  # extra container mounts, each "src:dst[:flags]"
    container_workdir: str = DEFAULT_WORKDIR  # the kit's directory inside the image
    container_python: str = DEFAULT_CONTAINER_PYTHON  # the Python interpreter inside the image
    max_requeues: int = DEFAULT_MAX_REQUEUES  # bound on requeues (preemption, timeout, hang)


_TYPES: dict[str, type] = {
    "partition": str,
    "account": str,
    "qos": str,
    "time": str,
    "image": str,
    "mounts": list,
    "container_workdir": str,
    "container_python": str,
    "max_requeues": int,
}


def find(flag: str | None, env: Mapping[str, str] | None = None, home: Path | None = None) -> Path | None:
    """The site file to use: the flag, else $MOE_TRAIN_SITE, else the default if it exists.

    A file named by the flag or the variable must exist; the default one is optional.
    """
    env = os.environ if env is None else env
    for where, value in (("--site", flag), (f"${SITE_ENV}", env.get(SITE_ENV))):
        if value:
            path = Path(value).expanduser()
            if not path.is_file():
                raise SiteError(f"site file {value!r} (from {where}) does not exist")
            return path
    default = (home / DEFAULT_SITE.relative_to("~")) if home else DEFAULT_SITE.expanduser()
    return default if default.is_file() else None


def load(path: Path | None) -> Site:
    """The validated settings in ``path``; ``Site()`` when ``path`` is None."""
    if path is None:
        return Site()
    return from_dict(read_toml(path, SiteError, what="site file "), str(path))


def from_dict(data: Mapping[str, Any], where: str) -> Site:
    """Check keys and types of a parsed site file."""
    valid = sorted(_TYPES)
    for key, value in data.items():
        if key not in _TYPES:
            raise SiteError(f"site file {where}: unknown key {key!r}; valid keys: {', '.join(valid)}")
        want = _TYPES[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise SiteError(f"site file {where}: {key} must be {want.__name__}, got {value!r}")
    mounts = data.get("mounts", [])
    if not all(isinstance(m, str) for m in mounts):
        raise SiteError(f'site file {where}: mounts must be a list of strings "src:dst[:flags]"')
    requeues = data.get("max_requeues", 0)
    if not 0 <= requeues <= MAX_REQUEUES:
        raise SiteError(f"site file {where}: max_requeues must be in [0, {MAX_REQUEUES}], got {requeues}")
    values = {f.name: data[f.name] for f in fields(Site) if f.name in data}
    values["mounts"] = tuple(mounts)
    return Site(path=where, **values)
