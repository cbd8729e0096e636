"""The run directory before anything slow (``moe_train.train.rundir``): ``--fresh`` empties only
a previous run of the kit, and an incompatible checkpoint is refused before the self-test."""

import json
import subprocess
from pathlib import Path

import pytest
from helpers import one_error_line, run_module, tiny

from moe_train import config
from moe_train.config import ConfigError
from moe_train.train import rundir, runlock
from moe_train.train.loop import run


def kit_run(d: Path, preset: str = "tiny", step: int = 3) -> Path:
    """A run directory as the trainer leaves it: its lock file, config and one checkpoint's
    meta item (Orbax's JSON file), the rest as empty files."""
    (d / "checkpoints" / str(step) / "meta").mkdir(parents=True)
    cfg = config.to_dict(config.build(preset, []))
    (d / "checkpoints" / str(step) / "meta" / "metadata").write_text(json.dumps({"config": cfg}))
    for name in (runlock.LOCK_NAME, "config.json", "metrics.jsonl", "summary.json"):
        (d / name).write_text("{}\n")
    return d


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_module("moe_train", *args, timeout=300)


def test_fresh_refuses_a_directory_with_other_files_and_keeps_them(tmp_path):
    (tmp_path / "thesis.tex").write_text("mine")
    with pytest.raises(ConfigError, match="thesis.tex"):
        rundir.start_fresh(tmp_path)
    assert (tmp_path / "thesis.tex").read_text() == "mine"


def test_fresh_refuses_run_files_without_the_lock_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="run.lock"):
        rundir.start_fresh(tmp_path)


def test_fresh_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        rundir.start_fresh(tmp_path / "f")


def test_fresh_empties_a_previous_run_but_its_lock_file(tmp_path):
    assert rundir.start_fresh(kit_run(tmp_path / "run"))
    assert [p.name for p in (tmp_path / "run").iterdir()] == [runlock.LOCK_NAME]


def test_fresh_leaves_a_missing_directory_missing(tmp_path):
    assert not rundir.start_fresh(tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_fresh_refuses_a_run_a_trainer_holds(tmp_path):
    run = kit_run(tmp_path / "run")
    with runlock.acquire(run):
        with pytest.raises(ConfigError):
            rundir.start_fresh(run)
    assert (run / "config.json").exists()


def test_cli_fresh_on_a_foreign_directory_exits_2_with_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = cli("--preset", "tiny", "--out", str(tmp_path), "--fresh", "--steps", "1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_an_incompatible_checkpoint_raises(tmp_path):
    with pytest.raises(ConfigError, match="incompatible"):
        rundir.refuse_incompatible(config.build("small", []), kit_run(tmp_path))


def test_a_compatible_checkpoint_passes(tmp_path):
    assert rundir.refuse_incompatible(config.build("tiny", []), kit_run(tmp_path)) is None


def test_an_unreadable_meta_is_left_to_the_resume(tmp_path):
    run = kit_run(tmp_path)
    (run / "checkpoints" / "3" / "meta" / "metadata").write_text("{torn")
    assert rundir.refuse_incompatible(config.build("small", []), run) is None


def test_resume_step_checks_that_checkpoint(tmp_path):
    run = kit_run(tmp_path, "small", step=5)
    kit_run(tmp_path, "tiny", step=2)
    with pytest.raises(ConfigError, match="incompatible"):
        rundir.refuse_incompatible(config.build("small", []), run, resume_step=2)


def test_cli_refuses_an_incompatible_checkpoint_before_the_kernel_self_test(tmp_path):
    proc = cli("--preset", "small", "--out", str(kit_run(tmp_path)), "--steps", "1")
    assert proc.returncode == 2 and "incompatible" in proc.stderr, proc.stderr
    assert "kernel" not in proc.stdout and "self-test" not in proc.stdout, proc.stdout


def test_the_resume_command_of_a_fresh_run_does_not_start_over():
    from moe_train.train import cli as cli_module

    assert "--fre" not in cli_module.rerun_command(["--out", "o", "--fresh", "--steps", "9"])


# --------------------------------------------------------------------------- OUT, before the self-test


def test_an_out_in_use_is_refused_before_the_kernel_self_test(tmp_path):
    with runlock.acquire(tmp_path):
        proc = cli("--preset", "tiny", "--out", str(tmp_path), "--steps", "1", "--devices", "1")
    assert proc.returncode == 2 and "is in use by" in one_error_line(proc.stderr)
    assert "kernels on" not in proc.stdout and "self-test" not in proc.stdout, proc.stdout


def test_an_out_that_is_a_file_is_refused_before_the_kernel_self_test(tmp_path):
    (tmp_path / "out").write_text("a file")
    proc = cli("--preset", "tiny", "--out", str(tmp_path / "out"), "--steps", "1", "--devices", "1")
    assert proc.returncode == 5 and str(tmp_path / "out") in one_error_line(proc.stderr)
    assert proc.stdout == "", proc.stdout


def test_a_missing_parent_of_out_is_created_and_said_in_one_line(tmp_path):
    lines = []
    assert run(tiny(steps=1), tmp_path / "a" / "b" / "run", log=lines.append) == 0
    assert [x for x in lines if x.startswith("note: created")] == [
        f"note: created {tmp_path / 'a'} for --out {tmp_path / 'a' / 'b' / 'run'} (it did not exist)"
    ]


def test_an_existing_parent_is_not_mentioned(tmp_path):
    lines = []
    assert run(tiny(steps=1), tmp_path / "run", log=lines.append) == 0
    assert not [x for x in lines if x.startswith("note: created")]


def test_first_missing_is_the_highest_directory_locking_creates(tmp_path):
    assert rundir.first_missing(tmp_path / "a" / "b") == tmp_path / "a"
    assert rundir.first_missing(tmp_path) is None


def test_a_start_that_wrote_nothing_takes_back_the_directories_it_created(tmp_path):
    with runlock.acquire(tmp_path / "a" / "b"):
        rundir.remove_if_new(tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_a_start_that_wrote_a_file_keeps_its_directories(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "config.json").write_text("{}")
    rundir.remove_if_new(tmp_path / "a")
    assert (tmp_path / "a" / "b" / "config.json").exists()
