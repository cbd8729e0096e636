"""Activation checkpointing (rematerialisation) of the transformer blocks: ``train.remat``.

Each policy decides which of a block's intermediate values the forward pass keeps for the
backward pass; the rest are recomputed there from what was kept. Losses and gradients do
not change (tests/test_remat.py); memory and compute do.

``none``
    No checkpointing: every residual is kept (least compute, most memory).
``full``
    Each block keeps only its input (``nn.remat``, nothing saveable). The backward pass
    recomputes the whole block: norms, projections, attention scores, FSDP all-gathers of
    the weights and, under expert parallelism, the dispatch all-to-alls and grouped GEMMs.
``matmuls``
    Each block keeps the outputs of matmuls without batch dimensions
    (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``): the q/k/v/o projections,
    the router logits and the dense and shared-expert SwiGLU matmuls. Recomputed: norms,
    RoPE, elementwise ops, the attention score matmuls (batched: saving them would keep the
    [B, N, S, S] scores), the tiled backend's batched expert GEMMs and any grouped GEMM that is
    not a plain ``dot_general`` (``ragged_dot``, the Mosaic-GPU and Transformer Engine kernels).
``moe``
    Keeps everything of the MoE sub-layer (router, permuted rows, exchange buffers, expert
    GEMM activations: the backward never repeats an all-to-all or a grouped GEMM) and
    recomputes the attention sub-layer (``attn_norm`` + ``attn``) from the block input.
    Why not ``checkpoint_name`` on the MoE output with ``save_only_these_names`` around the
    whole block: the MoE output only feeds the residual add, whose backward needs no values,
    so it is never a residual and that policy compiles to exactly ``full``. The values worth
    keeping are inside the MoE kernels; remat scoped to the attention sub-layer keeps all of
    them without naming each one.

Under ``model.scan_layers`` (the default) the policy applies to the scanned body: the
backward pass is a second loop over the layers, which recomputes each block inside its own
iteration. Measured on XLA:CPU (tiny preset, 3 layers, 16 x 128 tokens, compiled temp, MiB):

    layout, devices          none   full   matmuls   moe
    scan, 1 device           86.6   33.4      39.7  53.9
    loop, 1 device           84.0   53.5      54.7  48.1
    scan, EP 8 on 8 devices  23.6    9.9      10.5  19.5
    loop, EP 8 on 8 devices  21.5   29.5      29.6  18.8

With the Python loop XLA:CPU's scheduler hoists recomputation (with EP 8 the recomputed
exchange too) into the forward pass and keeps both copies alive; a scanned body gives it
nothing to hoist. ``moe`` compiles to more under scan on one device (53.9 vs 48.1; not
analysed further). Check ``compiled_peak_bytes`` in a run's metrics for the real device.

Parameter paths are the same under every policy (``nn.remat`` keeps module names), so a
checkpoint written under one policy resumes under another.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax

from moe_train.config import REMAT_POLICIES

POLICIES = REMAT_POLICIES


def _check(name: str) -> None:
    if name not in POLICIES:
        raise ValueError(f"unknown remat policy {name!r}; choose one of {', '.join(POLICIES)}")


def block_policy(name: str) -> Callable | None:
    """The ``jax.checkpoint`` policy for a whole block (None: nothing saveable)."""
    _check(name)
    if name == "matmuls":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return None


def wrap_block(block_cls: type[nn.Module], name: str, prevent_cse: bool = True) -> type[nn.Module]:
    """``block_cls`` under whole-block checkpointing for ``full`` and ``matmuls``; as is else.
    ``prevent_cse=False`` inside a scanned body (the loop already keeps the recomputation in
    the backward pass; JAX's advice for ``checkpoint`` under ``scan``)."""
    _check(name)
    if name not in ("full", "matmuls"):
        return block_cls
    return nn.remat(block_cls, policy=block_policy(name), prevent_cse=prevent_cse)


def wrap_attention(fn: Callable, name: str, prevent_cse: bool = True) -> Callable:
    """The attention sub-layer ``fn(block, x) -> y``, rematerialised under ``moe``."""
    _check(name)
    if name != "moe":
        return fn
    return nn.remat(fn, prevent_cse=prevent_cse)


# XLA:CPU expands (removes) optimization barriers before common-subexpression elimination,
# which merges the recomputation back into the forward pass and undoes every policy above
# (measured: an 8-layer MLP under jax.checkpoint compiled to 88 MiB of temp vs 74 MiB
# without; with the pass disabled, 18 MiB). XLA:GPU keeps the barriers through scheduling.
CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def compiler_options(name: str, platform: str) -> dict[str, str] | None:
    """XLA options that make ``name`` take effect on ``platform`` (None: the defaults)."""
    _check(name)
    if name == "none" or platform != "cpu":
        return None
    return dict(CPU_COMPILER_OPTIONS)
