"""Compute calibration: how much of a GPU's peak each kind of work reaches, and the published
throughput figures the step-time prediction is compared with.

A compute file is TOML with a ``[compute]`` table of the fields of ``Compute`` (each a number
in (0, 1]) and a ``[compute.source]`` table saying where each came from. The shipped defaults
are ``topology/compute.toml``; ``python -m topology plan --compute FILE`` takes another (one
``make gpu-check`` writes from its measurements). A missing, unknown, non-numeric or
out-of-range field is a ``TopologyError`` naming the file and the key.

``anchors(model, preset)``: the published figures (``topology/anchors.toml``) for a model
preset on a cluster preset.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path

from moe_train.base.tomlfile import read_toml
from topology.presets import TopologyError, check_number

DEFAULTS = Path(__file__).with_name("compute.toml")
ANCHORS = Path(__file__).with_name("anchors.toml")


@dataclasses.dataclass(frozen=True)
class Compute:
    """Shares of the peaks reached, each in (0, 1]."""

    gemm_efficiency: float  # dense bf16 GEMMs, of the bf16 peak
    grouped_gemm_efficiency: float  # routed experts' grouped GEMMs, of the bf16 peak
    fp8_gemm_efficiency: float  # fp8 GEMMs (dense and grouped), of the fp8 peak
    attention_efficiency: float  # attention scores forward + backward, of the bf16 peak
    hbm_efficiency: float  # optimizer / accumulation memory traffic, of HBM bandwidth
    fsdp_hidden_micro_batch: float  # share of the FSDP collectives hidden, weights gathered per micro-batch
    fsdp_hidden_step_gather: float  # weight_gather=step: share of its all-gathers hidden
    fsdp_hidden_step_reduce_scatter: float  # weight_gather=step: of its gradient reduce-scatters
    fsdp_hidden_step_all_reduce: float  # weight_gather=step: of its gradient all-reduces over data
    a2a_hidden_1chunk: float  # share of the all-to-all (up to the expert GEMMs' time) hidden, 1 chunk
    a2a_hidden_2chunks: float  # the same with moe.overlap_chunks=2
    a2a_hidden_4chunks: float  # ... 4
    a2a_hidden_8chunks: float  # ... 8 (weight_gather=micro_batch; a2a_hidden interpolates)
    a2a_hidden_step_1chunk: float  # the same under parallel.weight_gather=step, 1 chunk
    a2a_hidden_step_2chunks: float  # ... 2
    a2a_hidden_step_4chunks: float  # ... 4
    a2a_hidden_step_8chunks: float  # ... 8
    a2a_hidden_hierarchical_8chunks: float  # hierarchical dispatch with 8 chunks (scales the curves)
    source: Mapping[str, str]  # field -> where its value comes from
    path: str  # the file it was read from


FIELDS = tuple(f.name for f in dataclasses.fields(Compute) if f.name not in ("source", "path"))


MEASURED_CHUNKS = (1, 2, 4, 8)  # the chunk counts the a2a_hidden_* shares were measured at


def a2a_hidden(eff: Compute, chunks: int, step: bool = False, hierarchical: bool = False) -> float:
    """Share of the all-to-all time (up to the expert GEMMs' time) hidden with ``chunks``
    overlap chunks: the share measured at that chunk count (``step``: under
    ``parallel.weight_gather=step``, whose schedule hides less), linear in log2(chunks)
    between measured counts; beyond 8, the 8-chunk share (nothing extrapolated).
    ``hierarchical`` (EP groups across NVLink domains): scaled by the hierarchical exchange's
    measured share at 8 chunks over the flat one's (its staged exchanges leave the schedule
    fewer GEMMs to place under each)."""
    share = _interpolated(_shares(eff, step), chunks)
    if not hierarchical:
        return share
    flat8 = _shares(eff, False)[-1]
    return min(share, share * eff.a2a_hidden_hierarchical_8chunks / flat8) if flat8 > 0 else 0.0


def share_field(chunks: int, step: bool) -> str:
    """The ``Compute`` field of the exchange's share measured at ``chunks`` (one of
    ``MEASURED_CHUNKS``) in step mode or not."""
    return f"a2a_hidden_{'step_' if step else ''}{chunks}chunk{'s' if chunks > 1 else ''}"


def _shares(eff: Compute, step: bool) -> tuple[float, ...]:
    return tuple(getattr(eff, share_field(c, step)) for c in MEASURED_CHUNKS)


def _interpolated(shares: tuple[float, ...], chunks: int) -> float:
    x = math.log2(min(max(chunks, 1), MEASURED_CHUNKS[-1]))
    i = min(int(x), len(shares) - 2)
    return shares[i] + (shares[i + 1] - shares[i]) * (x - i)


@dataclasses.dataclass(frozen=True)
class Anchor:
    """One published training throughput."""

    model: str  # model preset it corresponds to
    preset: str  # cluster preset of the system
    gpus: int  # GPUs of the published job
    precision: str  # as published (FP8, MXFP8, BF16)
    layout: str  # the published parallel layout ("" when not given)
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    source: str


def load(path: str | os.PathLike[str] | None = None) -> Compute:
    """The compute calibration at ``path`` (None: the shipped defaults), checked."""
    p = Path(path) if path is not None else DEFAULTS
    if not p.is_file():
        raise TopologyError(f"compute file {str(p)!r} does not exist")
    table = read_toml(p, TopologyError).get("compute")
    if not isinstance(table, dict):
        raise TopologyError(f"{p}: no [compute] table (fields: {', '.join(FIELDS)})")
    source = table.get("source", {})
    values = {k: v for k, v in table.items() if k != "source"}
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise TopologyError(f"{p}: unknown key compute.{unknown[0]}; valid keys: {', '.join(FIELDS)}")
    for key in FIELDS:
        value = values.get(key)
        if value is None:
            raise TopologyError(f"{p}: missing key compute.{key}; required keys: {', '.join(FIELDS)}")
        check_number(value, f"compute.{key}", str(p), hi=1.0, lo_open="hidden" not in key)
    if not isinstance(source, dict) or not all(isinstance(v, str) for v in source.values()):
        raise TopologyError(f"{p}: [compute.source] must map each field to a string")
    return Compute(**{k: float(values[k]) for k in FIELDS}, source=dict(source), path=str(p))


def anchors(model: str, preset: str) -> list[Anchor]:
    """The published figures for ``model`` on ``preset`` (possibly none)."""
    rows = read_toml(ANCHORS, TopologyError).get("anchor", [])
    for i, r in enumerate(rows):
        for key in ("gpus", "tokens_per_s_per_gpu", "tflops_per_gpu"):
            check_number(r.get(key), f"anchor[{i}].{key}", str(ANCHORS))
    return [Anchor(**r) for r in rows if r["model"] == model and r["preset"] == preset]
