"""Shared test setup: fake CPU devices, a persistent compilation cache, the groups that let
``make test`` spread the suite over every core (pytest-xdist, ``--dist loadgroup``), and the
fixtures several test modules use (a trained tokenizer, cluster presets, the local Slurm
cluster). Plain helpers (tiny configs, metrics, command lines, corpora) are in helpers.py.

Devices and cache are set before any test touches a JAX backend. The cache only skips
recompiling the same programs (it is keyed on the compiled HLO); it never changes results.
"""

import ast
import functools
import os
import signal
import tempfile
from pathlib import Path

import jax
import pytest

# submitit configures logging as it is imported (logging.config.dictConfig), which closes every
# handler registered before it. absl's (imported with orbax, flax and optax) writes to the
# capture file pytest held in sys.stderr at collection, and closing it broke the capture of
# every later test in that process (test_slurm_submit's in-process tests after
# test_eval_cli's, with -n 0). Imported here, before any test module, it closes nothing of
# pytest's. (The trainer's own process is safe: absl never closes the sys.stderr it writes to.)
import submitit  # noqa: F401

CACHE_DIR = Path(
    os.environ.get("MOE_TRAIN_TEST_JAX_CACHE", Path(tempfile.gettempdir()) / "moe_train_test_jax_cache")
)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE_DIR))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# the launcher's XLA:GPU preflight compile (moe_train/planner/preflight.py) takes minutes per job: off for
# the suite, on in tests/test_submit_compile.py
os.environ.setdefault("MOE_TRAIN_COMPILE", "0")

# A suite started in the background by a non-interactive shell (`make test &`, nohup) inherits
# SIGINT ignored, and so would every child it starts: the Ctrl-C tests (test_interrupt,
# test_entry_points) would see their signal dropped. A handler set here is not inherited
# across exec, so the children start with SIGINT's default and install their own.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

# Modules whose tests start several processes (Slurm jobs on the local cluster's few cores,
# jax.distributed peers): one worker runs them one after another, as a serial run would.
PROCESS_MODULES = frozenset(
    {
        "test_slurm_cluster",
        "test_slurm_submit",
        "test_multiprocess",
        "test_faults",
        "test_distributed",
        "test_interrupt",
    }
)
SHARED_SCOPES = frozenset({"module", "package", "session"})


@functools.cache
def defines_a_shared_fixture(path: Path) -> bool:
    """Whether the test module at ``path`` defines a module-or-wider fixture (a compiled run, a
    converted checkpoint): its tests then share one worker, which builds the fixture once."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return any(
        _name(c.func) == "fixture"
        and any(
            k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value in SHARED_SCOPES
            for k in c.keywords
        )
        for c in calls
    )


def _name(func: ast.expr) -> str | None:
    """``fixture`` for ``pytest.fixture`` and ``fixture`` alike."""
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def group_of(nodeid: str, root: Path) -> str:
    """The work unit of a test under ``--dist loadgroup``: the tests of one unit run on one
    worker, one after another. The process modules form one unit, a module that defines a
    shared fixture another; every other test is a unit of its own."""
    path = nodeid.split("::", 1)[0]
    if Path(path).stem in PROCESS_MODULES:
        return "processes"
    return path if defines_a_shared_fixture(root / path) else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` with the units of ``group_of``. xdist's own loadgroup reads
    ``xdist_group`` marks by rewriting node ids, which pytest 9.2's structured node ids ignore
    (pytest-dev/pytest-xdist#1386): every test was scheduled alone, so Slurm jobs raced each
    other for the cluster's cores and both workers built the same compiled fixtures."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    root = config.rootpath

    class Units(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid, root)

    return Units(config, log)


# --------------------------------------------------------------------------- shared fixtures
# (read-only things several test modules use; the plain helpers are in helpers.py)


@pytest.fixture(scope="session")
def bpe(tmp_path_factory) -> Path:
    """Byte-level BPE (lossless) with ``</s>`` among its special tokens."""
    from helpers import train_bpe

    return train_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer.json", ["<unk>", "</s>"])


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory) -> Path:
    """SentencePiece BPE, identity normalisation and byte fallback: lossless on any text."""
    import sentencepiece
    from helpers import CORPUS

    folder = tmp_path_factory.mktemp("spm")
    (folder / "train.txt").write_text(CORPUS.read_text(encoding="utf-8")[:150_000])
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "train.txt"),
        model_prefix=str(folder / "spm"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        minloglevel=2,
    )
    return folder / "spm.model"


@pytest.fixture(scope="session")
def h100():
    """The h100-dgx cluster preset."""
    from topology import presets

    return presets.load("h100-dgx")


@pytest.fixture(scope="session")
def gb200():
    """The gb200-nvl72 cluster preset."""
    from topology import presets

    return presets.load("gb200-nvl72")


@pytest.fixture(scope="session")
def slurm_cluster():
    """Skip the test unless the local Slurm cluster answers and its node can run jobs."""
    import shutil
    import subprocess

    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        pytest.skip(
            "Slurm is not installed (no sinfo/sbatch on PATH); "
            "start the local cluster as root: bash slurm/local_cluster.sh start"
        )
    script = Path(__file__).resolve().parent.parent / "slurm" / "local_cluster.sh"
    try:
        r = subprocess.run(["bash", str(script), "status"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.skip("`slurm/local_cluster.sh status` did not answer within 30 s")
    if r.returncode != 0:
        why = (r.stdout + r.stderr).strip() or f"exit code {r.returncode}"
        pytest.skip(
            f"the local Slurm cluster is not running ({why}); "
            "start it as root: bash slurm/local_cluster.sh start"
        )
