"""Every rule about a job, in one module that imports no JAX.

Shape letters (``moe_train.base.notation``): T one shard's tokens, K top-k, O fast-link domains
in an EP group, C slots per (source, destination) pair; the EP size (``ep``), the local experts and
the shards per domain (``domain_size``) are named in words.

The dispatchers, the stepper, the memory planner, the benchmarks, the Slurm launcher and the
sharding code all ask this module; none of them restates a rule.

- Capacity buckets: an exchange's receive buffer holds C slots per pair, a bucket factor
  times the load of a pair under perfectly balanced routing (``bucket_slots``); the factor
  None is the worst case, which no routing can overflow.
- Stage sizes of the flat (``a2a_stage``) and two-stage (``hierarchical_stages``) exchanges.
- ``BucketPolicy``: which bucket the next step runs on (escalate on overflow, step down after
  a run of steps that would have fit the next smaller one).
- ``dispatcher``: the token exchange a job uses; ``bucket_factors``: the buckets it compiles.
- Divisibility of a job (``check_ep``, ``check_dp``, ``check_width``, ``check_batch``):
  ConfigError naming the key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

from moe_train.config.checks import ConfigError, divisors_text, some_divisors
from moe_train.config.schema import DISPATCHERS  # moe.dispatcher choices

SLOT_MULTIPLE = 8  # slots per pair are a multiple of this (aligned buffer rows)


def bucket_slots(factor: float | None, balanced: float, worst: int) -> int:
    """Slots for ``factor`` x the ``balanced`` load (a multiple of 8), capped at ``worst``;
    ``factor`` None: ``worst``."""
    if factor is None:
        return worst
    return max(1, min(worst, SLOT_MULTIPLE * math.ceil(factor * balanced / SLOT_MULTIPLE)))


class Stage(NamedTuple):
    """One exchange of a dispatcher."""

    slots: int  # C: receive-buffer rows per (source, destination) pair
    balanced: float  # rows a pair carries under perfectly balanced routing
    peers: int  # shards exchanging in this stage (the receive buffer is peers * slots rows)


def domain_hit(domains: int, top_k: int) -> float:
    """Chance that a token uses a given domain of ``domains`` under uniform routing."""
    return 1.0 - (1.0 - 1.0 / domains) ** top_k


def a2a_stage(tokens: int, top_k: int, local_experts: int, ep: int, factor: float | None) -> Stage:
    """The flat all-to-all over the whole EP group: each assignment goes to its expert's shard.
    Worst case: all of a shard's tokens, each at most min(K, local experts) times, to one destination."""
    balanced = tokens * top_k / ep
    return Stage(bucket_slots(factor, balanced, tokens * min(top_k, local_experts)), balanced, ep)


def hierarchical_stages(
    tokens: int, top_k: int, local_experts: int, domains: int, domain_size: int, factor: float | None
) -> tuple[Stage, Stage]:
    """The two-stage exchange: stage 1 sends each token once to every remote domain holding one
    of its experts (worst case: all T tokens to one domain); stage 2 fans the received rows out
    inside the domain (worst case: every received row, min(K, local experts) times, to one shard)."""
    T, K, O, per_domain = tokens, top_k, domains, domain_size
    hit = domain_hit(O, K)
    one = Stage(bucket_slots(factor, T * hit, T), T * hit, O)
    two_balanced = T * K / per_domain
    two = Stage(
        bucket_slots(factor, two_balanced, O * one.slots * min(K, local_experts)), two_balanced, per_domain
    )
    return one, two


class BucketPolicy:
    """The capacity bucket the next step runs on, over ``factors`` (smallest first, then None:
    the worst case). A step that overflows reruns on the next bucket (``overflowed``); after
    ``step_down_after`` steps in a row whose largest pair load (relative to the balanced load)
    would have fit the next smaller bucket, the policy steps down (``finished``)."""

    def __init__(self, factors: Sequence[float | None], step_down_after: int):
        if not factors or factors[-1] is not None:
            raise ValueError(f"bucket factors must end with the worst case None, got {factors}")
        self.factors, self.step_down_after = tuple(factors), step_down_after
        self.bucket, self.reruns, self._fits_smaller = 0, 0, 0

    @property
    def factor(self) -> float | None:
        return self.factors[self.bucket]

    def overflowed(self) -> None:
        """The step overflowed the current bucket: the next try uses the next larger one."""
        if self.factor is None:
            raise RuntimeError("the worst-case bucket overflowed: an exchange is mis-sized")
        self.bucket += 1
        self.reruns += 1
        self._fits_smaller = 0

    def finished(self, max_pair_load: float) -> None:
        """A step held; ``max_pair_load`` is its largest pair load / balanced load."""
        if self.bucket == 0:
            return
        smaller = self.factors[self.bucket - 1]
        assert smaller is not None, "only the last bucket is the worst case"
        self._fits_smaller = self._fits_smaller + 1 if max_pair_load <= smaller else 0
        if self._fits_smaller >= self.step_down_after:
            self.bucket -= 1
            self._fits_smaller = 0


# ----------------------------------------------------------------------------- dispatcher

BUCKETED = ("a2a", "hierarchical")  # dispatchers with static, bucket-sized receive buffers


def dispatcher(requested: str, devices: int, ep: int, domains: int) -> str:
    """The exchange a job of ``devices`` with EP groups of ``ep`` over ``domains`` fast-link
    domains uses for ``moe.dispatcher=requested``: local | allgather | a2a | hierarchical.
    One device or ep 1: local; auto: hierarchical once a group spans several domains."""
    if requested not in DISPATCHERS:
        raise ConfigError(
            f"moe.dispatcher={requested!r} is not valid; choose one of: {', '.join(DISPATCHERS)}"
        )
    if devices == 1 or ep == 1:
        return "local"
    if requested == "auto":
        return "hierarchical" if domains > 1 else "a2a"
    if requested == "hierarchical" and domains == 1:
        raise ConfigError(
            f"moe.dispatcher=hierarchical needs an EP group spanning several "
            f"domains: parallel.ep={ep} fits one fast-link domain; lower "
            f"parallel.domain_size or use moe.dispatcher=a2a"
        )
    return requested


def bucket_factors(dispatcher: str, buckets: Sequence[float]) -> tuple[float | None, ...]:
    """The capacity factors a job compiles, smallest first: ``buckets`` then None (the worst
    case) for a2a and hierarchical; (None,) for the others (no bucketed buffer)."""
    if dispatcher in BUCKETED:
        return (*sorted(buckets), None)
    return (None,)


# ----------------------------------------------------------------------------- divisibility


def ep_fault(devices: int, ep: int, num_experts: int) -> str | None:
    """Which rule EP size ``ep`` breaks: "devices" (it must divide them; ep < 1 too),
    "experts" (it must divide moe.num_experts), or None."""
    if ep < 1 or devices % ep:
        return "devices"
    if num_experts % ep:
        return "experts"
    return None


def valid_eps(devices: int, num_experts: int) -> str:
    """EP sizes dividing both the devices and the experts (some of them, for messages)."""
    return divisors_text(math.gcd(devices, num_experts), limit=16)


def check_ep(devices: int, ep: int, num_experts: int) -> None:
    """ConfigError unless ``ep`` divides the ``devices`` and the ``num_experts``."""
    fault = ep_fault(devices, ep, num_experts)
    if fault == "devices":
        raise ConfigError(
            f"parallel.ep={ep} does not divide the {devices} devices; valid ep "
            f"(dividing them and moe.num_experts={num_experts}): "
            f"{valid_eps(devices, num_experts)}"
        )
    if fault == "experts":
        raise ConfigError(
            f"moe.num_experts={num_experts} is not divisible by parallel.ep={ep}; "
            f"valid ep for {devices} devices: {valid_eps(devices, num_experts)}"
        )


def check_dp(devices: int, ep: int, dp: int) -> int:
    """The data-parallel size: ``dp``, or ``devices // ep`` for 0; ConfigError when it times
    ``ep`` is not ``devices`` (after ``check_ep``)."""
    want = devices // ep
    if dp and dp != want:
        raise ConfigError(
            f"parallel.dp={dp} x parallel.ep={ep} = {dp * ep} but the mesh has "
            f"{devices} devices; set parallel.dp={want} (or 0)"
        )
    return want


def check_width(hidden: int, dp: int) -> None:
    """ConfigError unless the data-parallel (FSDP) size ``dp`` divides ``model.hidden``."""
    if hidden % dp:
        raise ConfigError(
            f"model.hidden={hidden} is not divisible by the data-parallel size {dp} "
            f"(devices / parallel.ep); valid data-parallel sizes: "
            f"{divisors_text(hidden)}"
        )


def nearest_batches(batch: int, multiple: int) -> list[int]:
    """The multiples of ``multiple`` nearest ``batch``: the one below it (when positive) and
    the one above it."""
    below = batch // multiple * multiple
    return [b for b in (below, below + multiple) if b > 0]


def batches_text(batch: int, multiple: int, seq_len: int = 0) -> str:
    """``nearest_batches`` for messages, each with the tokens per step it gives (``seq_len``
    tokens per sequence; 0: sizes only)."""

    def tokens(b: int) -> str:
        n = b * seq_len
        return f" ({n / 1e6:.1f}M tokens per step)" if n >= 1e6 else f" ({n:,} tokens per step)"

    return " or ".join(f"{b}{tokens(b) if seq_len else ''}" for b in nearest_batches(batch, multiple))


def check_batch(batch: int, devices: int, micro_batches: int = 1, seq_len: int = 0) -> None:
    """ConfigError unless ``train.batch_size`` splits over the ``devices`` and then into
    ``train.micro_batches`` micro-batches on each; the message names the nearest batch sizes
    that do (with their tokens per step when ``seq_len`` is given)."""
    if batch % devices:
        fits = [d for d in some_divisors(batch, 64) if d <= devices]
        raise ConfigError(
            f"train.batch_size={batch} is not divisible by {devices} devices; "
            f"nearest that are: {batches_text(batch, devices, seq_len)} (or "
            f"parallel.devices in {fits})"
        )
    per = batch // devices
    if per % micro_batches:
        raise ConfigError(
            f"train.micro_batches={micro_batches} does not divide the {per} "
            f"sequences per device (train.batch_size={batch} over {devices} "
            f"devices); choose one of [{divisors_text(per)}] or train.batch_size="
            f"{batches_text(batch, devices * micro_batches, seq_len)}"
        )


@dataclasses.dataclass(frozen=True)
class EPPlan:
    """Static choices of one compiled step's MoE layers (one per capacity bucket)."""

    dispatcher: str  # local | allgather | a2a | hierarchical
    ep: int  # expert-parallel size
    capacity_factor: float | None = None  # buffer slots per pair, x balanced load; None: worst
    chunks: int = 1  # dispatch the tokens in this many sequential chunks
    dispatch_dtype: str = "activation"  # rows sent as: activation | fp8 (moe.dispatch_dtype)
