"""Numerical checks of one kernel against an obviously-correct fp32 reference on this device.

Shape letters (``moe_train.base.notation``): T tokens, H hidden, F expert ffn, E experts, K
top-k, R dispatched rows; attention: B batch, S sequence, N query heads, Y key/value heads, D head
dim.

Each ``check_*`` runs the candidate forward and backward on one small problem and compares
the output and every gradient with a reference computed in fp32 at the highest matmul
precision from the same input values (the candidate's bf16 inputs upcast). Errors are
relative Frobenius norms, ``|a - b| / |b|``; a non-finite value counts as an infinite error.
A candidate that raises is a failed check that carries the exception text. Used by the
trainer's startup self-test (``moe_train.selftest``) on a small problem and by
``make gpu-check`` (``moe_train.gpucheck``) at Mixtral- and DeepSeek-shaped experts.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moe_train.base.platform import Platform
from moe_train.model import attention, precision
from moe_train.moe import layer
from moe_train.moe.dispatch import Arrived
from moe_train.moe.routings import MoEShape, assignments

# Largest relative error accepted per compute dtype. fp32 allows TF32-class matmuls on GPUs;
# bf16 (8 significant bits) rounds operands and the SwiGLU intermediate: a correct kernel
# lands near 0.5%, a wrong expert, row or gradient near 100%.
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 1e-2}
# fp8 (e4m3 operands, e5m2 gradients): 3 and 2 mantissa bits, per-tensor scales.
FP8_TOLERANCE = {"output": 0.08, "grad": 0.2}
F32 = jnp.float32
# jax_default_matmul_precision values under which a TPU multiplies float32 in one bf16 pass
TPU_ONE_PASS = (None, "default", "fastest", "bfloat16")


def tolerance(dtype) -> float:
    """The bound for a kernel computing in ``dtype`` on this backend. At JAX's default matmul
    precision a TPU multiplies float32 operands in one bfloat16 pass (a TPU v5e: 4.4e-3 in the
    routed SwiGLU's dw1, 4.2e-3 in attention's dq), so float32 there gets bfloat16's bound."""
    name = jnp.dtype(dtype).name
    if (
        name == "float32"
        and Platform.here().name == "tpu"
        # jax.config's flags are attributes it sets at run time
        and jax.config.jax_default_matmul_precision in TPU_ONE_PASS  # pyright: ignore[reportAttributeAccessIssue]
    ):
        return TOLERANCE["bfloat16"]
    return TOLERANCE[name]


@dataclasses.dataclass(frozen=True)
class Result:
    """One candidate's check."""

    kind: str  # config key it is a value of: moe.backend | model.attention | precision.fp8_backend
    name: str  # the candidate
    ok: bool  # ran, and every error is within its tolerance
    errors: dict[str, float]  # relative error of the output and of each gradient
    tolerance: dict[str, float]  # the bound each error was held to
    time_s: float | None = None  # median forward+backward time on the problem (when timed)
    error: str = ""  # exception text when it did not run

    def line(self) -> str:
        """``tiled ok (max rel err 3.1e-07 <= 1e-03, 1.2 ms)`` or why it failed."""
        if self.error:
            return f"{self.name} FAILED to run ({self.error})"
        worst = max(self.errors, key=lambda k: self.errors[k] / self.tolerance[k])
        t = f", {self.time_s * 1e3:.2f} ms" if self.time_s is not None else ""
        verdict = "ok" if self.ok else "FAILED"
        return (
            f"{self.name} {verdict} (max rel err {self.errors[worst]:.2e} in {worst}, "
            f"bound {self.tolerance[worst]:.0e}{t})"
        )


HOST_ERR_MAX = 1 << 22  # elements: larger arrays are compared on their device


@jax.jit
def _device_err(got, want):
    """(all finite, |got - want|, |want|) in fp32 on the arrays' device."""
    g, w = got.astype(F32), want.astype(F32)
    return jnp.all(jnp.isfinite(g)), jnp.linalg.norm(g - w), jnp.linalg.norm(w)


def rel_err(got, want) -> float:
    """|got - want| / |want| (inf when got is not finite): in float64 on the host, or for
    arrays over HOST_ERR_MAX elements in fp32 on their device (the expert weight gradients of
    a Mixtral-sized check: 1.4 billion elements took ~20 s per check through the host)."""
    if np.shape(got) != np.shape(want):
        return float("inf")
    if np.size(got) > HOST_ERR_MAX:
        finite, diff, norm = jax.device_get(_device_err(got, want))
        return float(diff) / max(float(norm), 1e-30) if finite else float("inf")
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(g)):
        return float("inf")
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def compare(
    kind: str, name: str, got: dict, want: dict, tol: dict[str, float], time_s: float | None = None
) -> Result:
    errors = {k: rel_err(got[k], want[k]) for k in want}
    ok = all(errors[k] <= tol[k] for k in errors)
    return Result(kind, name, ok, errors, {k: tol[k] for k in errors}, time_s)


def failed(kind: str, name: str, err: BaseException) -> Result:
    text = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return Result(kind, name, False, {}, {}, None, text)


def median_time(fn: Callable, args, reps: int) -> float:
    """Median wall time of ``fn(*args)`` (already compiled) over ``reps`` calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


HOST_DRAW_MAX = 1 << 22  # elements: smaller arrays are drawn on the host (no compilation)


def _normal(rng: np.random.Generator, shape, dtype=F32, scale=1.0) -> jax.Array:
    """Normals in ``dtype`` on the device: small ones drawn by numpy (no compilation), large
    ones (expert weights of real models: billions of elements) by jax.random on the device."""
    if int(np.prod(shape)) <= HOST_DRAW_MAX:
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale).astype(dtype)
    key = jax.random.key(int(rng.integers(1 << 31)))
    return jax.random.normal(key, shape, jnp.dtype(dtype)) * jnp.asarray(scale, dtype)


# ----------------------------------------------------------------------------- grouped GEMM


@dataclasses.dataclass(frozen=True)
class GemmProblem(MoEShape):
    """Routed rows for the experts' SwiGLU: T tokens to top-K of E experts."""

    dtype: str
    routing: str = "hot-empty"  # uniform | zipf | hot | empty | hot-empty
    tile_rows: int = 0  # of the tiled backend; 0 = the layer's default
    seed: int = 0


def routing_ids(p: GemmProblem) -> np.ndarray:
    """Expert ids [T, K]. ``hot``: expert 0 in every top-k; ``empty``: the upper half of
    the experts get nothing; ``hot-empty``: both (expert 0 hot, the last expert empty)."""
    E, K, T = p.experts, p.top_k, p.tokens
    if p.routing in ("uniform", "zipf", "hot"):
        return assignments(T, E, K, p.routing, seed=p.seed)
    used = max(K, E // 2) if p.routing == "empty" else max(K, E - 1)
    ids = assignments(T, used, K, "hot" if p.routing == "hot-empty" else "uniform", seed=p.seed)
    return ids.astype(np.int32)


@functools.lru_cache(maxsize=1)
def _expert_weights(E: int, H: int, F: int, dtype: str, seed: int) -> tuple[jax.Array, ...]:
    """w0, w1 [E, H, F] and wo [E, F, H] (kept for the next check of the same shape)."""
    rng, dt = np.random.default_rng(seed + 1), jnp.dtype(dtype)
    return (
        _normal(rng, (E, H, F), dt, H**-0.5),
        _normal(rng, (E, H, F), dt, H**-0.5),
        _normal(rng, (E, F, H), dt, F**-0.5),
    )


def gemm_operands(p: GemmProblem) -> dict[str, jax.Array]:
    """x [T, H], w0/w1 [E, H, F], wo [E, F, H], experts/weights [T, K], dy [T, H]."""
    rng = np.random.default_rng(p.seed)
    T, H = p.tokens, p.hidden
    logits_TK = rng.standard_normal((T, p.top_k))
    w_TK = np.exp(logits_TK) / np.exp(logits_TK).sum(-1, keepdims=True)
    w0, w1, wo = _expert_weights(p.experts, H, p.ffn, jnp.dtype(p.dtype).name, p.seed)
    return {
        "x": _normal(rng, (T, H), jnp.dtype(p.dtype)),
        "w0": w0,
        "w1": w1,
        "wo": wo,
        "experts": jnp.asarray(routing_ids(p)),
        "weights": jnp.asarray(w_TK, F32),
        "dy": _normal(rng, (T, H)),
    }


def gemm_layer(backend: str, num_experts: int, tile_rows: int) -> Callable:
    """(x, w0, w1, wo, experts, weights) -> y [T, H]: the MoE layer's expert steps (permute,
    grouped SwiGLU with each row scaled by its combine weight, unpermute) on one device."""

    def fn(x, w0, w1, wo, experts, weights):
        tiles = layer.row_tiles(backend, tile_rows, experts.size, num_experts)
        arrived = Arrived(x, experts, weights, x.dtype, spare=False)
        return layer.expert_steps(arrived, layer.Experts(w0, w1, wo, backend, *tiles))

    return fn


def _slots(experts: np.ndarray, num_experts: int) -> tuple[np.ndarray, int]:
    """Each assignment's slot in its expert's [C] rows (C = the largest expert load)."""
    flat = experts.ravel()
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=num_experts)
    slot = np.empty_like(flat)
    slot[order] = np.arange(flat.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return slot.reshape(experts.shape), max(int(counts.max()), 1)


@functools.partial(jax.jit, static_argnums=(6,))
def _reference_vjp(x, w0, w1, wo, experts, slot, capacity, weights, dy):
    def layer(x, w0, w1, wo):
        E, T, K = w0.shape[0], *experts.shape
        tok = jnp.broadcast_to(jnp.arange(T)[:, None], (T, K))
        rows_ECH = jnp.zeros((E, capacity, x.shape[1]), F32).at[experts, slot].set(x[tok].astype(F32))
        h = jax.nn.silu(jnp.einsum("ech,ehf->ecf", rows_ECH, w0.astype(F32))) * jnp.einsum(
            "ech,ehf->ecf", rows_ECH, w1.astype(F32)
        )
        out_ECH = jnp.einsum("ecf,efh->ech", h, wo.astype(F32))
        return jnp.einsum("tkh,tk->th", out_ECH[experts, slot], weights)

    with jax.default_matmul_precision("highest"):
        y, vjp = jax.vjp(layer, x, w0, w1, wo)
        return y, vjp(dy)


def gemm_reference(x, w0, w1, wo, experts, weights, dy):
    """y = sum_k w[t,k] * SwiGLU_{e[t,k]}(x[t]) and the gradients of <y, dy> with respect to
    x, w0, w1, wo, in fp32 at the highest matmul precision: each expert's rows gathered into
    its own [C, H] block (C = the largest load), plain einsums, gradients by autodiff."""
    slot, capacity = _slots(np.asarray(experts), w0.shape[0])
    return _reference_vjp(x, w0, w1, wo, experts, jnp.asarray(slot), capacity, weights, dy)


def _vjp_fn(fn: Callable, n_diff: int) -> Callable:
    """jit of (diff args..., rest..., dy) -> (y, grads of <y, dy> w.r.t. the first n_diff)."""

    def run(*args):
        *ops, dy = args
        y, vjp = jax.vjp(lambda *d: fn(*d, *ops[n_diff:]), *ops[:n_diff])
        return y, vjp(dy.astype(y.dtype))

    return jax.jit(run)


def gemm_vjp(backend: str, num_experts: int, tile_rows: int = 0) -> Callable:
    """Jitted (x, w0, w1, wo, experts, weights, dy) -> (y, (dx, dw0, dw1, dwo)); build it once
    to check one shape under several routings without recompiling."""
    return _vjp_fn(gemm_layer(backend, num_experts, tile_rows), 4)


def check_gemm(backend: str, p: GemmProblem, *, time_reps: int = 0, cand: Callable | None = None) -> Result:
    """``backend``'s routed SwiGLU (forward, dx, dw0, dw1, dwo) against the fp32 reference
    (``cand``: a prebuilt ``gemm_vjp`` of the same backend)."""
    kind = "moe.backend"
    try:
        ops = gemm_operands(p)
        args = (ops["x"], ops["w0"], ops["w1"], ops["wo"], ops["experts"], ops["weights"], ops["dy"])
        cand = cand or gemm_vjp(backend, p.experts, p.tile_rows)
        y, grads = jax.block_until_ready(cand(*args))
        y_ref, grads_ref = gemm_reference(*args)
        secs = median_time(cand, args, time_reps) if time_reps else None
    except Exception as err:  # noqa: BLE001 (any failure of a kernel is a failed check)
        return failed(kind, backend, err)
    names = ("output", "dx", "dw0", "dw1", "dwo")
    got, want = dict(zip(names, (y, *grads))), dict(zip(names, (y_ref, *grads_ref)))
    tol = tolerance(p.dtype)
    return compare(kind, backend, got, want, {k: tol for k in names}, secs)


# ----------------------------------------------------------------------------- attention


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """Causal GQA attention on [B, S, N, D] queries and [B, S, Y, D] keys/values."""

    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    block: int = 0  # the chunked implementation's block rows (0: its default)
    seed: int = 0


def attention_operands(p: AttentionProblem) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(p.seed)
    dt, B, S = jnp.dtype(p.dtype), p.batch, p.seq_len
    return (
        _normal(rng, (B, S, p.heads, p.head_dim), dt),
        _normal(rng, (B, S, p.kv_heads, p.head_dim), dt),
        _normal(rng, (B, S, p.kv_heads, p.v_head_dim), dt),
        _normal(rng, (B, S, p.heads, p.v_head_dim)),
    )


def check_attention(name: str, p: AttentionProblem, *, time_reps: int = 0) -> Result:
    """Attention ``name`` (forward, dq, dk, dv) against ``xla`` attention in fp32."""
    kind = "model.attention"
    try:
        args = attention_operands(p)
        cand = _vjp_fn(lambda q, k, v: attention.attend(q, k, v, implementation=name, block=p.block), 3)
        y, grads = jax.block_until_ready(cand(*args))

        def ref(q, k, v):
            with jax.default_matmul_precision("highest"):
                return attention.attend(q.astype(F32), k.astype(F32), v.astype(F32), implementation="xla")

        y_ref, grads_ref = _vjp_fn(ref, 3)(*args)
        secs = median_time(cand, args, time_reps) if time_reps else None
    except Exception as err:  # noqa: BLE001
        return failed(kind, name, err)
    names = ("output", "dq", "dk", "dv")
    got, want = dict(zip(names, (y, *grads))), dict(zip(names, (y_ref, *grads_ref)))
    tol = tolerance(p.dtype)
    return compare(kind, name, got, want, {k: tol for k in names}, secs)


# ----------------------------------------------------------------------------- fp8


def fp8_probe(backend: str, recipe_name: str, history: int, margin: int) -> Callable:
    """(x [M, H], w [H, F]) -> y through ``precision.dot`` under fp8 with ``backend``."""
    import flax.linen as nn

    pol = precision.Policy(
        dtype=jnp.dtype(jnp.bfloat16),
        fp8=True,
        backend=backend,
        recipe=precision.Recipe(current=recipe_name != "delayed", margin=margin),
        history=history,
        recipe_name=recipe_name,
    )

    class Probe(nn.Module):
        @nn.compact
        def __call__(self, x, w):
            return precision.dot(pol, "probe", x, w)

    probe = Probe()
    x0, w0 = jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)
    state = probe.init(jax.random.key(0), x0, w0)

    def fn(x, w):
        y, _ = probe.apply(state, x, w, mutable=[precision.FP8_COLLECTION])
        return y

    return fn


def check_fp8(
    backend: str,
    recipe_name: str = "delayed",
    history: int = 16,
    margin: int = 0,
    shape: tuple[int, int, int] = (64, 128, 128),
    *,
    time_reps: int = 0,
    fn: Callable | None = None,
) -> Result:
    """One fp8 dense projection (y, dx, dw) against fp32 ``x @ w`` within fp8 tolerances."""
    kind = "precision.fp8_backend"
    M, H, F = shape
    try:
        rng = np.random.default_rng(3)
        x = _normal(rng, (M, H), jnp.bfloat16)
        w = _normal(rng, (H, F), jnp.bfloat16, H**-0.5)
        dy = _normal(rng, (M, F))
        cand = _vjp_fn(fn or fp8_probe(backend, recipe_name, history, margin), 2)
        y, grads = jax.block_until_ready(cand(x, w, dy))

        def ref(x, w):
            with jax.default_matmul_precision("highest"):
                return x.astype(F32) @ w.astype(F32)

        y_ref, grads_ref = _vjp_fn(ref, 2)(x, w, dy)
        secs = median_time(cand, (x, w, dy), time_reps) if time_reps else None
    except Exception as err:  # noqa: BLE001
        return failed(kind, backend, err)
    names = ("output", "dx", "dw")
    got, want = dict(zip(names, (y, *grads))), dict(zip(names, (y_ref, *grads_ref)))
    tol = {"output": FP8_TOLERANCE["output"], "dx": FP8_TOLERANCE["grad"], "dw": FP8_TOLERANCE["grad"]}
    return compare(kind, backend, got, want, tol, secs)
