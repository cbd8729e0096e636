"""``python -m moe_train.bench [--quick] [--out DIR]``: run the benchmarks, save the results.

The process owns its JAX setup: CPU only, 8 fake CPU devices, both set before any device
is touched (so run it in its own process, not inside a test session).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

from moe_train.bench import common, ep  # noqa: E402  (after the device setup)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_train.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes and fewer configurations (about a minute; used by the tests)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"),
                    help="results go to OUT/<UTC timestamp>/ (default: runs/bench)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    stamp = common.utc_stamp()
    section = ep.run(ep.QUICK if args.quick else ep.FULL)
    md = section.pop("markdown")
    results = {"created_utc": stamp, "argv": sys.argv[1:] if argv is None else argv,
               "quick": args.quick, "environment": common.environment(),
               "sections": {"ep": section}, "wall_s": time.perf_counter() - t0}
    title = f"# moe_train benchmarks ({stamp}{', quick' if args.quick else ''})"
    env = results["environment"]
    header = (f"{title}\n\njax {env['jax']} on {env['jax_backend']} ({env['devices']} devices, "
              f"{env['cpu_count']} CPU cores), Python {env['python']}, {env['machine']}; "
              f"wall {results['wall_s']:.0f} s.\n")
    markdown = header + "\n" + md
    print(markdown, flush=True)
    json_path, _ = common.write_results(args.out / stamp, results, markdown)
    print(f"\nresults: {json_path.parent}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
