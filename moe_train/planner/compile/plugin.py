"""The CUDA PJRT plugin: XLA:GPU's compiler, usable on a machine without a GPU.

``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at exactly jax's version (no CUDA libraries, no
driver needed to compile). ``make venv EXTRAS=...,compile`` (and ``make compile``) install them
into ``.venv/xla-gpu``, outside site-packages, on purpose: where jax finds the plugin on its
own, every jax process of the kit on a machine without CUDA prints the plugin's CUDA errors
and a traceback on stderr (measured: 6 lines on ``import jax``, 25 on ``jax.devices()``), which
breaks the kit's one-line errors. Only ``python -m moe_train.planner.compile`` puts that directory on
``sys.path``. A plugin installed into site-packages (``pip install -e '.[compile]'``, or a
GPU image's ``jax[cuda12]``) works too.

Loaded on a machine without CUDA, the plugin's libraries still log that they found no
driver (absl, before logging is set up, straight to file descriptor 2); ``quiet()`` drops
exactly those lines from stderr and passes every other line through, so the command's own
errors stay one line.

``enable()`` must run before jax is imported: it sets ``JAX_PLATFORMS=cpu`` (eager work stays
on the CPU; the GPU devices are simulated) and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (else the
plugin's start-up check fails without CUDA: "Unable to load CUDA").
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as metadata
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
MODULES = ("jax_cuda12_plugin", "jax_plugins.xla_cuda12")
DIR_NAME = "xla-gpu"  # under the virtualenv (sys.prefix)
NOISE = re.compile(
    rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called are "
    rb"written to STDERR|.*cudart_stub\.cc:\d+\] Could not find cuda drivers.*)$"
)


def side_dir() -> Path:
    """Where ``make`` installs the plugin: ``<virtualenv>/xla-gpu``."""
    return Path(sys.prefix) / DIR_NAME


def search_path() -> list[str]:
    """Where the compile command looks: ``side_dir()`` first, then ``sys.path``."""
    side = side_dir()
    return ([str(side)] if side.is_dir() else []) + [p for p in sys.path if p != str(side)]


def how_to_install(jax_version: str) -> str:
    return (
        f"make compile (or make venv EXTRAS=...,compile) installs jax-cuda12-plugin and "
        f"jax-cuda12-pjrt {jax_version} into {side_dir()}; or pip install -e '.[compile]'"
    )


def version_problem(path: list[str]) -> str | None:
    """Why the plugin's packages on ``path`` cannot compile for jax (None: they can)."""
    want = metadata.version("jax")
    for name in PACKAGES:
        found = [d.version for d in metadata.distributions(name=name, path=path)]
        if not found:
            return (
                f"XLA:GPU compile needs the CUDA PJRT plugin ({name} is not installed); "
                f"{how_to_install(want)}"
            )
        if found[0] != want:
            return f"{name} {found[0]} does not match jax {want}; {how_to_install(want)}"
    return None


def enable(xla_flags: str = "") -> str | None:
    """Put the plugin on ``sys.path`` and set the environment for a deviceless compile
    (``xla_flags``, the cluster preset's XLA_FLAGS, before any the caller set); import it.
    Returns None, or one line saying why it cannot be used and how to install it."""
    path = search_path()
    problem = version_problem(path)
    if problem:
        return problem
    side = str(side_dir())
    if side in path and side not in sys.path:
        sys.path.insert(0, side)
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # compile times are measured
    if xla_flags:
        os.environ["XLA_FLAGS"] = " ".join(f for f in (xla_flags, os.environ.get("XLA_FLAGS")) if f)
    for module in MODULES:
        try:
            importlib.import_module(module)
        except ImportError as err:
            return (
                f"XLA:GPU compile needs the CUDA PJRT plugin, which does not import "
                f"({module}: {err}); {how_to_install(metadata.version('jax'))}"
            )
    return None


@contextlib.contextmanager
def filtered_stderr(drop: Callable[[bytes], bool]) -> Iterator[None]:
    """While inside: file descriptor 2 (C++ logs included) without the lines ``drop`` takes
    (each without its newline); a thread pumps the rest through to the real stderr."""
    sys.stderr.flush()
    read, write = os.pipe()
    saved = os.dup(2)
    out = os.dup(saved)  # the pump's own copy of the real stderr
    os.dup2(write, 2)
    os.close(write)

    def pump() -> None:
        with os.fdopen(read, "rb") as src, os.fdopen(out, "wb", buffering=0) as dst:
            for line in src:
                if not drop(line.rstrip(b"\n")):
                    dst.write(line)

    thread = threading.Thread(target=pump, name="moe_train-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the pump reads to its end
        os.close(saved)
        thread.join()


def quiet():
    """While inside: stderr (file descriptor 2) without the plugin's no-driver lines."""
    return filtered_stderr(lambda line: bool(NOISE.match(line)))
