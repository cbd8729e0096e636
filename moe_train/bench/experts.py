"""The expert computation of one MoE layer, per backend and baseline, for the GEMM benchmarks.

Shape letters (``moe_train.base.notation``): T tokens, K top-k, M = T*K assignments, H hidden,
F expert ffn, E experts, R dispatched rows, C rows per expert (capacity slots; T for dense-all).

Every candidate computes the experts' SwiGLU, y = (silu(x @ wi_0) * (x @ wi_1)) @ wo, on its
own layout of the same routed rows (the layout is built once, outside the timing):

- ``tiled``, ``ragged_dot``, ``mgpu``, ``te``: ``gemm.grouped_swiglu`` on the dispatched rows
  (tile-padded for tiled, sorted for the others). Useful work: M rows.
- ``capacity``: the token-dropping GShard baseline's expert step, a batched [E, C, H] SwiGLU
  with C = ceil(capacity_factor * M / E); assignments beyond C are dropped.
- ``dense-all``: every expert on every token, [E, T, H] (E/K times the useful work).
- ``dense``: one dense SwiGLU on M rows with one expert's weights: the physical limit, the
  same useful FLOPs as the routed layer in a single GEMM chain.

``build(case, backend)`` returns the layout; ``function(backend, mode)`` the jittable
function ``(x, w0, w1, wo, aux, dy)``: forward returns y, ``fwd+bwd`` returns the gradients
with respect to x and the three weights of ``<y, dy>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_train.moe.capacity import expert_capacity
from moe_train.moe.gemm import BackendUnavailable, grouped_swiglu, resolve_backend
from moe_train.moe.permute import make_dispatch, permute
from moe_train.moe.reference import swiglu_mlp
from moe_train.moe.tiled import default_tile_rows, executed_rows

GROUPED = ("tiled", "ragged_dot", "mgpu", "te")
BASELINES = ("capacity", "dense-all", "dense")
MODES = ("fwd", "fwd+bwd")
F32 = jnp.float32


def unavailable(backend: str, dtype, hidden: int, ffn: int) -> str | None:
    """Why grouped-GEMM ``backend`` cannot run these operands here (None: it can)."""
    try:
        resolve_backend(backend, jnp.dtype(dtype), hidden=hidden, ffn=ffn)
    except BackendUnavailable as err:
        text = str(err)
        return "unavailable: " + text.split("is unavailable: ", 1)[-1].split(". Available here")[0]
    return None


@dataclasses.dataclass(frozen=True)
class Case:
    """One routing of T tokens to E experts (top-k), at hidden H and expert ffn F."""

    experts_TK: np.ndarray
    num_experts: int
    hidden: int
    ffn: int
    dtype: Any = jnp.float32
    capacity_factor: float = 1.25

    @property
    def tokens(self) -> int:
        return self.experts_TK.shape[0]

    @property
    def assignments(self) -> int:
        return self.experts_TK.size

    def loads(self) -> np.ndarray:
        return np.bincount(self.experts_TK.ravel(), minlength=self.num_experts)

    def useful_flops(self, mode: str) -> float:
        """6*M*H*F per forward (three matmuls); forward+backward is three times that."""
        return 6.0 * self.assignments * self.hidden * self.ffn * (3 if mode == "fwd+bwd" else 1)


@dataclasses.dataclass
class Layout:
    """A candidate's operands for one case, and what it executes."""

    x: jax.Array
    aux: Any  # the Dispatch plan for grouped backends, else None
    executed_rows: int  # rows the candidate multiplies (padding and dropped-slot rows included)
    drop_rate: float = 0.0
    tile_rows: int | None = None


def _capacity_rows(case: Case, x_TH: np.ndarray) -> tuple[np.ndarray, float, int]:
    """[E, C, H] buffer of the kept assignments (slot-major priority, as capacity_moe), the
    drop rate and C."""
    E, (T, K) = case.num_experts, case.experts_TK.shape
    C = expert_capacity(T, K, E, case.capacity_factor)
    experts_M = case.experts_TK.T.reshape(-1)  # n = k*T + t: first choices first
    order = np.argsort(experts_M, kind="stable")
    counts = np.bincount(experts_M, minlength=E)
    position = np.empty_like(order)
    position[order] = np.arange(T * K) - (np.cumsum(counts) - counts)[experts_M[order]]
    kept = position < C
    buf = np.zeros((E, C, x_TH.shape[1]), x_TH.dtype)
    buf[experts_M[kept], position[kept]] = x_TH[np.arange(T * K)[kept] % T]
    return buf, float(1.0 - kept.mean()), C


def build(case: Case, backend: str, seed: int = 0) -> Layout:
    """The candidate's layout of the case's routed token rows (host-side, not timed)."""
    rng = np.random.default_rng(seed)
    T, H, E, M = case.tokens, case.hidden, case.num_experts, case.assignments
    x_TH = rng.standard_normal((T, H), dtype=np.float32)
    put = lambda a: jnp.asarray(a).astype(case.dtype)
    if backend in GROUPED:
        m = default_tile_rows(M, E) if backend == "tiled" else None
        plan = jax.jit(make_dispatch, static_argnums=(1, 2))(jnp.asarray(case.experts_TK), E, m)
        x_R = jax.jit(permute)(put(x_TH), plan)
        rows = int(executed_rows(case.loads(), m)) if m else M
        return Layout(x_R, plan, rows, tile_rows=m)
    if backend == "capacity":
        buf, drop, C = _capacity_rows(case, x_TH)
        return Layout(put(buf), None, E * C, drop_rate=drop)
    if backend == "dense-all":
        return Layout(put(x_TH), None, E * T)
    if backend == "dense":
        return Layout(put(rng.standard_normal((M, H), dtype=np.float32)), None, M)
    raise ValueError(f"unknown candidate {backend!r}")


def _swiglu_batched(x_ECH, w0, w1, wo):
    """SwiGLU of every expert on its own [C, H] rows (capacity and dense-all)."""
    dtype = x_ECH.dtype
    a0 = jnp.einsum("emh,ehf->emf", x_ECH, w0.astype(dtype), preferred_element_type=F32)
    a1 = jnp.einsum("emh,ehf->emf", x_ECH, w1.astype(dtype), preferred_element_type=F32)
    h = (jax.nn.silu(a0) * a1).astype(dtype)
    return jnp.einsum("emf,efh->emh", h, wo.astype(dtype), preferred_element_type=F32).astype(dtype)


def expert_output(backend: str) -> Callable:
    """(x, w0, w1, wo, aux) -> y for a candidate (weights [E, ...], dense uses expert 0)."""
    if backend in GROUPED:
        return lambda x, w0, w1, wo, plan: grouped_swiglu(x, plan, w0, w1, wo, backend)
    if backend == "capacity":
        return lambda x, w0, w1, wo, aux: _swiglu_batched(x, w0, w1, wo)
    if backend == "dense-all":
        return lambda x, w0, w1, wo, aux: _swiglu_batched(
            jnp.broadcast_to(x, (w0.shape[0], *x.shape)), w0, w1, wo
        )
    if backend == "dense":
        return lambda x, w0, w1, wo, aux: swiglu_mlp(x, w0[0], w1[0], wo[0]).astype(x.dtype)
    raise ValueError(f"unknown candidate {backend!r}")


def function(backend: str, mode: str) -> Callable:
    """Jitted ``(x, w0, w1, wo, aux, dy)``: y (fwd) or the gradients of <y, dy> (fwd+bwd)."""
    out = expert_output(backend)
    if mode == "fwd":
        return jax.jit(lambda x, w0, w1, wo, aux, dy: out(x, w0, w1, wo, aux))

    def inner(x, w0, w1, wo, aux, dy):
        return jnp.vdot(out(x, w0, w1, wo, aux).astype(F32), dy)

    return jax.jit(jax.grad(inner, argnums=(0, 1, 2, 3)))


def cotangent(backend: str, layout: Layout, num_experts: int, seed: int = 1) -> jax.Array:
    """A fixed random dy shaped like the candidate's output (fp32)."""
    shape = layout.x.shape
    if backend == "dense-all":
        shape = (num_experts, *shape)
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def weights(case: Case, seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Random expert weights w0, w1 [E, H, F], wo [E, F, H] in the case's dtype, drawn on
    the device (DeepSeek-sized expert sets do not fit a host-side fp32 draw quickly)."""
    E, H, F = case.num_experts, case.hidden, case.ffn
    k0, k1, k2 = jax.random.split(jax.random.key(seed), 3)
    dt = jnp.dtype(case.dtype)
    draw = lambda k, s, fan: jax.random.normal(k, s, dt) * jnp.asarray(fan**-0.5, dt)
    return draw(k0, (E, H, F), H), draw(k1, (E, H, F), H), draw(k2, (E, F, H), F)
