"""Train state, optimizer and the jitted train step.

Shape letters (``moe_train.base.notation``): B batch, S sequence, V vocab, L layers (the MoE
layers; in the loss the main head and the MTP depths), E experts.

Outside the optimizer the step updates two kinds of state: the aux-loss-free expert bias
(``moe_state``) and, under ``precision.compute=fp8``, the fp8 scaling state (``fp8_state``,
see ``moe_train.model.precision``): the step differentiates the loss with respect to it and keeps
that "gradient", which the quantizers' custom VJPs set to each tensor's new scale and amax
history.

The step is compiled once per run: routing changes alter values, never shapes. Every trace of
the step increments ``StepCounter.traces``, which the loop reports as ``compilations``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from moe_train.base.platform import Platform
from moe_train.config import Config, compute_dtype
from moe_train.data import packing
from moe_train.model import loss, mtp, remat
from moe_train.model.precision import FP8_COLLECTION
from moe_train.model.settings import model_settings
from moe_train.model.transformer import GROUPS, LAYER_NAME, Transformer
from moe_train.moe import stats as moe_stats
from moe_train.parallel import sharding
from moe_train.parallel.jobplan import EPPlan
from moe_train.train.gather import StepGather


@flax.struct.dataclass
class TrainState:
    """Everything a resumed run needs besides the config (the data order follows ``step``)."""

    step: jax.Array  # completed optimizer steps (int32 scalar)
    params: Any  # fp32 master weights
    opt_state: Any  # AdamW moments
    moe_state: Any  # {"moe_layers": {"moe": {"expert_bias": [L, E]}}}; looped: "layer_i": [E]
    fp8_state: Any  # {..: {"scale": [], "amax_history": [history]}} per fp8-quantized tensor; {} unless fp8

    def replace(self, **kw) -> TrainState:
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's memory analysis of one compiled step, bytes per device."""

    argument: int  # inputs: the train state and the batch
    output: int  # outputs: the new state and the metrics
    alias: int  # outputs written in place of donated inputs (the state)
    temp: int  # scratch: activations, gradients, gathered weights, exchange buffers
    code: int  # generated code (0 on CPU)
    xla_peak: int = 0  # XLA's own peak of the buffers live at once (0 where it reports none)

    @property
    def peak(self) -> int:
        """Arguments + temp + the outputs that do not reuse a donated input, + code."""
        return self.argument + self.temp + self.output - self.alias + self.code

    def metrics(self) -> dict[str, int]:
        """For the run's metrics: ``compiled_peak_bytes``, ``compiled_temp_bytes``, ...,
        ``compiled_xla_peak_bytes`` where XLA reports its own peak."""
        return {
            "compiled_peak_bytes": self.peak,
            "compiled_temp_bytes": self.temp,
            "compiled_argument_bytes": self.argument,
            "compiled_output_bytes": self.output,
            "compiled_alias_bytes": self.alias,
        } | ({"compiled_xla_peak_bytes": self.xla_peak} if self.xla_peak else {})

    def line(self) -> str:
        """One log line, GiB: XLA's own peak where it reports one, then the sum of the parts
        (``peak``), which counts every buffer as if all were live at once. On a TPU v5e that sum
        read 17.32 GiB for a step that ran on the chip's 15.75 GiB (issue 49)."""
        gib = 2.0**30
        parts = (
            f"arguments {self.argument / gib:.2f} + temp {self.temp / gib:.2f} + outputs not "
            f"aliased {(self.output - self.alias) / gib:.2f}"
        )
        if not self.xla_peak:
            return f"compiled step memory per device: peak {self.peak / gib:.2f} GiB ({parts})"
        return (
            f"compiled step memory per device: XLA's peak {self.xla_peak / gib:.2f} GiB of buffers "
            f"live at once; {parts} = {self.peak / gib:.2f} GiB if all were live together"
        )

    @classmethod
    def of(cls, compiled) -> CompiledMemory | None:
        """From a compiled executable's ``memory_analysis()`` (None where it has none)."""
        stats = compiled.memory_analysis()
        if stats is None:
            return None
        return cls(
            argument=int(stats.argument_size_in_bytes),
            output=int(stats.output_size_in_bytes),
            alias=int(stats.alias_size_in_bytes),
            temp=int(stats.temp_size_in_bytes),
            code=int(stats.generated_code_size_in_bytes),
            xla_peak=int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
        )


def compiled_memory(jitted, *args) -> CompiledMemory | None:
    """XLA's memory analysis of ``jitted`` for ``args`` (None where the backend has none).

    After ``jitted(*args)`` has run once this reuses its executable: no retrace, no compile.
    """
    return CompiledMemory.of(jitted.lower(*args).compile())


@dataclasses.dataclass
class StepCounter:
    """Counts traces of the train step (each trace is one compilation)."""

    traces: int = 0


def schedule(cfg: Config) -> optax.Schedule:
    o = cfg.optim
    decay = o.decay_steps or max(cfg.train.steps - o.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=o.warmup_steps + decay,
        end_value=o.lr * o.min_lr_ratio,
    )


def _decay_mask(params):
    """Weight decay on matrices only (not norm scales); a scanned group's leading layer axis
    does not count."""

    def is_matrix(path, p):
        stacked = any(getattr(k, "key", None) in GROUPS for k in path)
        return p.ndim - stacked >= 2

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optim
    parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
    parts.append(
        optax.adamw(schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=_decay_mask)
    )
    return optax.chain(*parts)


def boxed_params(cfg: Config, platform: Platform | None = None):
    """The parameters' shapes, dtypes and logical axis names (``nn.LogicallyPartitioned``
    leaves), without computing them (nothing runs eagerly: ``moe_train.planner.compile`` traces on
    simulated devices, where eager work cannot run). ``platform``: the target (None: here)."""

    def init():
        tokens = jnp.zeros((1, cfg.train.seq_len), jnp.int32)
        return Transformer(model_settings(cfg, platform)).init(jax.random.key(0), tokens)["params"]

    return jax.eval_shape(init)


def state_shardings(
    cfg: Config, mesh: Mesh, abstract: TrainState, platform: Platform | None = None
) -> TrainState:
    """Parameters and their Adam moments FSDP/EP-sharded by the logical rules; rest replicated."""
    boxed = boxed_params(cfg, platform)
    shd = sharding.Sharding.of(mesh, cfg)
    param_sh, rep = shd.params(boxed), shd.replicated
    tx = optimizer(cfg)  # its state's structure, from an abstract init (its counters are arrays)
    opt_sh = optax.tree_map_params(
        lambda params: jax.eval_shape(tx.init, params),
        lambda _, sh: sh,
        abstract.opt_state,
        param_sh,
        transform_non_params=lambda _: rep,
    )
    return TrainState(
        step=rep,  # pyright: ignore[reportArgumentType]  (a TrainState of shardings)
        params=param_sh,
        opt_state=opt_sh,
        moe_state=jax.tree.map(lambda _: rep, abstract.moe_state),
        fp8_state=jax.tree.map(lambda _: rep, abstract.fp8_state),
    )


def _state_maker(cfg: Config, platform: Platform | None = None):
    """``make(key) -> TrainState``: the initial state (parameters from ``key``) of the model
    built for ``platform`` (None: this process's)."""
    model, tx = Transformer(model_settings(cfg, platform)), optimizer(cfg)

    def make(key):
        variables = model.init(key, jnp.zeros((1, cfg.train.seq_len), jnp.int32))
        unknown = set(variables) - {"params", "moe_state", FP8_COLLECTION}
        if unknown:  # e.g. a Transformer Engine release that keeps state elsewhere
            raise RuntimeError(
                f"the model created variable collections the train state does not carry: {sorted(unknown)}"
            )
        params = nn.unbox(variables["params"])
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            moe_state=variables.get("moe_state", {}),
            fp8_state=nn.unbox(variables.get(FP8_COLLECTION, {})),
        )

    return make


def _init_key(cfg: Config):
    # The "rbg" generator compiles the initialisers ~3x faster than threefry on XLA:CPU.
    return jax.random.key(cfg.train.seed, impl="rbg")


def init_state(cfg: Config, mesh: Mesh) -> TrainState:
    """Initialise parameters directly into their shardings on ``mesh``."""
    make, key = _state_maker(cfg), _init_key(cfg)
    abstract = jax.eval_shape(make, key)
    return jax.jit(make, out_shardings=state_shardings(cfg, mesh, abstract))(key)


def abstract_state(cfg: Config, mesh: Mesh, platform: Platform | None = None) -> TrainState:
    """The state ``init_state`` makes, as ``jax.ShapeDtypeStruct`` leaves with their shardings
    on ``mesh``; nothing is computed (the deviceless compile's train-state argument, traced
    for its target ``platform``; None: this process's)."""
    abstract = jax.eval_shape(_state_maker(cfg, platform), jax.eval_shape(lambda: _init_key(cfg)))
    shardings = state_shardings(cfg, mesh, abstract, platform)
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract, shardings
    )


def _loss_fn(
    params, fp8_state, moe_state, batch_BS, model: Transformer, cfg: Config, devices: int = 1, mtp_weight=0.0
) -> tuple[jax.Array, dict[str, Any]]:
    """Total loss and its parts; the cross-entropy is chunked (``moe_train.model.loss``): the
    [B, S, V] logits never exist whole; each chunk holds ``train.loss_chunk`` tokens of each
    of the ``devices`` the batch is split over. With MTP (``moe_train.model.mtp``) the total adds
    ``mtp_weight`` times the mean of the depths' cross-entropies (``mtp``); ``ce`` stays the
    next-token cross-entropy. ``batch_BS``: either batch form of ``moe_train.data.packing`` (with
    segment ids no attention, position or label crosses a document)."""
    variables = {"params": params, "moe_state": moe_state}
    if fp8_state:
        variables[FP8_COLLECTION] = fp8_state
    depth = cfg.model.mtp_depth
    tokens_BS1, segments_BS1 = packing.parts(batch_BS)
    mtp_ids, mtp_labels = mtp.shifted(tokens_BS1, depth, segments_BS1) if depth else (None, None)
    segment_ids_BS = None if segments_BS1 is None else segments_BS1[:, :-1]
    head, stats = model.apply(
        variables, tokens_BS1[:, :-1], logits=False, mtp_ids_LBS=mtp_ids, segment_ids_BS=segment_ids_BS
    )
    ce, mtp_ce = _cross_entropies(
        head, packing.next_token_labels(tokens_BS1, segments_BS1), mtp_labels, cfg, devices
    )
    e = cfg.moe
    aux, seq_aux, z = moe_stats.losses(stats)  # pyright: ignore[reportArgumentType]  (apply returns __call__'s)
    total = (
        ce + e.aux_loss_coef * aux + e.seq_aux_loss_coef * seq_aux + e.z_loss_coef * z + mtp_weight * mtp_ce
    )
    return total, dict(ce=ce, mtp=mtp_ce, aux=aux, seq_aux=seq_aux, z=z, stats=stats)


def _cross_entropies(head, labels_BS, mtp_labels_LBS, cfg: Config, devices: int):
    """(next-token cross-entropy, mean of the MTP depths' cross-entropies; 0 without MTP),
    each the mean over its valid labels, from one ``loss.device_token_losses`` call over the
    main head's and every depth's tokens side by side ([B, L S], L = 1 + depths: each device
    keeps its rows), so the loop over the shared head and its [H, V] gradient run once per
    step, not L times, and the head's gradient is reduced over the devices once."""
    xs, labels = [head.x_BSH], [labels_BS]
    if mtp_labels_LBS is not None:
        xs += list(head.mtp_LBSH)
        labels += list(mtp_labels_LBS)
    B, S, H = head.x_BSH.shape
    L, V = len(xs), head.head_HV.shape[1]
    labels_BLS = jnp.stack(labels, axis=1)
    chunk = loss.sharded_chunk(B * L * S, V, devices, cfg.train.loss_chunk) // devices
    nll_T = loss.device_token_losses(
        jnp.stack(xs, axis=1).reshape(B * L * S, H),
        head.head_HV,
        labels_BLS.reshape(-1),
        sharding.TOKEN_AXES,
        chunk=chunk,
        logit_scale=head.scale,
    )
    w_BLS = ((labels_BLS >= 0) & (labels_BLS < V)).astype(jnp.float32)
    ce_L = jnp.sum(w_BLS * nll_T.reshape(B, L, S), axis=(0, 2)) / jnp.maximum(
        jnp.sum(w_BLS, axis=(0, 2)), 1.0
    )
    return ce_L[0], (jnp.mean(ce_L[1:]) if L > 1 else jnp.float32(0.0))


def update_bias(moe_state, tokens_per_expert_LE, rate: float):
    """Aux-loss-free balancing, outside the optimizer: bias += rate * sign(mean_load - load),
    row l of the loads for the l-th MoE layer in depth order (the scanned layout's layer axis,
    then the MTP modules' blocks)."""
    if rate == 0.0 or not moe_state:
        return moe_state
    load_LE = tokens_per_expert_LE.astype(jnp.float32)
    step_LE = rate * jnp.sign(load_LE.mean(axis=-1, keepdims=True) - load_LE)
    out, row = {}, 0
    for name in sorted(moe_state, key=_depth_order):
        in_mtp = name.startswith("mtp_")  # an MTP module's block: {"block": {"moe": ...}}
        bias = (moe_state[name]["block"] if in_mtp else moe_state[name])["moe"]["expert_bias"]
        rows = bias.shape[0] if name == "moe_layers" else 1  # the scanned group: [L, E]
        step = step_LE[row : row + rows] if name == "moe_layers" else step_LE[row]
        new = {"moe": {"expert_bias": bias + step}}
        out[name] = {"block": new} if in_mtp else new
        row += rows
    return out


def _depth_order(name: str) -> tuple[int, int]:
    """Sort key of a moe_state entry: main layers (scanned group or layer_{i}), then MTP."""
    if name.startswith("mtp_"):
        return 1, int(name[4:])
    match = LAYER_NAME.fullmatch(name)
    return 0, int(match[1]) if match else 0


def accumulate(
    loss_grads,
    params,
    fp8_state,
    moe_state,
    batch_BS,
    n: int,
    mesh: Mesh,
    step_gather: StepGather | None = None,
):
    """``loss_grads`` over the batch as ``n`` micro-batches run in turn (gradient
    accumulation): ((mean total loss, aux), (mean gradients, fp8 state)). Only one
    micro-batch's activations are live at a time. The fp8 scaling state passes from each
    micro-batch to the next (each quantizes with the amax history so far); the expert bias
    stays fixed within the step. With load-balance losses each micro-batch balances its own
    tokens, so n > 1 is not bitwise the same step as n = 1. ``step_gather``
    (``parallel.weight_gather=step``): the micro-batches run on one gathered copy of the
    weights (``moe_train.train.gather``)."""
    master = params
    if step_gather is not None:
        params, of_copy, gather = step_gather.gather(master), loss_grads, step_gather

        def on_copy(p, fp8, moe, mb_BS):
            out, (grads, fp8) = of_copy(p, fp8, moe, mb_BS)
            return out, (gather.reduced(grads, master), fp8)

        loss_grads = on_copy

    if n == 1:
        return loss_grads(params, fp8_state, moe_state, batch_BS)

    def body(carry, mb_BS):
        grads_sum, fp8 = carry
        (total, aux), (grads, fp8) = loss_grads(params, fp8, moe_state, mb_BS)
        return (jax.tree.map(jnp.add, grads_sum, grads), fp8), (total, aux)

    zeros = jax.tree.map(jnp.zeros_like, master)
    (grads, fp8), (total_n, aux_n) = jax.lax.scan(
        body, (zeros, fp8_state), sharding.micro_batches(batch_BS, n, mesh)
    )
    aux = {k: v.mean(0) for k, v in aux_n.items() if k != "stats"}
    aux["stats"] = None if aux_n["stats"] is None else moe_stats.combine(aux_n["stats"])
    return (total_n.mean(), aux), (jax.tree.map(lambda g: g / n, grads), fp8)


def all_finite(tree) -> jax.Array:
    """Whether every floating-point value in ``tree`` is finite (a bool scalar)."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def guard_nonfinite(old: TrainState, new: TrainState, total, grad_norm, skip: bool):
    """(state, nonfinite): a step whose loss or gradient norm is NaN/inf leaves the state as
    it was (``skip``: only the step counter advances, so the next step takes the next
    batch). The check is on two scalars known before the update, so the select fuses into
    the update: no second copy of the state. (The Adam moments need no check of their own:
    a squared gradient that overflows makes the gradient norm inf too.)"""
    bad = ~(jnp.isfinite(total) & jnp.isfinite(grad_norm))
    keep = old.replace(step=old.step + 1) if skip else old
    return jax.tree.map(lambda k, n: jnp.where(bad, k, n), keep, new), bad


def make_train_step(
    cfg: Config,
    mesh: Mesh,
    counter: StepCounter,
    state_sharding: TrainState,
    ep_plan: EPPlan | None = None,
    platform: Platform | None = None,
):
    """The jitted step ``(state, batch) -> (state, metrics)`` with the state donated; where
    ``ep_plan`` can overflow (a capacity bucket), ``(state, batch, hold) -> (state, metrics)``.

    When an expert-parallel exchange overflows its buffers (``metrics["overflow"]``), the
    returned state is the input state unchanged: the caller reruns the step with a larger
    capacity bucket, so no update ever sees a dropped token. ``hold`` (a replicated bool
    scalar on the device, e.g. the previous step's ``metrics["overflow"]``) does the same: a
    held step returns its input state unchanged, so a caller can dispatch the next step
    before it has read whether this one overflowed. A non-finite loss or gradient
    (``metrics["nonfinite"]``) never reaches the state either (``guard_nonfinite``).
    The step enters its own sharding context (``sharding.Sharding.wrap``): the mesh and the
    logical rules chosen for ``cfg`` on it. ``platform``: the target its kernels are chosen
    for (None: this process's; ``moe_train.planner.compile`` passes the target GPU's).
    """
    model, tx = Transformer(model_settings(cfg, platform), ep_plan), optimizer(cfg)
    lr_at = schedule(cfg)

    def step(state: TrainState, batch_BS, hold=None):
        counter.traces += 1
        w = mtp.mtp_weight(cfg.model, state.step)

        def loss_grads(params, fp8_state, moe_state, batch_BS):
            grad_fn = jax.value_and_grad(_loss_fn, argnums=(0, 1), has_aux=True)
            return grad_fn(params, fp8_state, moe_state, batch_BS, model, cfg, mesh.size, w)

        (total, aux), (grads, fp8_state) = accumulate(
            loss_grads,
            state.params,
            state.fp8_state,
            state.moe_state,
            batch_BS,
            cfg.train.micro_batches,
            mesh,
            step_gather,
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        moe = moe_stats.metrics(aux["stats"], cfg.moe.num_experts)
        moe_state = update_bias(state.moe_state, moe["tokens_per_expert"], cfg.moe.bias_update_rate)
        metrics = dict(
            loss=aux["ce"],
            mtp_loss=aux["mtp"],
            total_loss=total,
            aux_loss=aux["aux"],
            seq_aux_loss=aux["seq_aux"],
            z_loss=aux["z"],
            grad_norm=optax.tree.norm(grads),
            lr=lr_at(state.step),
            **moe,
        )
        new = TrainState(
            step=state.step + 1, params=params, opt_state=opt_state, moe_state=moe_state, fp8_state=fp8_state
        )
        new, metrics["nonfinite"] = guard_nonfinite(
            state, new, total, metrics["grad_norm"], skip=cfg.train.on_nonfinite == "skip"
        )
        # The previous update's result, read where the forward pass reads it anyway (a check
        # of the new parameters here would keep XLA from updating them in place: +4%).
        metrics["params_finite"] = all_finite(state.params)
        if can_overflow:
            assert hold is not None, "a step that can overflow takes hold"
            keep = metrics["overflow"] | hold
            new = jax.tree.map(lambda old, upd: jnp.where(keep, old, upd), state, new)
        return new, metrics

    can_overflow = ep_plan is not None and ep_plan.capacity_factor is not None
    step_gather = (
        StepGather.of(boxed_params(cfg, platform), state_sharding.params, compute_dtype(cfg.precision))
        if cfg.parallel.weight_gather == "step"
        else None
    )
    options = {
        **(remat.compiler_options(cfg.train.remat, mesh.devices.flat[0].platform) or {}),
        **(sharding.all_reduce_options(mesh) if cfg.parallel.split_all_reduce else {}),
    }
    shd = sharding.Sharding.of(mesh, cfg)
    return shd.wrap(
        jax.jit(
            step,
            donate_argnums=0,
            in_shardings=(state_sharding, shd.batch) + ((shd.replicated,) if can_overflow else ()),
            out_shardings=(state_sharding, shd.replicated),
            compiler_options=options or None,
        )
    )
