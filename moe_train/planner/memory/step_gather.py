"""What ``parallel.weight_gather=step`` adds to a step's memory (``moe_train.train.gather``).

Once per step every weight is cast to the compute dtype (the router and the norm scales stay
fp32) and constrained to its master sharding without the ``data`` axis; that copy lives for
the whole step. Per device it holds:

    routed experts   routed / P * a          [E, H, F] split (EP, data, -) -> (EP, -, -)
    other matrices   other / P * a           split over every device -> over the EP group
                     other * a               where the devices do not divide the width
                                             (split over data only -> whole)
    router           its share of those in fp32 (4 bytes)
    MLA latents      replicated ones: cast copy (a != pb only)
    norm scales      a copy only where param_dtype is not fp32

A weight whose copy has the master's dtype and placement (dp = 1, a = pb) is the master
itself: no copy. Each micro-batch's gradient with respect to the copy is produced at the
copy's size in its dtype (the backward loop of scanned layers writes it whole), then cast to
fp32 one array at a time and reduce-scattered to the master sharding (``gather.reduced``):
the gradient is a second copy's bytes, and, with a narrower compute dtype, the largest
array's fp32 cast is live after the backward pass, in memory the activations have freed.

Per layer, only the weights still gathered per use inside the EP group (the other matrices
and the router, where the copy keeps them split over it) are copied as in ``micro_batch``
mode; the experts (and the whole copy where P = 1 or the width is split over data only) are
used as held, their residuals are the copy itself. fp8 still quantizes each layer's experts.

Imports only the config and the FLOPs counts: ``moe_train.planner.memory.estimate`` calls it with
the master's split.
"""

from __future__ import annotations

from moe_train.config import Config

STEP = "step"  # parallel.weight_gather value this module is about


def active(cfg: Config, dp: int, a: int, pb: int) -> bool:
    """Whether the step's copy differs from the master weights (else it is them: no bytes)."""
    return cfg.parallel.weight_gather == STEP and (dp > 1 or a != pb)


def in_group(cfg: Config, devices: int, ep: int) -> bool:
    """Whether the copy keeps the non-expert weights split over an EP group of more than one
    device (the master splits them over every device), so each use still gathers them."""
    return ep > 1 and cfg.model.hidden % devices == 0


def copy_bytes(
    cfg: Config,
    devices: int,
    ep: int,
    dp: int,
    a: int,
    pb: int,
    split: tuple[int, int, int],
    router: int,
    norms: int,
) -> int:
    """Per-device bytes of the step's copy. ``split``: (routed expert, FSDP-sharded,
    replicated) parameter counts (``estimate.param_split``); ``router``: router weights
    among the FSDP-sharded ones; ``norms``: norm scales among the replicated ones."""
    if not active(cfg, dp, a, pb):
        return 0
    routed, fsdp, rep = split
    ways = ep if in_group(cfg, devices, ep) else 1
    moved = lambda n, b: n * b if dp > 1 or b != pb else 0  # noqa: E731 (new buffer only)
    matrices = routed // ep * a + (fsdp - router) // ways * a
    return matrices + moved(router // ways, 4) + (rep - norms) * a * (a != pb) + norms * 4 * (pb != 4)


def largest_cast(cfg: Config, devices: int, ep: int, a: int) -> int:
    """Bytes of the largest array of the copy's gradient cast to fp32 before its reduction
    (0 when the compute dtype is fp32): the stacked experts of one projection, a stacked
    dense MLP projection or the embedding / output head, per device."""
    if a >= 4:
        return 0
    m, e = cfg.model, cfg.moe
    ways = ep if in_group(cfg, devices, ep) else 1
    n_dense = m.first_dense_layers if m.scan_layers else min(1, m.first_dense_layers)
    n_moe = m.num_layers - m.first_dense_layers
    n_moe = n_moe if m.scan_layers else min(1, n_moe)
    experts = n_moe * (e.num_experts // ep) * m.hidden * e.expert_ffn
    return 4 * max(experts, n_dense * m.hidden * m.dense_ffn // ways, m.vocab_size * m.hidden // ways)
