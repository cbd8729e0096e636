"""Compile time of the train step against depth: scanned layers vs a Python loop of blocks.

For each depth in ``Sizes.layers`` and each layout (``model.scan_layers`` true / false) the
tiny preset at width ``hidden`` gets the trainer's own jitted step
(``train.make_train_step`` on one CPU device, fp32, remat none) and times, from abstract
inputs: ``lower_s`` (tracing the model, its gradient and the optimizer, and lowering to
StableHLO) and ``compile_s`` (XLA's compilation of that module); ``total_s`` is their sum,
what the first step of a run waits for beyond initialisation. The persistent compilation
cache is off while timing (a cache hit would time a disk read). ``hlo_kb`` is the size of
the lowered module's text: a loop repeats every block, a scan holds one body per layer
group. Each cell is compiled once (a fresh trace each time), after one untimed warm-up
compile (JAX's and XLA's one-time setup is not charged to the first cell); depths run
shallow to deep, scan then loop.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from moe_train import config
from moe_train.bench import common
from moe_train.bench.common import markdown_table
from moe_train.parallel import sharding
from moe_train.train import step as train

TITLE = "Train-step compile time vs depth: scanned vs looped layers"


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: tuple[int, ...]  # depths to compile
    hidden: int  # model width (the tiny preset's is 64)
    first_dense_layers: int = 0  # a dense group in front of the MoE group (0: none)


FULL = Sizes(layers=(2, 8, 32), hidden=64)
QUICK = Sizes(layers=(2, 4), hidden=32)


def log(msg: str) -> None:
    print(f"[bench scan] {msg}", file=sys.stderr, flush=True)


def _cfg(s: Sizes, layers: int, scan: bool) -> config.Config:
    return config.build(
        "tiny",
        [
            f"model.num_layers={layers}",
            f"model.hidden={s.hidden}",
            f"model.first_dense_layers={s.first_dense_layers}",
            f"model.scan_layers={str(scan).lower()}",
            "parallel.devices=1",
        ],
    )


def compile_cell(cfg: config.Config) -> dict[str, Any]:
    """Lower and compile ``cfg``'s train step from abstract inputs; seconds and HLO size."""
    mesh = sharding.make_mesh(jax.devices()[:1])
    rules = sharding.logical_rules(cfg, mesh.shape)
    with sharding.activate(mesh, rules):
        abstract = jax.eval_shape(lambda: train.init_state(cfg, mesh))
        shardings = train.state_shardings(cfg, mesh, abstract)
        abstract = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, shardings
        )
        step = train.make_train_step(cfg, mesh, train.StepCounter(), shardings)
        batch = jax.ShapeDtypeStruct(
            (cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh)
        )
        t0 = time.perf_counter()
        lowered = step.lower(abstract, batch)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
    return {
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "total_s": t2 - t0,
        "hlo_kb": len(lowered.as_text()) / 1024,
    }


def _uncached(fn, *args):
    """``fn(*args)`` with JAX's persistent compilation cache disabled."""
    # jax.config's flags are attributes it sets at run time
    before = jax.config.jax_enable_compilation_cache  # pyright: ignore[reportAttributeAccessIssue]
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        return fn(*args)
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def _markdown(rows: list[dict[str, Any]]) -> str:
    by = {(r["layers"], r["scan"]): r for r in rows}
    table = []
    for layers in sorted({r["layers"] for r in rows}):
        scan, loop = by[(layers, True)], by[(layers, False)]
        table.append(
            [
                layers,
                f"{scan['total_s']:.1f}",
                f"{loop['total_s']:.1f}",
                f"{loop['total_s'] / scan['total_s']:.2f}",
                f"{scan['hlo_kb']:.0f}",
                f"{loop['hlo_kb']:.0f}",
            ]
        )
    header = ["layers", "scan s", "loop s", "loop / scan", "scan HLO KiB", "loop HLO KiB"]
    return (
        f"### {TITLE}\n\nLower + compile of the tiny train step (1 CPU device, fp32), "
        f"no compilation cache.\n\n" + markdown_table(header, table)
    )


def run(s: Sizes) -> dict[str, Any]:
    """The section's results (JSON-ready): ``rows`` of {layers, scan, lower_s, compile_s,
    total_s, hlo_kb}, ``loop_over_scan`` {layers: total_s ratio}, ``markdown``."""
    t0 = time.perf_counter()
    _uncached(compile_cell, _cfg(s, min(s.layers), True))  # warm-up
    rows = []
    for layers in s.layers:
        for scan in (True, False):
            cell = _uncached(compile_cell, _cfg(s, layers, scan))
            rows.append({"layers": layers, "scan": scan, **cell})
            log(
                f"{layers} layers, {'scan' if scan else 'loop'}: lower {cell['lower_s']:.1f} s, "
                f"compile {cell['compile_s']:.1f} s"
            )
    by = {(r["layers"], r["scan"]): r["total_s"] for r in rows}
    ratio = {str(n): by[(n, False)] / by[(n, True)] for n in s.layers}
    return common.section_result(
        TITLE, s, rows=rows, loop_over_scan=ratio, markdown=_markdown(rows), wall_s=time.perf_counter() - t0
    )


if __name__ == "__main__":  # python -m moe_train.bench.scan [--quick]
    jax.config.update("jax_platforms", "cpu")
    result = run(QUICK if "--quick" in sys.argv else FULL)
    print(result["markdown"])
