"""convert to-hf's staging of a scanned run's stacked leaves (``to_hf.stage``): the leaf comes
back exactly, read one stored chunk at a time, so the exporter never holds every layer."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_train.convert.to_hf import stage

ROOT = Path(__file__).resolve().parents[1]
LEAF = ("params", "moe_layers", "w")


def save_sharded(path: Path, x: np.ndarray) -> None:
    """``x`` saved by orbax as a run saves it: split over 8 devices on its expert axis."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("expert",))
    on_devices = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(None, "expert")))
    ocp.PyTreeCheckpointer().save(path.absolute(), {"params": {"moe_layers": {"w": on_devices}}})


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_staged_leaf_equals_the_saved_one(tmp_path, dtype):
    x = np.random.default_rng(0).standard_normal((3, 8, 5, 6)).astype(dtype)
    save_sharded(tmp_path / "ckpt", x)
    got = stage((tmp_path / "ckpt").absolute(), LEAF, tmp_path / "leaf.bin")
    assert got.dtype == x.dtype and np.array_equal(got, x)


def test_staged_leaf_is_a_read_only_memory_map(tmp_path):
    save_sharded(tmp_path / "ckpt", np.zeros((2, 8, 3, 4), np.float32))
    got = stage((tmp_path / "ckpt").absolute(), LEAF, tmp_path / "leaf.bin")
    assert isinstance(got, np.memmap) and not got.flags.writeable


STAGE_MEMORY = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import sys, threading, time
from pathlib import Path
import numpy as np
sys.path.insert(0, "tests")
from test_to_hf_stage import LEAF, save_sharded
from moe_train.convert.to_hf import stage

d = Path(sys.argv[1])
save_sharded(d / "small", np.ones((2, 8, 4, 4), np.float32))
save_sharded(d / "big", np.ones((8, 8, 1024, 1024), np.float32))
stage((d / "small").absolute(), LEAF, d / "small.bin")  # TensorStore's pools, once

def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("RssAnon")][0].split()[1]) * 1024

peak = [0]
def watch():
    while True:
        peak[0] = max(peak[0], rss()); time.sleep(0.002)

base = rss(); threading.Thread(target=watch, daemon=True).start()
stage((d / "big").absolute(), LEAF, d / "big.bin")
time.sleep(0.05)
print(peak[0] - base)
"""


@pytest.mark.slow
def test_staging_holds_a_chunk_not_the_stacked_leaf(tmp_path):
    """256 MiB stacked leaf in 8 chunks of 32 MiB: anonymous memory grows by about a chunk
    plus orbax's 100 MB OCDBT cache pool (measured 83 MB), not by the leaf."""
    out = subprocess.run(
        [sys.executable, "-c", STAGE_MEMORY, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    grown = int(out.stdout.split()[-1])
    assert grown < 0.5 * (8 * 8 * 1024 * 1024 * 4), grown
