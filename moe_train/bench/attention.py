"""Attention kernels (``model.attention``): step time and compiled memory per sequence length.

- ``timing``: forward+backward of ``moe_train.model.attention.attend`` per implementation at each
  sequence length (fixed batch), timed in interleaved rounds (``common.time_rounds``); each
  row carries its median over ``xla``'s median (and the per-round min-max). The first length
  from which ``chunked`` stays faster than ``xla`` is the measured crossover that ``auto``'s
  ``moe_train.model.attention.CHUNKED_MIN_SEQ`` is set from.
- ``memory``: XLA's compiled temp bytes of the same forward+backward at equal tokens
  (B * S fixed) and growing S, compiled only: full scores grow ~S x at equal tokens, the
  chunked kernel stays ~flat.

Implementations that cannot run here (cuDNN and Transformer Engine on CPU) are listed with
the reason. Inputs are fp32 by default, small heads (GQA 4 query / 2 kv heads, D = 32).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from moe_train.base.platform import Platform
from moe_train.bench import common
from moe_train.bench.common import compile_jit, fmt_ms, markdown_table, mib, ratio_stats, time_rounds
from moe_train.model import attention

TITLE = "Attention kernels"


@dataclasses.dataclass(frozen=True)
class Sizes:
    seq_lens: tuple[int, ...]  # timing rows
    batch: int  # timing batch
    memory_seq_lens: tuple[int, ...]  # memory rows at equal tokens
    memory_tokens: int  # B * S of every memory row
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    block: int = 0  # chunked block rows (0: default_block)
    min_reps: int = 3
    max_reps: int = 7
    target_s: float = 3.0
    xla_budget_s: float = 20.0  # skip xla timing where one step is estimated above this


FULL = Sizes(
    seq_lens=(64, 128, 256, 512, 1024, 2048, 4096),
    batch=2,
    memory_seq_lens=(512, 1024, 2048, 4096, 8192),
    memory_tokens=8192,
)
QUICK = Sizes(
    seq_lens=(64, 256), batch=2, memory_seq_lens=(256, 1024), memory_tokens=1024, **common.QUICK_TIMING
)


def log(msg: str) -> None:
    print(f"[bench attention] {msg}", file=sys.stderr, flush=True)


def shapes(s: Sizes, batch: int, seq_len: int) -> list[jax.ShapeDtypeStruct]:
    """Shapes of (q, k, v, do)."""
    q = (batch, seq_len, s.heads, s.head_dim)
    kv = (batch, seq_len, s.kv_heads, s.head_dim)
    return [jax.ShapeDtypeStruct(shp, jnp.dtype(s.dtype)) for shp in (q, kv, kv, q)]


def operands(s: Sizes, batch: int, seq_len: int):
    """(q, k, v, do) drawn on the device."""
    ks = jax.random.split(jax.random.key(seq_len), 4)
    return tuple(jax.random.normal(k, a.shape, a.dtype) for k, a in zip(ks, shapes(s, batch, seq_len)))


def step_fn(impl: str, block: int):
    """Jitted fwd+bwd: (q, k, v, do) -> (dq, dk, dv)."""

    def loss(q, k, v, do):
        o = attention.attend(q, k, v, implementation=impl, block=block)
        return jnp.vdot(o.astype(jnp.float32), do.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def runnable(s: Sizes) -> tuple[list[str], dict[str, str]]:
    """(implementations that run here, {name: why not} for the rest)."""
    why = attention.available(
        platform=Platform.here(), dtype=s.dtype, head_dim=s.head_dim, v_head_dim=s.head_dim
    )
    return ([n for n in attention.IMPLEMENTATIONS if why[n] is None], {n: r for n, r in why.items() if r})


def timing_rows(s: Sizes, impls: list[str]) -> list[dict[str, Any]]:
    """One row per implementation x length; ratios against xla of the same rounds."""
    rows, last_xla = [], None  # (S, median s) of the last xla timing
    for S in s.seq_lens:
        t0, args = time.perf_counter(), operands(s, s.batch, S)
        fns, compile_s = {}, {}
        for impl in impls:
            if impl == "xla" and last_xla and last_xla[1] * (S / last_xla[0]) ** 2 > s.xla_budget_s:
                log(f"S={S}: xla skipped (estimated over {s.xla_budget_s:.0f} s a step)")
                continue
            fn, _, compile_s[impl] = compile_jit(step_fn(impl, s.block), *args)
            fns[impl] = (fn, args)
        timings = time_rounds(fns, min_reps=s.min_reps, max_reps=s.max_reps, target_s=s.target_s)
        ref = timings.get("xla")
        for impl, t in timings.items():
            row = {
                "seq_len": S,
                "batch": s.batch,
                "implementation": impl,
                "time": t,
                "compile_s": compile_s[impl],
                "tokens_per_s": s.batch * S / t["median_s"],
                "block": (s.block or attention.default_block(S)) if impl == "chunked" else None,
            }
            row.update(ratio_stats(t, ref) if ref else {"ratio": None})
            rows.append(row)
        if ref:
            last_xla = (S, ref["median_s"])
        log(
            f"S={S}: "
            + ", ".join(f"{i} {t['median_s'] * 1e3:.1f} ms" for i, t in timings.items())
            + f" [{time.perf_counter() - t0:.0f} s]"
        )
    return rows


def crossover(rows: list[dict]) -> int | None:
    """The first timed length from which chunked is faster than xla at every longer one."""
    ratios = sorted(
        (r["seq_len"], r["ratio"]) for r in rows if r["implementation"] == "chunked" and r.get("ratio")
    )
    best = None
    for S, ratio in reversed(ratios):
        if ratio >= 1.0:
            break
        best = S
    return best


def memory_rows(s: Sizes, impls: list[str]) -> list[dict[str, Any]]:
    """Compiled temp bytes of fwd+bwd per implementation at equal tokens (compile only)."""
    rows = []
    for S in s.memory_seq_lens:
        B = max(1, s.memory_tokens // S)
        args = shapes(s, B, S)
        for impl in impls:
            compiled, _, secs = compile_jit(step_fn(impl, s.block), *args)
            mem = compiled.memory_analysis()
            assert mem is not None, "XLA's memory analysis of a compiled step"
            rows.append(
                {
                    "seq_len": S,
                    "batch": B,
                    "implementation": impl,
                    "temp_bytes": mem.temp_size_in_bytes,
                    "argument_bytes": mem.argument_size_in_bytes,
                    "compile_s": secs,
                }
            )
    return rows


def markdown(sec: dict[str, Any]) -> str:
    """The section's Markdown: setup, the timing table, the memory table, what did not run."""
    s = sec["sizes"]
    head = (
        f"## {TITLE}\n\nCausal GQA attention forward+backward, N={s['heads']} query / "
        f"K={s['kv_heads']} kv heads, D={s['head_dim']}, {s['dtype']}. *time / xla*: median "
        f"over xla's median in the same interleaved rounds (min-max of the per-round "
        f"ratios). Measured crossover (chunked faster from here on): "
        f"**{sec['crossover'] or 'none'}**; `auto` uses chunked from "
        f"S={sec['auto_threshold']} where cuDNN cannot run.\n"
    )
    rows = [
        [
            r["seq_len"],
            r["batch"],
            r["implementation"],
            r["block"] or "",
            fmt_ms(r["time"])[0],
            f"{r['tokens_per_s']:,.0f}",
            common.ratio_cell(r) if r["ratio"] else "",
            f"{r['cpu_ratio']:.2f}" if r["ratio"] else "",
        ]
        for r in sec["timing"]
    ]
    table = markdown_table(
        [
            "S",
            "B",
            "implementation",
            "block",
            "median ms",
            "tokens/s",
            "time / xla (min-max)",
            "CPU time / xla",
        ],
        rows,
    )
    first = {
        r["implementation"]: r["temp_bytes"]
        for r in sec["memory"]
        if r["seq_len"] == sec["memory"][0]["seq_len"]
    }
    mem = [
        [
            r["seq_len"],
            r["batch"],
            r["implementation"],
            mib(r["temp_bytes"]),
            f"{r['temp_bytes'] / max(first[r['implementation']], 1):.1f}",
        ]
        for r in sec["memory"]
    ]
    mem_table = markdown_table(
        ["S", "B", "implementation", "temp MiB", f"x temp at S={sec['memory'][0]['seq_len']}"], mem
    )
    note = "; ".join(f"`{n}` not run: {w}" for n, w in sec["unavailable"].items())
    return (
        f"{head}\n{table}\n\n**Compiled temp memory** at {s['memory_tokens']} tokens "
        f"(B x S fixed):\n\n{mem_table}" + (f"\n\n{note}." if note else "")
    )


def run(s: Sizes) -> dict[str, Any]:
    """The section's results (JSON-ready, with its Markdown under ``markdown``)."""
    t0 = time.perf_counter()
    impls, unavailable = runnable(s)
    timing = timing_rows(s, impls)
    memory = memory_rows(s, impls)
    sec = common.section_result(
        TITLE,
        s,
        timing=timing,
        memory=memory,
        crossover=crossover(timing),
        auto_threshold=attention.CHUNKED_MIN_SEQ,
        unavailable=unavailable,
        wall_s=time.perf_counter() - t0,
    )
    sec["markdown"] = markdown(sec)
    return sec
