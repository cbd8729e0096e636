"""A run that cannot fit in the memory it has is refused before anything is initialised
(``moe_train.train.fits``): exit 2, one line naming the need and what fits, within seconds,
nothing written. ``MOE_TRAIN_HOST_MEMORY_BYTES`` shrinks the host's memory to show it at
toy scale (the issue's case: ``make train MODEL=mixtral-8x7b`` on a 24 GiB CPU machine)."""

import subprocess
import sys
import time

import jax
import pytest
from helpers import ROOT, one_error_line, train_cli

from moe_train import config
from moe_train.base.exits import EXIT_CONFIG
from moe_train.config import ConfigError
from moe_train.planner.memory import trainer as memory
from moe_train.train import fits

TINY_NEEDS = 23_200_000  # bytes: a little over the planner's estimate for tiny on one device (22.0 MiB)


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> tuple[subprocess.CompletedProcess, float, object]:
    """tiny, allowed 1 MB of host memory, into a new OUT: (the process, seconds, OUT)."""
    out = tmp_path_factory.mktemp("fits") / "new" / "run"
    t0 = time.monotonic()
    proc = train_cli(out, "--steps", "2", env={fits.HOST_ENV: "1000000"}, timeout=120)
    return proc, time.monotonic() - t0, out


def test_a_run_that_cannot_fit_exits_2_with_one_line(refused):
    proc, _, _ = refused
    assert proc.returncode == EXIT_CONFIG and "does not fit in memory" in one_error_line(proc.stderr)


def test_the_line_names_the_need_and_the_memory_the_run_has(refused):
    line = one_error_line(refused[0].stderr)
    assert "needs about 22.0 MiB per device" in line and f"{fits.HOST_ENV}=1000000 allows 1.0 MiB" in line


def test_the_line_says_how_to_plan_a_cluster_job(refused):
    assert "make plan MODEL=tiny PRESET=<cluster> NODES=<n>" in one_error_line(refused[0].stderr)


def test_the_refusal_comes_before_the_kernel_self_test_and_within_seconds(refused):
    proc, seconds, _ = refused
    assert proc.stdout == "" and seconds < 60, (seconds, proc.stdout)


def test_the_refusal_leaves_no_directory(refused):
    _, _, out = refused
    assert not out.parent.exists()


def test_a_smaller_preset_that_fits_is_named(monkeypatch):
    monkeypatch.setenv(fits.HOST_ENV, str(TINY_NEEDS))
    with pytest.raises(ConfigError, match=r"a smaller model: --preset tiny\b"):
        fits.check(config.build("small", []), jax.devices()[:1], "small", memory=memory)


def test_a_change_of_a_key_that_fits_is_named(monkeypatch):
    monkeypatch.setenv(fits.HOST_ENV, str(TINY_NEEDS * 3 // 4))
    with pytest.raises(ConfigError, match=r"--set train\.\w+="):
        fits.check(config.build("tiny", []), jax.devices()[:1], "tiny", memory=memory)


def test_the_local_devices_share_the_hosts_memory(monkeypatch):
    cfg = config.for_devices(config.build("tiny", ["parallel.devices=8"]), 8)
    est = memory.need(cfg, fits.cluster_for("cpu", "", 8), 8)
    assert est is not None
    per_device = est.per_device["total"]
    monkeypatch.setenv(fits.HOST_ENV, str(per_device * 4))  # one device's need 4 times, not 8
    with pytest.raises(ConfigError, match="for its 8 devices"):
        fits.check(cfg, jax.devices()[:8], "tiny", memory=memory)


def test_a_run_that_fits_passes(monkeypatch):
    monkeypatch.setenv(fits.HOST_ENV, str(TINY_NEEDS))
    assert fits.check(config.build("tiny", []), jax.devices()[:1], "tiny", memory=memory) is None


def test_without_the_planners_model_nothing_is_checked(monkeypatch):
    """The trainer core does not import the planner: a library call that passes no model runs."""
    monkeypatch.setenv(fits.HOST_ENV, str(TINY_NEEDS // 100))
    assert fits.check(config.build("tiny", []), jax.devices()[:1], "tiny") is None


def test_without_the_variable_the_hosts_available_memory_counts(monkeypatch):
    monkeypatch.delenv(fits.HOST_ENV, raising=False)
    have = fits.available("cpu", jax.devices()[:1])
    assert have is not None and have.bytes > 0 and "this host has" in have.what


@pytest.mark.parametrize("value", ["x", "0", "-5", "1.5"])
def test_a_bad_memory_variable_is_one_line_naming_it(monkeypatch, value):
    monkeypatch.setenv(fits.HOST_ENV, value)
    with pytest.raises(ConfigError, match=f"^{fits.HOST_ENV}="):
        fits.check(config.build("tiny", []), jax.devices()[:1], memory=memory)


def test_mixtral_on_this_kind_of_machine_is_refused_in_the_issues_words(monkeypatch):
    """The issue's machine: 24 GiB of host memory, one CPU device."""
    monkeypatch.setenv(fits.HOST_ENV, str(24 * 2**30))
    cfg = config.build("mixtral-8x7b", [])
    with pytest.raises(ConfigError, match=r"mixtral-8x7b \(46\.7B parameters.*879\.4 GiB per device"):
        fits.check(config.for_devices(cfg, 1), jax.devices()[:1], "mixtral-8x7b", memory=memory)


# A multi-output initialisation one of whose outputs cannot be allocated anywhere (2**45 fp32:
# 128 TiB): reading the small output alone waited for ever (jax 0.10.2, XLA:CPU).
UNALLOCATABLE = """
import jax, jax.numpy as jnp
from moe_train.train import fits
make = jax.jit(lambda k: (jnp.zeros((), jnp.int32), jax.random.normal(k, (2**45,)), jnp.ones(8)))
try:
    fits.initialised(make(jax.random.key(0)))
except Exception as err:
    print(type(err).__name__, err)
"""


def test_a_state_that_cannot_be_allocated_is_an_error_not_a_wait():
    proc = subprocess.run(
        [sys.executable, "-c", UNALLOCATABLE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.startswith("ConfigError the run does not fit in memory"), proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- a step XLA cannot fit

HBM = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
    "HLO temporaries (20.05G) exceeds available HBM (15.75G)"
)


def test_a_step_out_of_device_memory_becomes_one_config_error():
    refusal = fits.step_out_of_memory(RuntimeError(HBM), config.build("tiny", []))
    assert isinstance(refusal, ConfigError) and "\n" not in str(refusal)


def test_the_step_refusal_quotes_xla_and_names_remat_first():
    text = str(fits.step_out_of_memory(RuntimeError(HBM), config.build("tiny", [])))
    assert "HLO temporaries (20.05G)" in text and text.index("train.remat=full") < text.index(
        "micro_batch_size"
    )


def test_the_step_refusal_leaves_out_remat_a_run_already_has():
    cfg = config.build("tiny", ["train.remat=full"])
    assert "train.remat" not in str(fits.step_out_of_memory(RuntimeError(HBM), cfg))


def test_other_step_errors_pass_through():
    assert fits.step_out_of_memory(ValueError("shapes differ"), config.build("tiny", [])) is None
