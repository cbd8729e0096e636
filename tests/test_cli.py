"""The command line: bad input exits 2 with one clear line and damages nothing."""

import io
import json
import subprocess
import threading
from pathlib import Path

import pytest
from helpers import ROOT, run_module

from moe_train.train import cli as cli_module

FAST = ["--set", "train.seq_len=16", "--set", "train.batch_size=2", "--set", "train.log_every=100"]


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return run_module("moe_train", *args, cwd=cwd, timeout=300)


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0]


def test_unknown_preset(tmp_path):
    assert_clean_error(cli("--preset", "nope", "--out", str(tmp_path / "r")), "valid presets", "tiny")


def test_unknown_key(tmp_path):
    assert_clean_error(
        cli("--out", str(tmp_path / "r"), "--set", "moe.experts=4"), "moe.experts", "num_experts"
    )


def test_top_k_above_experts(tmp_path):
    assert_clean_error(cli("--out", str(tmp_path / "r"), "--set", "moe.top_k=12"), "top_k=12")


def test_heads_not_dividing_hidden(tmp_path):
    assert_clean_error(
        cli("--out", str(tmp_path / "r"), "--set", "model.num_heads=3", "--set", "model.num_kv_heads=1"),
        "num_heads=3",
        "valid num_heads",
    )


def test_missing_data_file(tmp_path):
    out = tmp_path / "r"
    assert_clean_error(cli("--out", str(out), "--set", "data.path=no/such/file.txt"), "no/such/file.txt")
    assert not out.exists()


def test_too_many_devices(tmp_path):
    assert_clean_error(cli("--out", str(tmp_path / "r"), "--devices", "3", *FAST), "batch_size=2")


@pytest.mark.slow
def test_incompatible_checkpoint_is_refused_and_kept(tmp_path):
    out = tmp_path / "r"
    first = cli("--out", str(out), "--steps", "1", *FAST)
    assert first.returncode == 0, first.stderr
    files = lambda: {
        p: p.read_bytes()
        for p in out.rglob("*")  # noqa: E731
        if p.is_file() and p.name != "run.lock"
    }  # the lock's holder record changes
    before = files()
    proc = cli("--out", str(out), "--steps", "2", *FAST, "--set", "model.hidden=32")
    assert_clean_error(proc, "incompatible", "model.hidden=64 (checkpoint) vs 32 (this run)")
    after = files()
    assert after == before
    assert json.loads((out / "config.json").read_text())["model"]["hidden"] == 64


def test_help_lists_presets():
    proc = cli("--help")
    assert proc.returncode == 0 and "mixtral-8x7b" in proc.stdout


def test_experts_not_divisible_by_ep(tmp_path):
    assert_clean_error(
        cli(
            "--out",
            str(tmp_path / "r"),
            "--devices",
            "6",
            "--set",
            "parallel.ep=3",
            "--set",
            "train.batch_size=6",
        ),
        "not divisible by parallel.ep=3",
        "valid ep",
    )


def test_cudnn_attention_on_cpu_names_what_works(tmp_path):
    proc = cli("--preset", "tiny", "--out", str(tmp_path / "run"), "--set", "model.attention=cudnn", *FAST)
    assert_clean_error(proc, "model.attention=cudnn", "choose one of: xla, chunked")
    assert not (tmp_path / "run").exists()


def test_unknown_attention_lists_the_valid_ones(tmp_path):
    proc = cli("--preset", "tiny", "--out", str(tmp_path / "run"), "--set", "model.attention=flash", *FAST)
    assert_clean_error(proc, "model.attention='flash'", "auto, xla, cudnn, chunked, te")


@pytest.fixture
def fake_run(monkeypatch):
    """Replace the trainer: record its arguments, or raise what the test sets."""
    import moe_train.train.loop
    from moe_train.train import signals

    seen = {}

    def run(cfg, out, log=print, **kw):
        seen.update(kw, out=out)
        if "raise" in seen:
            raise seen["raise"]
        return 0

    monkeypatch.setattr(moe_train.train.loop, "run", run)
    yield seen
    signals.STOP.restore()
    signals.STOP.signum = None


def test_resume_step_reaches_the_trainer(tmp_path, fake_run):
    from moe_train.train import cli as cli_module

    assert cli_module.main(["--out", str(tmp_path / "r"), "--resume-step", "7"]) == 0
    assert fake_run["resume_step"] == 7
    assert cli_module.parser().parse_args(["--out", "x"]).resume_step is None


def test_unwritable_output_is_one_line_and_exit_5(tmp_path, fake_run, capsys):
    from moe_train.base import exits
    from moe_train.train import cli as cli_module

    fake_run["raise"] = exits.OutputError(f"cannot write {tmp_path / 'r'}: No space left on device")
    assert cli_module.main(["--out", str(tmp_path / "r")]) == exits.EXIT_OUTPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "No space left" in err[0]


def test_stop_signals_are_caught_first_thing(tmp_path, fake_run):
    """When the run starts, SIGTERM and SIGINT are already caught (in start-up mode, where one
    ends the process with one line: raised here it would end the test's worker, so
    tests/test_interrupt.py sends them to a real trainer process)."""
    import signal

    from moe_train.train import cli as cli_module
    from moe_train.train import signals

    def run(cfg, out, log=print, **kw):
        caught = all(signal.getsignal(s) == signals.STOP._handle for s in (signal.SIGTERM, signal.SIGINT))
        return 0 if caught and signals.STOP._starting else 1

    import moe_train.train.loop

    moe_train.train.loop.run = run  # restored by fake_run's monkeypatch
    assert cli_module.main(["--out", str(tmp_path / "r")]) == 0


_CLOSED_LOOP = [
    "Traceback (most recent call last):",
    '  File "asyncio/base_events.py", line 806, in call_soon_threadsafe',
    "    self._check_closed()",
    "RuntimeError: Event loop is closed",
]


def _write_in_turns(stream, lines: list[str], threads: int) -> None:
    """Each of ``threads`` threads writes ``lines`` one at a time, strictly taking turns."""
    turn = threading.Condition()
    state = {"next": 0}

    def work(me: int) -> None:
        for i, line in enumerate(lines):
            with turn:
                turn.wait_for(lambda i=i: state["next"] == i * threads + me)
                stream.write(line + "\n")
                state["next"] += 1
                turn.notify_all()

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def test_closed_loop_tracebacks_printed_by_two_threads_at_once_are_dropped():
    out = io.StringIO()
    _write_in_turns(cli_module._DropClosedLoop(out), _CLOSED_LOOP, threads=2)
    assert out.getvalue() == ""


def test_other_tracebacks_and_lines_pass_through_the_closed_loop_filter():
    out = io.StringIO()
    stream = cli_module._DropClosedLoop(out)
    text = 'error: cannot write\nTraceback (most recent call last):\n  File "x"\nValueError: no\n'
    stream.write(text)
    assert out.getvalue() == text
