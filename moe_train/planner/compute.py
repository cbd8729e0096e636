"""Compute calibration: how much of a GPU's peak each kind of work reaches, and the published
throughput figures the step-time prediction is compared with.

A compute file is TOML with a ``[compute]`` table of the fields of ``Compute`` (each a number
in (0, 1]) and a ``[compute.source]`` table saying where each came from. The shipped defaults
are ``moe_train/planner/compute.toml``; ``python -m moe_train.planner.ep_plan --compute FILE``
takes another (one
``make gpu-check`` writes from its measurements). A missing, unknown, non-numeric or
out-of-range field is a ``TopologyError`` naming the file and the key.

A share measured at each of ``MEASURED_CHUNKS`` (``a2a_hidden_step_4chunks``) may be given once
for all of them by its chunk-less name (``a2a_hidden_step``, ``FAMILIES``); a per-chunk key beside
it overrides it at that count. The generated ``compute.toml`` (``overlap_shares``) keeps a
per-chunk share only where the counts differ beyond ``overlap_shares.SPREAD``.

The overlap shares (the fields with ``hidden`` in their name) depend on the program XLA
schedules, so a ``[model.<preset>]`` table gives those measured on one model's own program
(with its ``[model.<preset>.source]``); ``load(path, model=...)`` applies them. Exchange shares
the table does not give are the defaults scaled by the model's measured ones over the defaults
at the same points (``MODEL_RATIO_NOTE``). A compute file without a ``model`` table takes the
shipped ones; one with an empty ``[model]`` table applies none.

``anchors(model, preset)``: the published figures (``moe_train/planner/anchors.toml``) for a model
preset on a cluster preset.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    # weight_gather=step: the share hidden of each part of its FSDP traffic (``steptime.STEP_PARTS``)
    # at 1, 2, 4 and 8 overlap chunks (``fsdp_step_share`` interpolates as ``a2a_hidden``)
    fsdp_hidden_step_gather_data_1chunk: float  # the step's gather over data, 1 chunk
    fsdp_hidden_step_gather_data_2chunks: float  # ... 2 chunks
    fsdp_hidden_step_gather_data_4chunks: float  # ... 4
    fsdp_hidden_step_gather_data_8chunks: float  # ... 8
    fsdp_hidden_step_gather_group_1chunk: float  # the per-use gathers inside the EP group, 1 chunk
    fsdp_hidden_step_gather_group_2chunks: float  # ... 2 chunks
    fsdp_hidden_step_gather_group_4chunks: float  # ... 4
    fsdp_hidden_step_gather_group_8chunks: float  # ... 8
    fsdp_hidden_step_reduce_scatter_group_1chunk: float  # gradient reduce-scatters in the EP group, 1 chunk
    fsdp_hidden_step_reduce_scatter_group_2chunks: float  # ... 2 chunks
    fsdp_hidden_step_reduce_scatter_group_4chunks: float  # ... 4
    fsdp_hidden_step_reduce_scatter_group_8chunks: float  # ... 8
    fsdp_hidden_step_reduce_scatter_data_1chunk: float  # expert gradients' reduce-scatters over data, 1 chunk
    fsdp_hidden_step_reduce_scatter_data_2chunks: float  # ... 2 chunks
    fsdp_hidden_step_reduce_scatter_data_4chunks: float  # ... 4
    fsdp_hidden_step_reduce_scatter_data_8chunks: float  # ... 8
    fsdp_hidden_step_all_reduce_1chunk: float  # the gradient all-reduces over data, 1 chunk
    fsdp_hidden_step_all_reduce_2chunks: float  # ... 2 chunks
    fsdp_hidden_step_all_reduce_4chunks: float  # ... 4
    fsdp_hidden_step_all_reduce_8chunks: float  # ... 8
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
    model: str = ""  # the model preset whose measured overlap shares apply ("": the defaults)


FIELDS = tuple(f.name for f in dataclasses.fields(Compute) if f.name not in ("source", "path", "model"))
MEASURED_CHUNKS = (1, 2, 4, 8)  # the chunk counts the per-chunk shares are measured at

OVERLAP_FIELDS = tuple(f for f in FIELDS if "hidden" in f)  # what a [model.<preset>] table may give


def _family(field: str) -> str | None:
    m = re.fullmatch(r"(.+)_(\d+)chunks?", field)
    return m.group(1) if m else None


# chunk-less name -> its fields at each of MEASURED_CHUNKS (a share measured per chunk count)
def _families() -> dict[str, tuple[str, ...]]:
    """Chunk-less name -> its fields at each of ``MEASURED_CHUNKS``."""
    names = dict.fromkeys(name for f in FIELDS if (name := _family(f)) is not None)
    members = {name: tuple(f for f in FIELDS if _family(f) == name) for name in names}
    return {name: fields for name, fields in members.items() if len(fields) == len(MEASURED_CHUNKS)}


FAMILIES = _families()  # a share measured per chunk count, by its chunk-less name
EXCHANGE_FIELDS = tuple(f for f in OVERLAP_FIELDS if f.startswith("a2a_hidden"))
MODEL_RATIO_NOTE = (
    "the default times {ratio:.2f}, {model}'s measured exchange shares over the defaults at the same points"
)


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
    return f"a2a_hidden_{'step_' if step else ''}{_chunks(chunks)}"


def fsdp_step_share(eff: Compute, part: str, chunks: int) -> float:
    """Share of one part of step mode's FSDP traffic (``steptime.STEP_PARTS``) hidden with
    ``chunks`` overlap chunks: measured at 1, 2, 4 and 8, between them linear in log2(chunks),
    beyond 8 the 8-chunk share."""
    shares = tuple(getattr(eff, f"fsdp_hidden_step_{part}_{_chunks(c)}") for c in MEASURED_CHUNKS)
    return _interpolated(shares, chunks)


def _chunks(chunks: int) -> str:
    return f"{chunks}chunk{'s' if chunks > 1 else ''}"


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

    def line(self, note: str = "") -> str:
        """The figure as ``make plan`` prints it, one line (``note``: added after its source)."""
        layout = f", {self.layout}" if self.layout else ""
        return (
            f"  published: {self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {self.tflops_per_gpu:,.0f} "
            f"TFLOP/s/GPU on {self.gpus} GPUs, {self.precision}{layout} ({self.source}{note})"
        )


def load(path: str | os.PathLike[str] | None = None, model: str | None = None) -> Compute:
    """The compute calibration at ``path`` (None: the shipped defaults), checked; with
    ``model``, its ``[model.<model>]`` overlap shares applied (module docstring)."""
    p = Path(path) if path is not None else DEFAULTS
    if not p.is_file():
        raise TopologyError(f"compute file {str(p)!r} does not exist")
    data = read_toml(p, TopologyError)
    base = _compute(data, p)
    models = data.get("model") if "model" in data else read_toml(DEFAULTS, TopologyError).get("model", {})
    if not isinstance(models, dict):
        raise TopologyError(f"{p}: model must be a table of [model.<preset>] tables")
    for name, table in models.items():
        _check_model(table, name, p)
    return base if model is None or model not in models else for_model(base, model, models[model])


def expanded(values: Mapping[str, Any], source: Mapping[str, str]) -> tuple[dict, dict]:
    """(values, sources) with each chunk-less share (``FAMILIES``) given to each of its
    per-chunk fields that ``values`` does not give itself, and the chunk-less name dropped."""
    out, why = dict(values), dict(source)
    for name, members in FAMILIES.items():
        if name in out:
            value, note = out.pop(name), why.pop(name, None)
            for field in members:
                if field not in out:
                    out[field] = value
                    if note is not None and field not in why:
                        why[field] = note
    return out, why


def for_model(base: Compute, model: str, table: Mapping) -> Compute:
    """``base`` with a model's measured overlap shares (a checked ``[model.<model>]`` table);
    the exchange shares it does not give scaled by its measured ones over ``base``'s."""
    raw = {k: float(v) for k, v in table.items() if k != "source"}
    given, notes = expanded(raw, table.get("source", {}))
    source = dict(base.source)
    source.update({k: f"{model}: {v}" for k, v in notes.items()})
    pairs = [(given[k], getattr(base, k)) for k in EXCHANGE_FIELDS if k in given and getattr(base, k) > 0]
    if pairs:
        ratio = sum(m for m, _ in pairs) / sum(d for _, d in pairs)
        for k in EXCHANGE_FIELDS:
            if k not in given:
                given[k] = min(1.0, getattr(base, k) * ratio)
                source[k] = f"{model}: " + MODEL_RATIO_NOTE.format(ratio=ratio, model=model)
    return dataclasses.replace(base, **given, source=source, model=model)


def _check_model(table, name: str, p: Path) -> None:
    where = f"model.{name}"
    if not isinstance(table, dict):
        raise TopologyError(f"{p}: [{where}] must be a table of overlap shares")
    valid = OVERLAP_FIELDS + tuple(f for f in FAMILIES if "hidden" in f)
    unknown = sorted(set(table) - set(valid) - {"source"})
    if unknown:
        raise TopologyError(f"{p}: unknown key {where}.{unknown[0]}; valid keys: {', '.join(valid)}")
    for key, value in table.items():
        if key != "source":
            check_number(value, f"{where}.{key}", str(p), hi=1.0, lo_open=False)
    source = table.get("source", {})
    if not isinstance(source, dict) or not all(isinstance(v, str) for v in source.values()):
        raise TopologyError(f"{p}: [{where}.source] must map each field to a string")


def _compute(data: Mapping, p: Path) -> Compute:
    table = data.get("compute")
    if not isinstance(table, dict):
        raise TopologyError(f"{p}: no [compute] table (fields: {', '.join(FIELDS)})")
    source = table.get("source", {})
    if not isinstance(source, dict):
        raise TopologyError(f"{p}: [compute.source] must map each field to a string")
    unknown = sorted(set(table) - set(FIELDS) - set(FAMILIES) - {"source"})
    if unknown:
        valid = ", ".join(FIELDS + tuple(FAMILIES))
        raise TopologyError(f"{p}: unknown key compute.{unknown[0]}; valid keys: {valid}")
    values, source = expanded({k: v for k, v in table.items() if k != "source"}, source)
    for key in FIELDS:
        value = values.get(key)
        if value is None:
            raise TopologyError(f"{p}: missing key compute.{key}; required keys: {', '.join(FIELDS)}")
        check_number(value, f"compute.{key}", str(p), hi=1.0, lo_open="hidden" not in key)
    if not isinstance(source, dict) or not all(isinstance(v, str) for v in source.values()):
        raise TopologyError(f"{p}: [compute.source] must map each field to a string")
    shares: dict[str, Any] = {k: float(values[k]) for k in FIELDS}
    return Compute(**shares, source=dict(source), path=str(p))


def anchors(model: str, preset: str) -> list[Anchor]:
    """The published figures for ``model`` on ``preset`` (possibly none)."""
    rows = read_toml(ANCHORS, TopologyError).get("anchor", [])
    for i, r in enumerate(rows):
        for key in ("gpus", "tokens_per_s_per_gpu", "tflops_per_gpu"):
            check_number(r.get(key), f"anchor[{i}].{key}", str(ANCHORS))
    return [Anchor(**r) for r in rows if r["model"] == model and r["preset"] == preset]
