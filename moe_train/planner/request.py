"""The job request the launcher and the planner share: what the user asked for (``Request``),
the one error a request that cannot become a job raises (``LaunchError``), the free-text check
every value that reaches a batch script passes (``check_text``), the cluster preset it names
(``load_cluster``) and the smoke job it stands for (``smoke_request``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from moe_train import config
from topology import presets

SMOKE_MODEL, SMOKE_STEPS = "tiny", 20  # the smoke job's model preset and its default steps

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class LaunchError(ValueError):
    """A request that cannot become a job: printed as one ``error:`` line, exit code 2."""


@dataclass(frozen=True)
class Request:
    """What the user asked for (command line flags; empty strings mean "not given")."""

    preset: str  # cluster preset name or path to a site's cluster .toml
    model: str  # model preset (moe_train/config/presets)
    nodes: int  # nodes to allocate
    steps: int | None = None  # total training steps; None: the model preset's
    sets: tuple[str, ...] = ()  # "section.key=value" trainer overrides
    out: str = ""  # run directory; "": runs/slurm/<job name>-<UTC time>
    ep: int | None = None  # expert-parallel size; None: the model config's parallel.ep
    # ep stands in for the model preset's parallel.ep, which does not divide the job's GPUs
    # (the largest valid EP below it): searched like the preset's, not kept as the user's
    ep_fitted: int = 0  # the model preset's parallel.ep it replaced; 0: none replaced
    time: str = ""  # wall-clock limit; "": site file, else DEFAULT_TIME
    partition: str = ""  # "": site file
    account: str = ""  # "": site file
    qos: str = ""  # "": site file
    job_name: str = ""  # "": moe-<model>
    image: str = ""  # container image; "": site file, else the preset's
    allow_straddle: bool = False  # accept EP groups that cross NVLink domains (with a warning)
    no_container: bool = False  # run on the host's Python even on a container preset
    smoke: bool = False  # the single-node smoke job: preflight + a short tiny-model run
    dry_run: bool = False  # only render: the preset's base image may stand in for the kit image
    ignore_memory: bool = False  # submit even when the memory planner says it will not fit
    compute: str = ""  # compute calibration the planner's choices use; "": moe_train/planner/compute.toml


def check_text(what: str, value: str, pattern: re.Pattern | None = None, hint: str = "") -> str:
    """``value`` unchanged when it has no control characters (and matches ``pattern``)."""
    if _CONTROL.search(value):
        raise LaunchError(f"{what} {value!r} contains a control character (newline, tab, ...)")
    if pattern is not None and not pattern.fullmatch(value):
        raise LaunchError(f"{what} {value!r} is not valid{'; ' + hint if hint else ''}")
    return value


def load_cluster(ref: str) -> presets.Cluster:
    try:
        return presets.load(check_text("cluster preset", ref))
    except presets.TopologyError as err:
        raise LaunchError(str(err)) from None


def smoke_request(req: Request, cluster: presets.Cluster) -> Request:
    """The smoke job: one node, the tiny model, a few steps, EP over the node's devices."""
    tiny = config.build(SMOKE_MODEL)
    ep = req.ep or math.gcd(cluster.gpus_per_node, tiny.moe.num_experts)
    return dataclasses.replace(
        req,
        model=SMOKE_MODEL,
        nodes=1,
        ep=ep,
        steps=req.steps or SMOKE_STEPS,
        job_name=req.job_name or f"moe-smoke-{cluster.name}",
    )


# the flags that also name a config key: a --set of the same key must agree
FLAG_KEYS = {"ep": ("--ep", "parallel.ep"), "steps": ("--steps", "train.steps")}


def check_twice(args) -> None:
    """LaunchError when a flag and a ``--set`` (or two ``--set``) give one key different values;
    ``args``: the parsed command line (``sets`` and the ``FLAG_KEYS`` names)."""
    flags = {
        flag: (key, str(getattr(args, name)))
        for name, (flag, key) in FLAG_KEYS.items()
        if getattr(args, name) is not None
    }
    try:
        config.merge_flags(list(args.sets), flags)
    except config.ConfigError as err:
        raise LaunchError(str(err)) from None
