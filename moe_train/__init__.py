"""moe_train: dropless Mixture-of-Experts language-model training in JAX.

``python -m moe_train...`` run by a Python without the kit's dependencies (a bare ``python``
outside the virtualenv) ends with one line naming the missing module and the command that
works (``.venv/bin/python -m ...``, or ``make venv`` first), exit 2, instead of a
``ModuleNotFoundError`` traceback from deep inside an import (``_install_hint``: an
exception hook, so an entry point that needs only some of the dependencies, e.g. the report,
still runs where those are installed). A missing module of the kit itself is a bug and keeps
its traceback.

``python_command()`` is how the kit writes "this interpreter" in the commands it prints (the
resume line, the report line): ``python`` when that is it on PATH (an activated virtualenv),
a path relative to the working directory when it lies below it (the repo's
``.venv/bin/python``), else its absolute path; every printed command then works as printed.
Standard library only: this runs before any dependency is imported.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

__version__ = "0.1.0"
_EXIT_CONFIG = 2
_REPO = Path(__file__).resolve().parent.parent
_KIT = ("moe_train", "topology", "slurm", "containers")  # a missing one of these is a bug


def python_command(executable: str | None = None, cwd: str | None = None) -> str:
    """This interpreter as a command a user can paste (see the module docstring)."""
    exe = os.path.abspath(executable or sys.executable)
    found = shutil.which("python")
    if found is not None and os.path.abspath(found) == exe:
        return "python"
    rel = os.path.relpath(exe, cwd or os.getcwd())
    if not rel.startswith(".."):
        return rel if os.sep in rel else os.path.join(".", rel)
    return exe


def _hint(module: str, missing: str, repo: Path = _REPO) -> str:
    """The one line for a ``python -m <module>`` whose interpreter lacks ``missing``."""
    venv_python = repo / ".venv" / "bin" / "python"
    command = f"{python_command(str(venv_python))} -m {module} {shlex.join(sys.argv[1:])}"
    how = (
        f"run it with the kit's virtualenv: {command.rstrip()}"
        if venv_python.exists()
        else f"create the kit's virtualenv with `make venv` (in {repo}), then run {command.rstrip()}"
    )
    return (
        f"error: python -m {module}: no module named {missing!r} in {sys.executable}, "
        f"which lacks the kit's dependencies; {how}"
    )


def _install_hint() -> None:
    """For ``python -m moe_train...``: an uncaught ModuleNotFoundError of a dependency prints
    ``_hint`` and exits 2; every other exception goes to the hook installed before."""
    orig = getattr(sys, "orig_argv", [])
    if "-m" not in orig[:-1]:
        return
    module = orig[orig.index("-m") + 1]
    if module.split(".")[0] != "moe_train":
        return
    previous = sys.excepthook

    def hook(kind, err, tb):
        missing = getattr(err, "name", None) or ""
        if issubclass(kind, ModuleNotFoundError) and missing and missing.split(".")[0] not in _KIT:
            sys.stdout.flush()
            print(_hint(module, missing), file=sys.stderr, flush=True)
            os._exit(_EXIT_CONFIG)  # after an excepthook Python itself would exit 1
        previous(kind, err, tb)

    sys.excepthook = hook


if sys.argv[:1] == ["-m"]:  # runpy sets "-m" while it imports the parents of the module
    _install_hint()
