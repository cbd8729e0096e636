"""Held-out loss of a live train state or of saved weights: forward passes only, nothing changes.

``evaluate`` scores a state (the loop's ``train.eval_every``; ``InRun`` holds the fixed
batches); ``evaluate_weights`` scores saved weights the same way (``python -m
moe_train.eval``, in ``__main__``: a run, one step or a converted checkpoint).

    result = evaluate(cfg, mesh, params, moe_state, batches)
    result["eval_loss"], result["eval_ppl"], result["eval_tokens"]

``eval_loss`` is the next-token cross-entropy (nats) over every scored token of ``batches``:
the sum of the per-token losses over their count (token-weighted across batches, not a mean
of batch means). Unscored are padding (``packing.PAD``) and, with packed documents, each
document's first token (the label ``moe_train.data.packing.next_token_labels`` gives -1), exactly
as the training ``loss`` metric counts. MTP, load-balance and z losses are not part of it.
``eval_ppl`` = exp(eval_loss); ``eval_tokens`` the scored tokens.

No optimizer, no gradient, no update of the expert bias or the fp8 scaling state: the model
is applied to the given variables (the router reads the current bias, as in training) and
the MoE stats are dropped. With expert parallelism the exchange runs on the worst-case plan
(``moe_train.parallel.sharding.ep_plans``' last), whose buffers never overflow, so no step is rerun.
The forward is compiled once per (config, mesh) and reused.

``batches``: global batches in either form of ``moe_train.data.packing``, as host numpy arrays
(each process places its own rows, like the training batches; the rows must divide over the
mesh's devices) or as global ``jax.Array`` already on the mesh
(``moe_train.data.heldout.eval_batches`` builds the fixed held-out ones).

May import: ``moe_train.base`` (exit codes), the config, the model, the data,
``moe_train.parallel`` (the mesh, the EP plans and micro-batches the train step uses too) and
``moe_train.convert`` (weights and their CLI). Never the training loop (it imports this
package to evaluate in a run), the benchmarks, the launcher or the planners.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from moe_train import config
from moe_train.base.waiting import Waiting
from moe_train.config import Config, ConfigError
from moe_train.data import packing
from moe_train.data.heldout import eval_batches
from moe_train.model import loss
from moe_train.model.precision import FP8_COLLECTION
from moe_train.model.settings import model_settings
from moe_train.model.transformer import Transformer
from moe_train.parallel import sharding, together


def batch_loss(params, fp8_state, moe_state, batch, model: Transformer, cfg: Config, devices: int = 1):
    """(sum of the scored tokens' cross-entropies, their count) of one batch, fp32."""
    variables = {"params": params, "moe_state": moe_state}
    if fp8_state:
        variables[FP8_COLLECTION] = fp8_state
    tokens_BS1, segments_BS1 = packing.parts(batch)
    segment_ids_BS = None if segments_BS1 is None else segments_BS1[:, :-1]
    head, _ = model.apply(
        variables, packing.model_inputs(tokens_BS1), logits=False, segment_ids_BS=segment_ids_BS
    )
    labels_BS = packing.next_token_labels(tokens_BS1, segments_BS1)
    B, S, H = head.x_BSH.shape
    V = cfg.model.vocab_size
    chunk = loss.sharded_chunk(B * S, V, devices, cfg.train.loss_chunk)
    ce, _ = loss.lm_loss(
        head.x_BSH.reshape(B * S, H), head.head_HV, labels_BS.reshape(-1), chunk=chunk, logit_scale=head.scale
    )
    count = jnp.sum((labels_BS >= 0) & (labels_BS < V)).astype(jnp.float32)
    return ce * count, count


@functools.lru_cache(maxsize=8)
def compiled(cfg: Config, mesh: Mesh):
    """The jitted ``(params, fp8_state, moe_state, batch) -> (loss sum, count)`` on ``mesh``.
    A batch runs as ``train.micro_batches`` micro-batches in turn, as the train step runs
    it, so an evaluation never holds more activations than a training micro-batch."""
    model = Transformer(model_settings(cfg), sharding.ep_plans(cfg, mesh)[-1])
    shd = sharding.Sharding.of(mesh, cfg)
    n = cfg.train.micro_batches

    def fn(params, fp8_state, moe_state, batch):
        if n == 1:
            return batch_loss(params, fp8_state, moe_state, batch, model, cfg, mesh.size)

        def body(carry, mb):
            part = batch_loss(params, fp8_state, moe_state, mb, model, cfg, mesh.size)
            return (carry[0] + part[0], carry[1] + part[1]), None

        zero = (jnp.float32(0.0), jnp.float32(0.0))
        return jax.lax.scan(body, zero, sharding.micro_batches(batch, n, mesh))[0]

    return shd.wrap(jax.jit(fn, out_shardings=(shd.replicated, shd.replicated)))


def place(batch: Any, mesh: Mesh) -> Any:
    """A global host batch as global arrays, batch-sharded; this process supplies its rows."""
    if all(isinstance(a, jax.Array) for a in jax.tree.leaves(batch)):
        return batch
    rows = jax.tree.leaves(batch)[0].shape[0]
    count, index = jax.process_count(), jax.process_index()
    per = rows // count
    local = packing.rows(batch, index * per, (index + 1) * per)
    batch_sh = sharding.batch_sharding(mesh)
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(batch_sh, np.ascontiguousarray(a)), local
    )


def evaluate(cfg: Config, mesh: Mesh, params, moe_state, batches, fp8_state=None) -> dict:
    """{"eval_loss", "eval_ppl", "eval_tokens"} of the model over ``batches`` (see above)."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    fn = compiled(cfg, mesh)
    fp8_state = fp8_state or {}
    placed = [place(b, mesh) for b in batches]
    together.compiled_together(fn, (params, fp8_state, moe_state, placed[0]), "evaluation", cfg.parallel)
    parts = [fn(params, fp8_state, moe_state, b) for b in placed]
    sums, counts = zip(*jax.device_get(parts))  # dispatched first, read once
    total, count = float(np.sum(np.asarray(sums, np.float64))), float(np.sum(counts))
    value = total / count if count else math.nan
    with np.errstate(over="ignore"):  # a diverged model's perplexity is inf, not an error
        ppl = float(np.exp(value))
    return {"eval_loss": value, "eval_ppl": ppl, "eval_tokens": int(count)}


class InRun:
    """The training loop's evaluations (``train.eval_every``): the fixed held-out batches of
    ``moe_train.data.heldout``, every ``eval_every`` steps and at the last step."""

    def __init__(self, cfg: Config):
        self.every, self.last = cfg.train.eval_every, cfg.train.steps
        self.batches, self.description = eval_batches(cfg)  # a DataError: before any write

    @classmethod
    def of(cls, cfg: Config) -> InRun | None:
        """The run's evaluations, None with ``train.eval_every=0``."""
        return cls(cfg) if cfg.train.eval_every else None

    def due(self, n: int) -> bool:
        """Whether step ``n`` is evaluated."""
        return n == self.last or n % self.every == 0

    def line(self) -> str:
        return (
            f"evaluating every {self.every} steps and at step {self.last} on "
            f"{self.description}, {len(self.batches)} batch(es)"
        )

    def __call__(self, cfg: Config, mesh: Mesh, state) -> dict:
        """``evaluate`` of a train state, with the seconds it took (``eval_s``)."""
        t0 = time.perf_counter()
        out = evaluate(cfg, mesh, state.params, state.moe_state, self.batches, fp8_state=state.fp8_state)
        return {**out, "eval_s": time.perf_counter() - t0}


def eval_config(saved: Config, data_dir: str, *, devices: int, batch_size: int, tokens: int) -> Config:
    """The weights' config set up to evaluate on ``data_dir``'s val split on ``devices``."""
    t, d, p = saved.train, saved.data, saved.parallel
    rows = batch_size or devices * max(1, 8 // devices)
    compute = "bf16" if saved.precision.compute == "fp8" else saved.precision.compute
    cfg = dataclasses.replace(
        saved,
        data=dataclasses.replace(d, source="prepared", path=data_dir),
        train=dataclasses.replace(
            t,
            batch_size=rows,
            micro_batches=1,
            micro_batch_size=0,
            eval_tokens=tokens or t.eval_tokens,
            init_from="",
        ),
        parallel=dataclasses.replace(p, devices=devices, ep=1, dp=0, cluster=""),
        precision=dataclasses.replace(saved.precision, compute=compute),
    )
    config.validate(cfg)
    if rows % devices:
        raise ConfigError(f"--batch-size {rows} must be a multiple of the {devices} devices")
    return cfg


def evaluate_weights(
    path: str,
    data_dir: str,
    *,
    devices: int = 0,
    batch_size: int = 0,
    tokens: int = 0,
    trust_unverified: bool = False,
    log: Callable[[str], None] = lambda line: None,
) -> dict:
    """{"eval_loss", "eval_ppl", "eval_tokens", "data"} of the weights at ``path`` (a step
    without a manifest is refused unless ``trust_unverified``). ``log`` gets a line as each
    phase starts (restoring the weights, compiling and scoring) and with its time."""
    from moe_train.convert import weights  # orbax: only to read a checkpoint's weights
    from moe_train.convert.score import pick_devices  # with the weights above

    source = weights.locate(path)
    devs = pick_devices(devices)
    cfg = eval_config(
        weights.config_of(source), data_dir, devices=len(devs), batch_size=batch_size, tokens=tokens
    )
    batches, description = eval_batches(cfg)  # a DataError (ConfigError) before any restore
    log(f"evaluating {source.path} on {description}: {len(batches)} batch(es), {len(devs)} device(s)")
    mesh = sharding.make_mesh(devs)
    # a line as each phase starts, "still ...: N s" every 10 s while it runs, its time when done
    with Waiting(log, f"restoring and verifying the weights of {source.path}", after_s=0):
        params, moe_state = weights.restore(source, cfg, mesh, trust_unverified)
    with Waiting(log, "compiling the forward pass (once) and scoring", after_s=0):
        out = evaluate(cfg, mesh, params, moe_state, batches)
    return {**out, "data": description}
