"""What the planner chooses for a job the user left open, as the launcher's own ``--set`` items
(and ``--ep``), each with a note saying so (``make submit`` prints the notes; the job script
carries the items like any ``--set``, so the trainer validates them again).

The job is the fastest one that fits of the planner's search (``moe_train.planner.search``): EP size,
``parallel.weight_gather``, micro-batches, ``train.remat``, ``moe.overlap_chunks``,
``moe.dispatch_dtype`` and, only where nothing fits otherwise, ``moe.capacity_buckets``. A key
the user set (``--set``; ``--ep`` for EP) is kept and named as the user's; one the search left
as the model preset has it is the preset's. Nothing is chosen where nothing can be predicted
(fp32 compute, a nominal CPU preset), nor where no job fits (the memory verdict then names
the cheapest change).

``decided`` says, for every key, the job's value and who chose it (``make plan`` shows it);
``planned`` is its notes only (``make submit``, ``make compile``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_train import config
from moe_train.planner import ep_plan as topo_plan
from moe_train.planner import layout, search
from topology import presets

if TYPE_CHECKING:
    from moe_train.planner.ep_plan import Plan
    from moe_train.planner.request import Request

USER, PLANNER, PRESET = "user", "planner", "preset"  # Choice.source
# each key the planner decides, in the order shown, and the word its note starts with
PREFIX = {
    search.EP_KEY: "ep",
    search.GATHER_KEY: "fsdp",
    search.MICRO_BATCHES_KEY: "micro-batches",
    search.MICRO_SIZE_KEY: "micro-batches",
    search.REMAT_KEY: "remat",
    search.CHUNKS_KEY: "overlap",
    search.DISPATCH_KEY: "dispatch",
    search.BUCKETS_KEY: "buckets",
}


@dataclass(frozen=True)
class Choice:
    """One key the planner decides, as the job has it."""

    key: str  # one of PREFIX's keys (micro-batches: the key the user or the model preset uses)
    value: str  # the job's value
    source: str  # USER: a --set item (--ep); PLANNER: the launcher's item; PRESET: left as it was
    note: str | None  # the line make submit prints about it; None: nothing to say

    @property
    def item(self) -> str:
        return f"{self.key}={self.value}"


@dataclass(frozen=True)
class Decided:
    """The job with the planner's choices applied."""

    req: Request  # the request with the planner's --set items (and its EP as --ep)
    cfg: config.Config  # its config
    choices: tuple[Choice, ...]  # one per key, in PREFIX's order
    found: search.Found | None  # the search (None: nothing predicted)
    search_note: str | None  # what the search found, in one line (None: nothing searched)


def value_of(cfg: config.Config, key: str) -> str:
    """The config's value of one of the planner's keys, as a --set value."""
    section, name = key.split(".")
    value = getattr(getattr(cfg, section), name)
    return search.buckets_text(value) if key == search.BUCKETS_KEY else str(value)


def decided(req: Request, cluster: presets.Cluster, cfg: config.Config, top: int = 1) -> Decided:
    """The fastest job of the search that fits (``top``: how many the search ranks)."""
    found = search.search(req, cluster, cfg, top)
    best = found.ranked[0] if found and found.ranked else None
    fixed = search.user_keys(req)
    job_req, job_cfg = req, cfg
    if best and best.changes:
        ep = best.settings.ep if best.settings.ep != cfg.parallel.ep else req.ep
        items = tuple(c for c in best.changes if not c.startswith(search.EP_KEY + "="))
        job_req = dataclasses.replace(req, sets=(*req.sets, *items), ep=ep)
        job_cfg, _ = layout.model_config(job_req, cluster)
    chosen = tuple(_choice(key, cfg, job_cfg, fixed, best) for key in _keys(cfg, fixed))
    if req.ep_fitted:
        chosen = tuple(_fitted(c, req) if c.key == search.EP_KEY else c for c in chosen)
    return Decided(job_req, job_cfg, chosen, found, summary(found))


def _fitted(c: Choice, req: Request) -> Choice:
    """The EP choice where the model preset's EP did not divide the job's GPUs."""
    return Choice(
        c.key,
        c.value,
        PLANNER,
        f"{PREFIX[c.key]}: {c.key}={c.value}, the planner's choice (the model preset's "
        f"{req.ep_fitted} does not divide this job's GPUs; --ep N to set it)",
    )


def _choice(
    key: str, base: config.Config, cfg: config.Config, fixed: frozenset[str], best: search.Candidate | None
) -> Choice:
    """``key`` as the job ``cfg`` has it, against the model preset's ``base``."""
    value, was = value_of(cfg, key), value_of(base, key)
    if key in fixed:
        return Choice(key, value, USER, None)
    if best is None or f"{key}={value}" not in best.changes:
        return Choice(key, value, PRESET, None)
    how = f"--ep {was}" if key == search.EP_KEY else f"--set {key}={was}"
    count = (
        f" ({best.settings.micro_batches} micro-batches per step)"
        if key in (search.MICRO_BATCHES_KEY, search.MICRO_SIZE_KEY)
        else ""
    )
    return Choice(
        key,
        value,
        PLANNER,
        f"{PREFIX[key]}: {key}={value}{count}, the planner's "
        f"choice (the model preset's: {was}; {how} to keep it)",
    )


def _keys(cfg: config.Config, fixed: frozenset[str]) -> list[str]:
    micro = search.micro_key(cfg, fixed)
    return [k for k in PREFIX if k not in (search.MICRO_BATCHES_KEY, search.MICRO_SIZE_KEY) or k == micro]


def planned(
    req: Request, cluster: presets.Cluster, cfg: config.Config
) -> tuple[Request, config.Config, tuple[str, ...]]:
    """(``req`` with the planner's choices, its config, the notes: what the search found,
    then one per key the planner chose)."""
    d = decided(req, cluster, cfg)
    return d.req, d.cfg, tuple(n for n in (d.search_note, *(c.note for c in d.choices)) if n)


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s >= 10 else f"{s:.3g} s"


def summary(found: search.Found | None) -> str | None:
    """One line: how many jobs were searched, the fastest that fits against the preset's."""
    if found is None:
        return None
    plans = f"{found.judged} memory plan{'' if found.judged == 1 else 's'}"
    head = f"search: {found.timed:,} job{'' if found.timed == 1 else 's'} timed, {plans}; " + (
        f"kept as set: {', '.join(found.fixed)}; " if found.fixed else ""
    )
    preset = (
        f"the model preset's settings predict {_secs(found.base_step_s)}"
        f"{'' if found.base_fits else ' and do not fit'}"
    )
    if not found.ranked:
        return head + f"none fits ({preset})"
    st = found.ranked[0].step
    text = (
        head + f"the fastest that fits predicts {_secs(st.step_s)} per step, "
        f"{st.tokens_per_s:,.0f} tokens/s/GPU, MFU {st.mfu:.1%} ({preset})"
    )
    if found.opt_in is not None:
        job, best = found.opt_in, found.ranked[0]
        # the keys the search leaves alone unless set (the others it searched, and chose
        # otherwise only because these were not set)
        keys = [c.partition("=")[0] for c in job.changes if c not in best.changes]
        extra = [k for k in keys if k in (*search.OPT_IN, search.BUCKETS_KEY)]
        risk = (
            f" (a step overflowing {job.settings.buckets[-1]:g}x then runs out of memory)"
            if job.settings.buckets != best.settings.buckets
            else ""
        )
        text += (
            f"; opting in, {' '.join(job.changes)}{risk} predicts {_secs(job.step.step_s)} "
            f"({', '.join(extra) or 'no new key'} not "
            f"searched unless set: --set them to use it)"
        )
    return text + "; make plan TOP=5 (--top 5) lists the runners-up"


def prediction(req: Request, cfg: config.Config) -> Plan:
    """The placement, all-to-all and predicted step of this job as its ``--set`` items make
    it (``moe_train.planner.ep_plan``); TopologyError, ConfigError or ValueError where it cannot be made."""
    return topo_plan.request_plan(req, cfg.parallel.ep)
