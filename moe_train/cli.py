"""Command line: ``python -m moe_train --preset NAME --steps N --out DIR [--set k=v ...]``.

Configuration errors are caught before anything compiles or is written: one line on stderr
naming the problem and the valid choices, exit code 2, no traceback.

Multi-process: start one command per process with the same ``--coordinator HOST:PORT`` and
``--num-processes N`` and its own ``--process-id``, or run under ``srun`` (detected). Only
process 0 prints progress; a process that cannot reach the others exits 4 (see
``moe_train.distributed``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import traceback
from pathlib import Path

from moe_train import config, distributed


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_train", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny",
                   help=f"model preset: {', '.join(config.list_presets())} (default: tiny)")
    p.add_argument("--out", required=True, type=Path,
                   help="run directory (resumes from its latest checkpoint if there is one)")
    p.add_argument("--steps", type=int, help="total steps (same as --set train.steps=N)")
    p.add_argument("--devices", type=int,
                   help="devices per process; on CPU, that many fake host devices "
                        "(parallel.devices = N x processes)")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="address of process 0 for a multi-process run (parallel.coordinator)")
    p.add_argument("--num-processes", type=int, metavar="N",
                   help="processes in the job (parallel.num_processes)")
    p.add_argument("--process-id", type=int, metavar="I",
                   help="this process's rank, 0..N-1 (parallel.process_id)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set moe.top_k=4 (repeatable)")
    return p


def resolve(args: argparse.Namespace) -> config.Config:
    extra = list(args.overrides)
    if args.steps is not None:
        extra.append(f"train.steps={args.steps}")
    if args.devices is not None:
        extra.append(f"parallel.devices={args.devices}")
    if args.coordinator is not None:
        extra.append(f"parallel.coordinator={args.coordinator}")
    if args.num_processes is not None:
        extra.append(f"parallel.num_processes={args.num_processes}")
    if args.process_id is not None:
        extra.append(f"parallel.process_id={args.process_id}")
    return config.build(args.preset, extra)


def _per_process_devices(cfg: config.Config, args: argparse.Namespace,
                         info: distributed.ProcessInfo) -> tuple[config.Config, int]:
    """(config with parallel.devices counting all processes' devices, devices per process).

    ``--devices N`` is per process; ``parallel.devices`` counts global devices, so with P
    processes it becomes N x P. On CPU each process gets devices // P fake host devices.
    """
    devices, count = cfg.parallel.devices, info.process_count
    if args.devices is not None and count > 1:
        devices = args.devices * count
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, devices=devices))
    if devices % count:
        raise config.ConfigError(f"parallel.devices={devices} is not divisible by {count} processes; "
                                 f"use a multiple of {count} (or --devices per process)")
    return cfg, devices // count


def _logger(info: distributed.ProcessInfo):
    """Progress from process 0 only; error lines from every process, with its rank."""
    if info.is_main:
        return lambda line: print(line, flush=True)

    def log(line: str) -> None:
        if line.startswith("error"):
            print(f"[process {info.process_index} of {info.process_count}] {line}", flush=True)
    return log


def _error(err: Exception | str, info: distributed.ProcessInfo) -> None:
    where = f"process {info.process_index} of {info.process_count}: " if info.multi else ""
    print(f"error: {where}{err}", file=sys.stderr, flush=True)


def _quiet_libraries() -> None:
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    logging.getLogger("jax").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    info = distributed.ProcessInfo()
    try:
        cfg = resolve(args)
        import jax

        info = distributed.initialize(cfg.parallel)
        cfg, local_devices = _per_process_devices(cfg, args, info)
        if local_devices:
            jax.config.update("jax_num_cpu_devices", local_devices)
        _quiet_libraries()
        if info.multi:  # a peer that hangs would block this process in a collective for ever
            distributed.start_watchdog(distributed.watchdog_timeout_s(cfg.parallel),
                                       startup_timeout_s=distributed.startup_timeout_s(cfg.parallel),
                                       label=f"process {info.process_index} of {info.process_count}")
        from moe_train.run import run

        code = run(cfg, args.out, log=_logger(info))
    except config.ConfigError as err:
        _error(err, info)
        code = 2
    except distributed.DistributedError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return distributed.EXIT_DISTRIBUTED
    except Exception as err:
        if not info.multi:
            raise
        # Leave at once: a clean shutdown would wait for peers that may be blocked in a
        # collective with this process; they fail over the heartbeat / watchdog instead.
        peer = distributed.peer_failure(err)
        if peer:
            _error(peer, info)
        else:
            print(f"[process {info.process_index} of {info.process_count}] {traceback.format_exc()}",
                  file=sys.stderr, end="", flush=True)
        distributed.exit_now(distributed.EXIT_DISTRIBUTED if peer else 1)
        raise  # only reached when _exit is replaced (tests)
    distributed.shutdown()
    return code
