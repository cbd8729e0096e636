"""``python -m topology <command>``: measuring the machine (the EP plan of a model on a preset is
``python -m moe_train.planner.ep_plan``).

Commands (``COMMANDS`` maps each name to its argument setup and its runner):

* ``probe`` -- time all-to-alls over message sizes on the devices this job has (NCCL on GPUs,
  fake host devices on CPU) and write a calibration file (``topology.probe``,
  ``topology.calibration``). Under ``srun`` with several tasks every task runs it together.

Bad input (unknown preset or model, EP or node counts that do not fit) prints one line
``error: ...`` naming the valid choices to stderr and exits 2; no subcommand prints the usage
and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from moe_train.config.cli import OneLineParser
from topology import presets
from topology.presets import TopologyError

EXIT_USAGE = 2


def _probe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", required=True, help="cluster preset the measurement calibrates (name or site .toml path)"
    )
    p.add_argument("--out", required=True, help="calibration file to write (TOML)")
    p.add_argument(
        "--devices",
        type=int,
        default=0,
        help="devices to use (default all; on CPU, that many fake host devices)",
    )
    p.add_argument("--min-bytes", type=int, default=64 * 1024, help="smallest message per device")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=0,
        help="largest message per device (default 256 MiB on GPU, 4 MiB on CPU)",
    )
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per size (median kept)")


def _probe_run(args: argparse.Namespace) -> int:
    cluster = presets.load(args.preset)  # fail on a bad name before starting JAX
    import jax

    from topology import calibration, discovery, probe  # JAX: once the preset is known good

    platforms = jax.config.jax_platforms  # pyright: ignore[reportAttributeAccessIssue]  (a run-time attribute)
    if args.devices and platforms in (None, "", "cpu"):
        jax.config.update("jax_num_cpu_devices", args.devices)
    if (
        int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ.get("SLURM_NTASKS", "1")) or 1) > 1
        and "SLURM_STEP_NODELIST" in os.environ
    ):
        jax.distributed.initialize()
    devices = jax.devices()[: args.devices or None]
    if len(devices) < 2:
        raise TopologyError(f"probe needs at least 2 devices, this job has {len(devices)}")
    ids = {d.id for d in devices}
    groups = discovery.domains_of(r for r in discovery.discover() if r.device_id in ids)
    link = "nvlink" if len(groups) == 1 else "network"
    gpu = devices[0].platform != "cpu"
    sizes = probe.sizes(args.min_bytes, args.max_bytes or (256 << 20 if gpu else 4 << 20))
    samples = probe.measure(devices, sizes, reps=args.reps)
    result = calibration.fit(samples)
    if jax.process_index() == 0:
        path = calibration.write(
            args.out, cluster.name, link, result, samples, devices[0].device_kind, len(devices)
        )
        for s in samples:
            print(f"{s.bytes_per_device:>12,d} B per device  {s.seconds * 1e6:10.1f} us")
        print(
            f"{link} over {len(devices)} {devices[0].platform} devices in {len(groups)} "
            f"domain(s): latency {result.latency_s * 1e6:.1f} us, "
            f"{result.rate_bytes_per_s / 1e9:.3f} GB/s per device -> {path}"
        )
    return 0


# name -> (help, add arguments, run)
COMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {
    "probe": (
        "measure all-to-all time over message sizes and write a calibration file",
        _probe_args,
        _probe_run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m topology", description=(__doc__ or "").partition("\n")[0])
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        return EXIT_USAGE
    try:
        return COMMANDS[args.command][2](args)
    except TopologyError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `... | head` closed our stdout: stop quietly, as shell tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
