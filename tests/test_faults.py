"""Fault injection: every fault ends in its documented exit code with one line, and loses nothing.

Each test does the fault for real (a NaN step, damaged checkpoint files, a second trainer, a
torn metrics line, a size-limited or read-only output, a signal during start-up, bad config
values) and checks the exit code, the message, and that the losses after resuming equal an
uninterrupted run's. Multi-process kills are in ``test_multiprocess.py``.
"""

import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import QUIET, make_read_only, make_writable, records, start_train_cli
from helpers import one_error_line as error_line
from helpers import tiny_saving as tiny

from moe_train import config
from moe_train.base.exits import EXIT_CONFIG, EXIT_DIVERGED, EXIT_OK, EXIT_OUTPUT
from moe_train.checkpoints import checkpoint
from moe_train.train import loop as run_mod
from moe_train.train import step as train

POISON = 255  # a byte never seen in the UTF-8 corpus: the poisoned step's first token


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out)}


def saved_steps(out: Path) -> list[int]:
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of an uninterrupted 6-step run."""
    out = tmp_path_factory.mktemp("reference")
    assert run_mod.run(tiny(steps=6), out, **QUIET) == EXIT_OK
    return losses(out)


@pytest.fixture(scope="module")
def cli_reference(tmp_path_factory) -> dict[int, float]:
    """Losses of an uninterrupted 6-step run of the command line (one device per process:
    XLA:CPU may round differently from the in-process runs on 8 fake devices)."""
    out = tmp_path_factory.mktemp("cli-reference")
    assert finish(cli(out, steps=6))[0] == EXIT_OK
    return losses(out)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """A run stopped after step 4, with checkpoints 2 and 4."""
    out = tmp_path_factory.mktemp("four")
    assert run_mod.run(tiny(steps=4), out, **QUIET) == EXIT_OK
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst / "run")
    return dst / "run"


# --------------------------------------------------------------------------- non-finite steps


@pytest.fixture
def poison_at(monkeypatch):
    """Make step ``k``'s gradients NaN through the real model: its batch starts with POISON
    and the loss is multiplied by NaN for batches that do."""

    def arm(k: int) -> None:
        real_batch, real_loss = run_mod.global_batch, train._loss_fn

        def batch(source, step, mesh):
            if step + 1 != k:
                return real_batch(source, step, mesh)
            local = source.batch(step).copy()
            local[0, 0] = POISON
            return jnp.asarray(local)

        def loss_fn(params, fp8_state, moe_state, batch_BS, *args, **kw):
            total, aux = real_loss(params, fp8_state, moe_state, batch_BS, *args, **kw)
            return total * jnp.where(batch_BS[0, 0] == POISON, jnp.nan, 1.0), aux

        monkeypatch.setattr(run_mod, "global_batch", batch)
        monkeypatch.setattr(train, "_loss_fn", loss_fn)

    return arm


def test_a_nan_step_stops_with_exit_3_naming_the_last_checkpoint(tmp_path, poison_at):
    poison_at(3)
    lines = []
    assert run_mod.run(tiny(steps=6), tmp_path, log=lines.append) == EXIT_DIVERGED
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: step 3: ")
    assert "the last good checkpoint is step 2" in errors[0]


def test_a_nan_step_saves_nothing_and_the_rerun_matches(tmp_path, poison_at, reference, monkeypatch):
    poison_at(3)
    run_mod.run(tiny(steps=6), tmp_path, **QUIET)
    assert saved_steps(tmp_path) == [2] and sorted(losses(tmp_path)) == [1, 2]
    monkeypatch.undo()
    assert run_mod.run(tiny(steps=6), tmp_path, **QUIET) == EXIT_OK
    assert losses(tmp_path) == reference


def test_with_no_checkpoint_the_message_says_a_rerun_starts_over(tmp_path, poison_at):
    poison_at(1)
    lines = []
    assert run_mod.run(tiny(steps=3), tmp_path, log=lines.append) == EXIT_DIVERGED
    assert any("no checkpoint was saved yet: a rerun starts from step 0" in line for line in lines)


def test_skip_drops_the_nan_update_and_goes_on(tmp_path, poison_at):
    poison_at(3)
    lines = []
    assert run_mod.run(tiny("train.on_nonfinite=skip", steps=6), tmp_path, log=lines.append) == EXIT_OK
    recs = records(tmp_path)
    assert [r["skipped"] for r in recs] == [False, False, True, False, False, False]
    assert any(line.startswith("WARNING: step 3: ") and "update skipped" in line for line in lines)


def test_skip_stops_after_max_skips_in_a_row(tmp_path, monkeypatch):
    lines = []
    cfg = tiny(
        "train.on_nonfinite=skip",
        "train.max_nonfinite_skips=2",
        "optim.lr=1e30",
        "optim.warmup_steps=0",
        "optim.grad_clip=0",
        steps=12,
    )
    assert run_mod.run(cfg, tmp_path, log=lines.append) == EXIT_DIVERGED
    assert any("train.max_nonfinite_skips=2" in line for line in lines if line.startswith("error:"))


def test_an_overflowing_lr_never_leaves_a_nonfinite_checkpoint(tmp_path):
    """The tester's case: a finite loss with NaN gradients must not be saved as "good"."""
    cfg = tiny(
        "optim.lr=1e6",
        steps=12,
    )
    assert run_mod.run(cfg, tmp_path, **QUIET) == EXIT_DIVERGED
    ck = checkpoint.Checkpointer(tmp_path, keep=3, use_async=False)
    try:
        for step in ck.all_steps():
            leaves = [np.asarray(x) for x in __import__("jax").tree.leaves(ck.restore_saved(step))]
            assert all(np.isfinite(x).all() for x in leaves if x.dtype.kind == "f"), step
    finally:
        ck.close()


# --------------------------------------------------------------------------- damaged checkpoints


def _largest_data_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())


DAMAGE = {
    "truncated data file": lambda d: os.truncate(_largest_data_file(d), 1000),
    "bytes overwritten, same size": lambda d: _flip(_largest_data_file(d)),
    "state/_METADATA deleted": lambda d: (d / "state" / "_METADATA").unlink(),
    "garbage meta": lambda d: (d / "meta" / "metadata").write_text("garbage{"),
    "emptied step directory": lambda d: [
        shutil.rmtree(p) if p.is_dir() else p.unlink() for p in list(d.iterdir())
    ],
    "manifest deleted (unverified)": lambda d: shutil.rmtree(d / "manifest"),
    "step 2's arrays under this manifest": lambda d: (
        shutil.rmtree(d / "state"),
        shutil.copytree(d.parent / "2" / "state", d / "state"),
    ),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, four_steps, reference, damage):
    out = copy_run(four_steps, tmp_path)
    DAMAGE[damage](out / "checkpoints" / "4")
    lines = []
    assert run_mod.run(tiny(steps=6), out, log=lines.append) == EXIT_OK
    warned = [line for line in lines if line.startswith("WARNING: checkpoint 4 cannot be used")]
    assert len(warned) == 1 and "resuming from step 2" in warned[0]
    assert [p.name.split("-")[0] for p in (out / "checkpoints-rejected").iterdir()] == ["4"]
    assert losses(out) == reference


def test_when_no_checkpoint_verifies_nothing_is_moved_and_exit_2_lists_them(tmp_path, four_steps):
    out = copy_run(four_steps, tmp_path)
    for step in (2, 4):
        _flip(_largest_data_file(out / "checkpoints" / str(step)))
    with pytest.raises(config.ConfigError, match=r"step 4: .*; step 2: "):
        run_mod.run(tiny(steps=6), out, **QUIET)
    assert saved_steps(out) == [2, 4] and not (out / "checkpoints-rejected").exists()


def test_resume_step_chooses_an_older_checkpoint_and_moves_newer_aside(tmp_path, four_steps, reference):
    out = copy_run(four_steps, tmp_path)
    lines = []
    assert run_mod.run(tiny(steps=6), out, log=lines.append, resume_step=2) == EXIT_OK
    assert any("(step 2)" in line for line in lines if line.startswith("resumed from"))
    assert (out / "checkpoints-rejected").exists() and losses(out) == reference


def test_resume_step_that_does_not_exist_is_a_config_error(tmp_path, four_steps):
    out = copy_run(four_steps, tmp_path)
    with pytest.raises(config.ConfigError, match=r"saved steps: 2, 4"):
        run_mod.run(tiny(steps=6), out, resume_step=3, **QUIET)


# --------------------------------------------------------------------------- the run directory


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path, four_steps, reference):
    out = copy_run(four_steps, tmp_path)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 5.1')  # a crash mid-write
    lines = []
    assert run_mod.run(tiny(steps=6), out, log=lines.append) == EXIT_OK
    assert any("dropped 1 unreadable line" in line for line in lines)
    assert losses(out) == reference


def _snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_exit_2_on_an_existing_run_changes_nothing(tmp_path, four_steps):
    out = copy_run(four_steps, tmp_path)
    before = _snapshot(out)
    with pytest.raises(config.ConfigError, match="incompatible"):
        run_mod.run(tiny("model.hidden=32", steps=6), out, **QUIET)
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k != "run.lock"} == {
        k: v for k, v in before.items() if k != "run.lock"
    }


def test_exit_2_on_a_new_directory_leaves_nothing(tmp_path):
    with pytest.raises(config.ConfigError):
        run_mod.run(
            tiny("moe.dispatcher=hierarchical", "parallel.devices=4", "parallel.ep=4"),
            tmp_path / "new",
            **QUIET,
        )
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- the command line


def cli(out: Path, *args: str, steps: int = 4, preexec=None, **kw) -> subprocess.Popen:
    sets = ["--set", "train.checkpoint_every=2", "--set", "train.telemetry_interval_s=0"]
    return start_train_cli(out, "--steps", steps, "--devices", 1, *sets, *args, preexec_fn=preexec, **kw)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def one_error_line(stderr: str) -> str:
    line = error_line(stderr)
    assert "Traceback" not in stderr
    return line


@pytest.mark.slow
def test_resuming_past_a_truncated_checkpoint_file_prints_nothing_to_stderr(tmp_path, four_steps):
    """The storage libraries' "Exception ignored" dumps while reading it stay off the console
    (``checkpoint.quiet_reads``); the fallback itself is the one WARNING line on stdout."""
    out = copy_run(four_steps, tmp_path)
    DAMAGE["truncated data file"](out / "checkpoints" / "4")
    code, stdout, stderr = finish(cli(out, steps=6))
    assert (code, stderr.splitlines(), "WARNING: checkpoint 4 cannot be used" in stdout) == (
        EXIT_OK,
        [],
        True,
    )


BAD_VALUES = [
    ("optim.lr=nan", "optim.lr"),
    ("optim.lr=inf", "optim.lr"),
    ("optim.b1=2", "optim.b1"),
    ("optim.eps=-1", "optim.eps"),
    ("optim.warmup_steps=-3", "optim.warmup_steps"),
    ("optim.grad_clip=nan", "optim.grad_clip"),
    ("train.checkpoint_every=-1", "train.checkpoint_every"),
    ("model.hidden=99999999999", "model.hidden"),
    ("train.batch_size=1000000000000000", "train.batch_size"),
    ("train.on_nonfinite=maybe", "train.on_nonfinite"),
    ("moe.capacity_buckets=1,x", "moe.capacity_buckets"),
]


@pytest.mark.parametrize("value,key", BAD_VALUES, ids=[v for v, _ in BAD_VALUES])
def test_bad_config_values_exit_2_with_one_line_and_write_nothing(tmp_path, value, key):
    code, _, err = finish(cli(tmp_path / "out", "--set", value), timeout=60)
    assert code == EXIT_CONFIG and key in one_error_line(err)
    assert not (tmp_path / "out").exists()


def test_the_divergence_error_goes_to_stderr_as_every_error_line(tmp_path):
    code, out, err = finish(cli(tmp_path, "--set", "optim.lr=1e6", steps=12), timeout=300)
    assert code == EXIT_DIVERGED and one_error_line(err).startswith("error: step ")
    assert "error" not in out, out


@pytest.mark.parametrize("rank", [0, 1])
def test_the_trainers_error_lines_go_to_stderr_and_progress_to_stdout(capsys, rank):
    from moe_train.train import cli as cli_module
    from moe_train.train.distributed import ProcessInfo

    log = cli_module._logger(ProcessInfo(process_index=rank, process_count=2))
    log("error: it diverged")
    log("step 1/2 | loss 5.0")
    out, err = capsys.readouterr()
    assert err.endswith("error: it diverged\n") and out == ("step 1/2 | loss 5.0\n" if rank == 0 else "")


def test_a_flag_and_a_set_that_disagree_exit_2(tmp_path):
    code, _, err = finish(cli(tmp_path / "out", "--set", "parallel.devices=4"), timeout=60)
    assert code == EXIT_CONFIG and "--devices" in one_error_line(err)


@pytest.mark.slow
def test_a_second_trainer_on_the_same_directory_exits_2_naming_the_first(tmp_path):
    first = cli(
        tmp_path,
        steps=400,
    )
    deadline = time.time() + 240
    while time.time() < deadline and not (tmp_path / "metrics.jsonl").exists():
        time.sleep(0.1)
    code, _, err = finish(cli(tmp_path, steps=400), timeout=120)
    first.send_signal(signal.SIGTERM)
    first_code, _, _ = finish(first)
    assert code == EXIT_CONFIG and f"in use by pid {first.pid}" in one_error_line(err)
    steps = [r["step"] for r in records(tmp_path)]
    assert first_code == EXIT_OK and steps == list(range(1, len(steps) + 1))


def _limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.slow
def test_a_size_limited_output_exits_5_and_keeps_the_previous_checkpoint(tmp_path, cli_reference):
    assert finish(cli(tmp_path, steps=2))[0] == EXIT_OK
    code, _, err = finish(cli(tmp_path, steps=6, preexec=_limit_file_size(1 << 20)))
    assert code == EXIT_OUTPUT and "File too large" in one_error_line(err)
    assert "checkpoint 2 is intact" in err and saved_steps(tmp_path) == [2]
    assert finish(cli(tmp_path, steps=6))[0] == EXIT_OK
    assert losses(tmp_path) == cli_reference


def test_an_out_that_is_a_file_exits_5(tmp_path):
    (tmp_path / "out").write_text("not a directory")
    code, _, err = finish(cli(tmp_path / "out"))
    assert code == EXIT_OUTPUT and str(tmp_path / "out") in one_error_line(err)


def test_an_unwritable_out_exits_5(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    if not make_read_only(out):
        pytest.skip("cannot make a directory read-only for root here (no chattr +i)")
    try:
        code, _, err = finish(cli(out))
    finally:
        make_writable(out)
    assert code == EXIT_OUTPUT and "run.lock" in one_error_line(err)


@pytest.mark.slow
def test_sigterm_during_start_up_exits_0_and_loses_nothing(tmp_path, cli_reference):
    proc = cli(tmp_path, steps=6)
    time.sleep(1.5)  # importing JAX, the self-test or compiling
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    assert code == EXIT_OK, err
    assert "during start-up" in out or "stopped by signal SIGTERM" in out
    assert finish(cli(tmp_path, steps=6))[0] == EXIT_OK
    assert losses(tmp_path) == cli_reference


def test_the_cli_gives_back_the_signal_handlers_it_replaced(tmp_path):
    """submitit requeues a preempted job from its own USR2 handler once the trainer returns."""
    from moe_train.train import cli

    def theirs(signum, frame):
        pass

    previous = signal.signal(signal.SIGUSR2, theirs)
    try:
        assert cli.main(["--out", str(tmp_path / "out"), "--set", "optim.b1=2"]) == EXIT_CONFIG
        assert signal.getsignal(signal.SIGUSR2) is theirs
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.slow
def test_sigkill_while_a_checkpoint_is_being_written_loses_nothing(tmp_path, cli_reference):
    proc, caught = cli(tmp_path, steps=6), False
    while proc.poll() is None and not caught:
        ckpts = tmp_path / "checkpoints"
        caught = ckpts.is_dir() and any("orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir())
        time.sleep(0.001)
    proc.kill()
    finish(proc)
    if not caught:
        pytest.skip("every save finished before it could be interrupted")
    assert finish(cli(tmp_path, steps=6))[0] == EXIT_OK
    assert losses(tmp_path) == cli_reference
