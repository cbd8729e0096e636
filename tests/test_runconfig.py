"""What the loop is handed (``moe_train.train.runconfig``, ``moe_train.train.loop``): one run
config, built once per start, and one wrapper around the jitted step."""

import dataclasses

import jax
import pytest
from helpers import QUIET, tiny

from moe_train.base.platform import Platform
from moe_train.config import Config
from moe_train.parallel import sharding
from moe_train.train import loop as run_mod
from moe_train.train.runconfig import RunConfig
from moe_train.train.step import make_train_step
from moe_train.train.stepper import BucketedStep


@pytest.fixture(scope="module")
def loop(tmp_path_factory) -> run_mod.Loop:
    """The Loop a start of tiny (micro-batches of 1 sequence) hands its steps to, caught
    before its first step."""
    caught = []

    def catch(self) -> int:
        caught.append(self)
        return run_mod.EXIT_OK

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_mod.Loop, "run", catch)
        cfg = tiny("train.batch_size=2", "train.micro_batch_size=1", "train.skip_selftest=true")
        assert run_mod.run(cfg, tmp_path_factory.mktemp("run") / "out", **QUIET) == run_mod.EXIT_OK
    return caught[0]


def test_the_loop_and_its_start_hold_one_run_config_and_no_other_config(loop):
    held = [v for v in (*vars(loop).values(), *vars(loop.s).values()) if isinstance(v, (Config, RunConfig))]
    assert len(held) == 2 and all(v is loop.run_cfg for v in held)


def test_the_run_config_is_a_run_config(loop):
    assert type(loop.run_cfg) is RunConfig


def test_the_run_config_keeps_what_was_configured(loop):
    assert loop.run_cfg.configured.train.micro_batch_size == 1


def test_the_run_config_resolves_micro_batches_on_the_job(loop):
    assert (loop.run_cfg.resolved.train.micro_batches, loop.run_cfg.resolved.train.micro_batch_size) == (2, 0)


def test_the_run_config_names_the_platform_the_step_is_built_for(loop):
    assert loop.run_cfg.platform == Platform.here()


def test_the_run_config_cannot_change(loop):
    with pytest.raises(dataclasses.FrozenInstanceError):
        loop.run_cfg.resolved = loop.run_cfg.configured  # type: ignore[misc]


def test_the_loop_calls_the_one_step_wrapper(loop):
    assert type(loop.step_fn) is BucketedStep


def test_the_step_wrapper_holds_the_jitted_step_itself(loop):
    """What it calls is ``make_train_step``'s: the ``jax.jit`` function in its mesh context."""
    fn = loop.step_fn._fn(loop.step_fn.bucket)
    assert loop.step_fn.step_for.func is make_train_step
    assert type(fn) is sharding.InContext and type(fn.jitted) is type(jax.jit(lambda x: x))
