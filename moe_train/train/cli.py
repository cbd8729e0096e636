"""Command line: ``python -m moe_train --preset NAME --steps N --out DIR [--set k=v ...]``.

Configuration errors are caught before anything compiles or is written: one line on stderr
naming the problem and the valid choices, exit code 2, no traceback.

Exit codes: ``moe_train.base.exits`` (0 done or stopped by SIGTERM/SIGUSR2, 1 bug, 2 config,
3 diverged, 4 multi-process failure, 5 the run directory cannot be written, 130 interrupted by
Ctrl-C). SIGTERM/SIGUSR2/SIGINT are caught first thing, before JAX is imported, so a signal
during start-up still ends cleanly. Ctrl-C (SIGINT) stops like SIGTERM, after saving, and
prints the command that resumes the run (this one, without ``--resume-step``) last; a second
Ctrl-C ends the run at once, without saving (one line; the last complete checkpoint is kept).
Before the first step there is nothing to save: SIGTERM or Ctrl-C ends a single-process
start-up at once, wherever it waits, with one line (``signals``: exit 0 or 130).

Multi-process: start one command per process with the same ``--coordinator HOST:PORT`` and
``--num-processes N`` and its own ``--process-id``, or run under ``srun`` (detected). Only
process 0 prints progress. Each such command runs the trainer in a supervised child process
(``moe_train.train.supervise``), so that every multi-process failure, including the JAX runtime
aborting the process, ends it with exit code 4 and one line on stderr (bounds:
``moe_train.train.distributed``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import sys
import threading
import traceback
from pathlib import Path

from moe_train import config, python_command
from moe_train.base import exits
from moe_train.config.cli import set_argument
from moe_train.parallel import together
from moe_train.train import distributed, fits, rundir, signals, supervise


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_train", description=(__doc__ or "").partition("\n")[0])
    p.add_argument(
        "--preset",
        default="tiny",
        help=f"model preset: {', '.join(config.list_presets())}, or a .toml file's path (default: tiny)",
    )
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="run directory (resumes from its latest checkpoint if there is one)",
    )
    p.add_argument("--steps", type=int, help="total steps (same as --set train.steps=N)")
    p.add_argument(
        "--devices",
        type=int,
        help="devices per process; on CPU, that many fake host devices (parallel.devices = N x processes)",
    )
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="address of process 0 for a multi-process run (parallel.coordinator)",
    )
    p.add_argument(
        "--num-processes", type=int, metavar="N", help="processes in the job (parallel.num_processes)"
    )
    p.add_argument(
        "--process-id", type=int, metavar="I", help="this process's rank, 0..N-1 (parallel.process_id)"
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start at step 0: first empty --out if it holds a previous run of this "
        "kit (only the trainer's own files; anything else exits 2, nothing "
        "removed); single-process runs",
    )
    p.add_argument(
        "--resume-step",
        type=int,
        metavar="N",
        help="resume from checkpoint N instead of the newest verified one",
    )
    set_argument(p, "moe.top_k=4")
    return p


# flag -> the config key it sets; a flag and a --set of the same key must agree
FLAG_KEYS = {
    "steps": "train.steps",
    "devices": "parallel.devices",
    "coordinator": "parallel.coordinator",
    "num_processes": "parallel.num_processes",
    "process_id": "parallel.process_id",
}


def resolve(args: argparse.Namespace) -> config.Config:
    """The run's config. On a prepared corpus (``data.source=prepared``) ``model.vocab_size``
    is the corpus's (its ``manifest.json``) unless ``--set model.vocab_size=N`` gives it
    (a vocabulary smaller than the corpus's still exits 2, when the data opens)."""
    flags = {
        f"--{name.replace('_', '-')}": (key, str(getattr(args, name)))
        for name, key in FLAG_KEYS.items()
        if getattr(args, name) is not None
    }
    cfg = config.build(args.preset, list(args.overrides), flags=flags)
    vocab = prepared_vocab(cfg, args.overrides)
    if vocab is None or vocab == cfg.model.vocab_size:
        return cfg
    return config.build(args.preset, [*args.overrides, f"model.vocab_size={vocab}"], flags=flags)


def prepared_vocab(cfg: config.Config, overrides: list[str]) -> int | None:
    """The vocabulary of ``cfg``'s prepared corpus, when the command line does not set
    ``model.vocab_size`` (None: not a prepared corpus, set, or no readable manifest: the
    data source then reports the problem)."""
    if cfg.data.source != "prepared" or any(
        item.partition("=")[0].strip() == "model.vocab_size" for item in overrides
    ):
        return None
    try:
        vocab = json.loads((Path(cfg.data.path) / "manifest.json").read_text())["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def _per_process_devices(
    cfg: config.Config, args: argparse.Namespace, info: distributed.ProcessInfo
) -> tuple[config.Config, int]:
    """(config with parallel.devices counting all processes' devices, devices per process).

    ``--devices N`` is per process; ``parallel.devices`` counts global devices, so with P
    processes it becomes N x P. On CPU each process gets devices // P fake host devices.
    """
    devices, count = cfg.parallel.devices, info.process_count
    if args.devices is not None and count > 1:
        devices = args.devices * count
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, devices=devices))
    if devices % count:
        raise config.ConfigError(
            f"parallel.devices={devices} is not divisible by {count} processes; "
            f"use a multiple of {count} (or --devices per process)"
        )
    return cfg, devices // count


def _logger(info: distributed.ProcessInfo):
    """Progress from process 0 only, on stdout; error lines from every process (with its
    rank), on stderr, as every other error of the kit."""

    def log(line: str) -> None:
        error = line.startswith("error")
        if error and not info.is_main:
            line = f"[process {info.process_index} of {info.process_count}] {line}"
        if error or info.is_main:
            print(line, file=sys.stderr if error else sys.stdout, flush=True)

    return log


def _error(err: Exception | str, info: distributed.ProcessInfo) -> None:
    where = f"process {info.process_index} of {info.process_count}: " if info.multi else ""
    print(f"error: {where}{err}", file=sys.stderr, flush=True)


def _quiet_libraries() -> None:
    """Library chatter off stderr: a failure is reported in the trainer's own one line.

    Orbax reports a failed background save with ``logging.exception`` from each of its
    threads, asyncio logs each of its write tasks ("Task exception was never retrieved"),
    and the trainer re-raises it as one line (exit 5 or 4); TensorStore then prints
    "Event loop is closed" for callbacks that arrive after Orbax closed its event loop."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.FATAL)
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # Orbax's failed write tasks, again
    if not isinstance(sys.stderr, _DropClosedLoop):
        sys.stderr = _DropClosedLoop(sys.stderr)


class _DropClosedLoop:
    """``sys.stderr`` minus the "RuntimeError: Event loop is closed" tracebacks TensorStore
    prints (from C++, bypassing ``sys.excepthook``) after Orbax abandons a failed save.
    Every other line passes at once; a traceback passes when it ends. Several threads print
    such tracebacks at the same time, line by line, so each thread's lines are parsed apart."""

    NOISE = "RuntimeError: Event loop is closed"

    def __init__(self, stream):
        self._stream = stream
        self._state: dict[int, list] = {}  # thread id -> [partial line, open traceback or None]
        self._lock = threading.RLock()  # a signal handler may print mid-write

    def write(self, text: str) -> int:
        with self._lock:
            state = self._state.setdefault(threading.get_ident(), ["", None])
            state[0] += text
            *lines, state[0] = state[0].split("\n")
            for line in lines:
                self._line(state, line)
            if state == ["", None]:
                del self._state[threading.get_ident()]
        return len(text)

    def _line(self, state: list, line: str) -> None:
        if line.startswith("Traceback (most recent call last):"):
            self._end_block(state, None)
            state[1] = [line]
        elif state[1] is not None and line[:1] in (" ", "\t"):
            state[1].append(line)
        else:
            self._end_block(state, line)

    def _end_block(self, state: list, last: str | None) -> None:
        block, state[1] = state[1], None
        if last == self.NOISE and block is not None:
            return
        for line in (block or []) + ([] if last is None else [last]):
            self._stream.write(line + "\n")
        self._stream.flush()

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def main(argv: list[str] | None = None, memory: fits.MemoryModel | None = None) -> int:
    """Run the command line ``argv`` (None: ``sys.argv``); ``memory``: the planner's memory
    model that refuses a run that cannot fit before it starts (``fits.check``), passed in by
    the entry point (``python -m moe_train``, the launcher's task)."""
    # Before anything slow: SIGTERM or Ctrl-C during start-up ends the run cleanly. The
    # handlers it replaced come back on return (submitit's USR2 handler requeues the job after
    # us). A supervised child leaves a second Ctrl-C to its supervisor (``supervise``).
    installed = signals.STOP.install(abort_on_second=not supervise.is_child())
    try:
        return _main(sys.argv[1:] if argv is None else list(argv), memory)
    finally:
        if installed:
            signals.STOP.restore()
            signals.STOP.resume = ""


def _main(argv: list[str], memory: fits.MemoryModel | None) -> int:
    args = parser().parse_args(argv)
    if supervise.is_child():
        signals.STOP.resume = resume_text(argv, multi=True)
        signals.STOP.begin_start_up()  # a forwarded stop signal before the first step ends us
        supervise.child_ready()
        return _train(args, memory=memory)
    signals.STOP.resume = resume_text(argv, multi=False)
    signals.STOP.begin_start_up()  # a stop signal from here to the first step ends us at once
    try:
        cfg = resolve(args)
        source, kwargs = distributed.plan(cfg.parallel, os.environ)
        if args.fresh:
            signals.STOP.end_start_up()  # --fresh empties --out: a signal waits until it is done
            _fresh(args, source)
            signals.STOP.begin_start_up()
    except config.ConfigError as err:
        _error(err, distributed.ProcessInfo())
        return exits.EXIT_CONFIG
    if source == "single":
        return _train(args, cfg, memory)
    signals.STOP.end_start_up()  # the supervisor forwards signals to its child
    signals.STOP.resume = resume_text(argv, multi=True)
    return supervise.run(
        argv,
        supervise.Job(
            process_id=kwargs["process_id"],
            num_processes=kwargs["num_processes"],
            coordinator=kwargs.get("coordinator_address", ""),
            heartbeat_timeout_s=cfg.parallel.heartbeat_timeout_s,
            out_dir=args.out,
        ),
    )


def _fresh(args: argparse.Namespace, source: str) -> None:
    """``--fresh``: empty a previous run of this kit in ``--out`` (``rundir.start_fresh``)."""
    if args.resume_step is not None or source != "single":
        raise config.ConfigError(
            "--fresh starts a single-process run at step 0; drop "
            + (
                "--resume-step"
                if args.resume_step is not None
                else "--fresh (or empty --out yourself) for a multi-process run"
            )
        )
    if rundir.start_fresh(args.out):
        print(f"--fresh: removed the previous run in {args.out}", flush=True)


def rerun_command(argv: list[str]) -> str:
    """The command that resumes this run: this one without ``--resume-step`` (a rerun resumes
    from the newest checkpoint) or ``--fresh`` (which would start over), as a shell would
    take it."""
    kept, skip = [], False
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if len(flag) > 2 and "--fresh".startswith(arg):  # argparse takes prefixes
            continue
        if skip or (len(flag) > 2 and "--resume-step".startswith(flag)):
            skip = not skip and "=" not in arg
            continue
        kept.append(arg)
    return shlex.join([_python(), "-m", "moe_train", *kept])


def resume_text(argv: list[str], multi: bool) -> str:
    """How to resume (``signals.resume_hint``): "run: <command>"; every process's, if several."""
    command = rerun_command(argv)
    return f"rerun every process's command (this one's: {command})" if multi else f"run: {command}"


def _python() -> str:
    """This interpreter as a command that works as printed (``moe_train.python_command``)."""
    return python_command()


def _train(
    args: argparse.Namespace, cfg: config.Config | None = None, memory: fits.MemoryModel | None = None
) -> int:
    """Run the trainer in this process (single-process, or the supervised child)."""
    info = distributed.ProcessInfo()
    try:
        cfg = cfg or resolve(args)
        import jax

        info = distributed.initialize(cfg.parallel)
        cfg, local_devices = _per_process_devices(cfg, args, info)
        if prepared_vocab(cfg, args.overrides) is not None:
            _logger(info)(
                f"model.vocab_size={cfg.model.vocab_size}: the vocabulary of the "
                f"prepared corpus {cfg.data.path} (its manifest.json; --set "
                f"model.vocab_size=N sets another)"
            )
        if local_devices:
            jax.config.update("jax_num_cpu_devices", local_devices)
        _quiet_libraries()
        if info.multi:  # a peer that hangs would block this process in a collective for ever
            distributed.start_watchdog(
                distributed.watchdog_timeout_s(cfg.parallel),
                startup_timeout_s=together.startup_s(cfg.parallel),
                label=f"process {info.process_index} of {info.process_count}",
            )
        from moe_train.train.loop import run  # JAX's users: after jax_num_cpu_devices is set

        code = run(
            cfg, args.out, log=_logger(info), resume_step=args.resume_step, model=args.preset, memory=memory
        )
    except config.ConfigError as err:
        _error(err, info)
        code = exits.EXIT_CONFIG
    except exits.OutputError as err:
        _error(err, info)
        code = exits.EXIT_OUTPUT
        if info.multi:  # peers may wait for this process in a collective: do not shut down
            distributed.exit_now(code)
    except distributed.DistributedError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return distributed.EXIT_DISTRIBUTED
    except Exception as err:
        if not info.multi:
            raise
        _leave(err, info)
        raise  # only reached when _exit is replaced (tests)
    distributed.shutdown()
    return code


def _leave(err: Exception, info: distributed.ProcessInfo) -> None:
    """An unexpected exception in a multi-process run: one line (a peer failure, exit 4) or
    the traceback (a bug, exit 1), then leave at once. A clean shutdown would wait for peers
    that may be blocked in a collective with this process; they fail over the heartbeat /
    watchdog instead."""
    peer = distributed.peer_failure(err)
    if peer:
        _error(peer, info)
    else:
        print(
            f"[process {info.process_index} of {info.process_count}] {traceback.format_exc()}",
            file=sys.stderr,
            end="",
            flush=True,
        )
    distributed.exit_now(distributed.EXIT_DISTRIBUTED if peer else exits.EXIT_BUG)
