"""Install the kit into NVIDIA's JAX image without replacing the GPU stack the image ships.

The base image builds JAX, jaxlib, the CUDA plugin and Transformer Engine from source against
its own CUDA, cuDNN and NCCL. ``pip install -c requirements.lock .`` there would "fix" them
to the lock's PyPI wheels and break that stack, so the Dockerfile instead runs:

1. ``pins.py snapshot``      - record every distribution the base image has;
2. ``pins.py constraints``   - a constraints file: the protected stack (``PROTECTED``: JAX,
   jaxlib, CUDA plugins, Transformer Engine, nvidia-*/cuda-* wheels, and numpy/ml_dtypes that
   jaxlib is compiled against) pinned to the versions the base ships; every other package at
   its ``requirements.lock`` version, the versions the kit is tested with;
3. ``pins.py requirements``  - the kit's own dependencies (plus extras), protected names dropped;
4. ``pip install -c constraints -r requirements``, then the kit itself with ``--no-deps``;
5. ``pins.py verify``        - fail the build if pip changed or added a protected distribution
   after all (say, a PyPI jaxlib); other upgrades are listed, not fatal.

Stdlib only (it runs in the base image before anything is installed); Python >= 3.11.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

# The GPU stack the base image owns: never installed or replaced from PyPI.
PROTECTED = (
    "jax",
    "jaxlib",
    "jax-cuda*",
    "jax-plugin*",
    "transformer-engine*",
    "nvidia-*",
    "cuda-*",
    "cutlass*",
    "numpy",
    "ml-dtypes",
)
# Pure-Python packages that merely match a protected pattern.
UNPROTECTED = ("nvidia-ml-py",)

# PEP 440 version (public part plus optional local label), and a distribution name.
_VERSION = re.compile(
    r"^v?(\d+!)?\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?(\+[a-z0-9]+(\.[a-z0-9]+)*)?$", re.IGNORECASE
)
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


def normalize(name: str) -> str:
    """PEP 503 name: lowercase, runs of ``-_.`` become one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_protected(name: str) -> bool:
    """Whether ``name`` belongs to the base image's GPU stack."""
    n = normalize(name)
    if n in UNPROTECTED:
        return False
    return any(fnmatch.fnmatchcase(n, pat) for pat in PROTECTED)


def installed() -> dict[str, str]:
    """Normalized name -> version of every distribution on sys.path (first one wins)."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), dist.version)
    return found


def parse_lock(text: str) -> dict[str, str]:
    """Normalized name -> ``name==version`` line of a pip constraints/lock file."""
    pins: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _NAME.match(line)
        if m:
            pins[normalize(m.group(0))] = line
    return pins


def constraints(lock: dict[str, str], base: dict[str, str]) -> list[str]:
    """Constraint lines: protected base distributions at their own versions, lock pins else.

    A protected base version that is not PEP 440 cannot be written as a pin and is left out
    (``verify`` still guards it). Protected names are never taken from the lock: they must
    come from the base image, and ``verify`` fails the build if pip adds one.
    """
    lines = [
        f"{name}=={ver}" for name, ver in sorted(base.items()) if is_protected(name) and _VERSION.match(ver)
    ]
    lines += [line for name, line in sorted(lock.items()) if not is_protected(name)]
    return lines


def kit_requirements(pyproject: dict, extras: list[str]) -> list[str]:
    """The kit's dependencies (and those of ``extras``) minus the protected GPU stack."""
    project = pyproject["project"]
    reqs = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(
                f"pins.py: no extra {extra!r} in pyproject.toml; valid: {', '.join(sorted(optional))}"
            )
        reqs.extend(optional[extra])
    keep = []
    for req in reqs:
        m = _NAME.match(req.strip())
        if m and not is_protected(m.group(0)):
            keep.append(req.strip())
    return keep


def verify(before: dict[str, str], after: dict[str, str]) -> tuple[list[str], list[str]]:
    """(problems, notes): protected distributions changed, removed or added; other changes."""
    problems, notes = [], []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old == new or (old is None and not is_protected(name)):
            continue
        what = (
            f"{name} {old} from the base image was removed"
            if new is None
            else f"{name} {new} was installed, but the GPU stack must come from the base image"
            if old is None
            else f"{name} changed from the base image's {old} to {new}"
        )
        (problems if is_protected(name) else notes).append(what)
    return problems, notes


def main(argv: list[str] | None = None) -> int:
    """Command line: snapshot | constraints | requirements | verify (see the module doc)."""
    p = argparse.ArgumentParser(prog="pins.py", description=(__doc__ or "").partition("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("snapshot", help="print installed distributions as JSON")
    c = sub.add_parser("constraints", help="print the pip constraints file")
    c.add_argument("--lock", type=Path, required=True)
    r = sub.add_parser("requirements", help="print the kit's non-GPU-stack requirements")
    r.add_argument("--pyproject", type=Path, required=True)
    r.add_argument("--extra", action="append", default=[])
    v = sub.add_parser("verify", help="compare with a snapshot; exit 1 on a problem")
    v.add_argument("--before", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "snapshot":
        print(json.dumps(installed(), indent=1, sort_keys=True))
    elif args.cmd == "constraints":
        print("\n".join(constraints(parse_lock(args.lock.read_text()), installed())))
    elif args.cmd == "requirements":
        with args.pyproject.open("rb") as f:
            print("\n".join(kit_requirements(tomllib.load(f), args.extra)))
    else:
        problems, notes = verify(json.loads(args.before.read_text()), installed())
        for line in notes:
            print(f"pins.py: note: {line} (requirements.lock)")
        for line in problems:
            print(f"pins.py: error: {line}", file=sys.stderr)
        if problems:
            return 1
        print("pins.py: the base image's GPU stack is unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
