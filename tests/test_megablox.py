"""The megablox grouped-GEMM backend (JAX's Pallas TPU kernels; on CPU in interpret mode)
against the fp32 reference, forward and gradients, under adversarial routings; its tiles and
row padding; and where ``auto`` offers it."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_train.moe import BackendUnavailable, layer, megablox, resolve_backend
from moe_train.moe.dispatch import Arrived
from moe_train.moe.permute import make_dispatch
from moe_train.moe.tiled import expert_operands
from moe_train.selftest import checks

T, H, F, E, K = 37, 128, 256, 8, 2  # M = 74 rows: groups end mid-tile, 6 rows of padding
ROW_TILE = 16
on_tpu = jax.default_backend() == "tpu"


def _normal(*shape, seed=0, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def _ids(case: str) -> np.ndarray:
    """[T, K] expert ids: random distinct pairs; every row to experts 0 and 1 (all of expert 0
    in one group, six experts empty); only experts 5..7 (the first five empty); ties (every
    token the same pair, reversed for odd tokens)."""
    rng = np.random.default_rng(1)
    if case == "random":
        return np.stack([rng.permutation(E)[:K] for _ in range(T)])
    if case == "one-expert":
        return np.tile([0, 1], (T, 1))
    if case == "empty-first":
        return np.stack([5 + rng.permutation(3)[:K] for _ in range(T)])
    return np.array([[2, 4] if t % 2 else [4, 2] for t in range(T)])  # "ties"


def _operands(dtype=jnp.float32):
    x = _normal(T, H, seed=2).astype(dtype)
    w0, w1 = _normal(E, H, F, seed=3, scale=H**-0.5), _normal(E, H, F, seed=4, scale=H**-0.5)
    wo = _normal(E, F, H, seed=5, scale=F**-0.5)
    weights = jnp.asarray(np.random.default_rng(6).random((T, K)), jnp.float32)
    return x, w0, w1, wo, weights, _normal(T, H, seed=7)


@functools.cache
def _layer_vjp(backend: str, spare: bool, padded: bool = False):
    """jit of (x, w0, w1, wo, ids, weights, dy) -> (y, (dx, dw0, dw1, dwo)): the expert steps,
    on sorted rows or (``padded``) each group padded to the row tile."""
    tile_rows = ROW_TILE if padded else None

    def run(x, w0, w1, wo, ids, weights, dy):
        def fn(x, w0, w1, wo):
            arrived = Arrived(x, ids, weights, x.dtype, spare=spare)
            return layer.expert_steps(arrived, layer.Experts(w0, w1, wo, backend, tile_rows, ROW_TILE))

        y, vjp = jax.vjp(fn, x, w0, w1, wo)
        return y, vjp(dy.astype(y.dtype))

    return jax.jit(run)


def _max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["sorted", "padded"])
@pytest.mark.parametrize("case", ["random", "one-expert", "empty-first", "ties"])
def test_forward_and_gradients_match_the_reference(case, padded):
    x, w0, w1, wo, weights, dy = _operands()
    ids = jnp.asarray(_ids(case), jnp.int32)
    with jax.default_matmul_precision("highest"):
        y, grads = _layer_vjp("megablox", False, padded)(x, w0, w1, wo, ids, weights, dy)
        ref_y, ref_grads = checks.gemm_reference(x, w0, w1, wo, ids, weights, dy)
    errors = [_max_rel(a, b) for a, b in zip((y, *grads), (ref_y, *ref_grads))]
    assert max(errors) < 1e-5, errors


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["sorted", "padded"])
def test_rows_for_no_expert_here_read_zero_and_pass_no_gradient(padded):
    """Under expert parallelism ids == E mark rows for another shard (the spare group)."""
    x, w0, w1, wo, weights, dy = _operands()
    ids = np.asarray(_ids("random"))
    ids[::3, 1] = E  # a third of the tokens' second choice is not here
    ids = jnp.asarray(ids, jnp.int32)
    kept = jnp.where(ids < E, weights, 0.0)
    with jax.default_matmul_precision("highest"):
        y, grads = _layer_vjp("megablox", True, padded)(x, w0, w1, wo, ids, weights, dy)
        ref_y, ref_grads = checks.gemm_reference(x, w0, w1, wo, jnp.minimum(ids, E - 1), kept, dy)
    errors = [_max_rel(a, b) for a, b in zip((y, *grads), (ref_y, *ref_grads))]
    assert max(errors) < 1e-5, errors


@pytest.mark.slow
def test_rows_that_fill_the_row_tile_match_the_reference():
    """40 tokens x top-2 = 80 rows, a multiple of the row tile: every row is in a group, so the
    outputs' rows after the groups are not zeroed (no [R, H] select)."""
    T40 = 40
    rng = np.random.default_rng(8)
    x, dy = _normal(T40, H, seed=2), _normal(T40, H, seed=7)
    w0, w1 = _normal(E, H, F, seed=3, scale=H**-0.5), _normal(E, H, F, seed=4, scale=H**-0.5)
    wo = _normal(E, F, H, seed=5, scale=F**-0.5)
    weights = jnp.asarray(rng.random((T40, K)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(T40)]), jnp.int32)
    with jax.default_matmul_precision("highest"):
        y, grads = _layer_vjp("megablox", False)(x, w0, w1, wo, ids, weights, dy)
        ref_y, ref_grads = checks.gemm_reference(x, w0, w1, wo, ids, weights, dy)
    errors = [_max_rel(a, b) for a, b in zip((y, *grads), (ref_y, *ref_grads))]
    assert max(errors) < 1e-5, errors


def test_all_grouped_rows_are_not_selected():
    a = jnp.ones((32, H))
    setup = megablox.Setup(16, "x", True, all_grouped=True)
    assert megablox._rows_in_groups(a, jnp.array([3, 4]), setup) is a


@pytest.mark.slow
def test_bf16_matches_the_reference_to_bf16_rounding():
    x, w0, w1, wo, weights, dy = _operands(jnp.bfloat16)
    ids = jnp.asarray(_ids("random"), jnp.int32)
    y, grads = _layer_vjp("megablox", False)(x, w0, w1, wo, ids, weights, dy)
    ref_y, ref_grads = checks.gemm_reference(x.astype(jnp.float32), w0, w1, wo, ids, weights, dy)
    errors = [_max_rel(a, b) for a, b in zip((y, *grads), (ref_y, *ref_grads))]
    assert max(errors) < 3e-2, errors


def test_sorted_rows_are_padded_to_the_row_multiple():
    plan = make_dispatch(jnp.asarray(_ids("random"), jnp.int32), E, None, ROW_TILE)
    assert plan.token_R.shape == (80,) and int(plan.valid_R.sum()) == T * K


def test_padding_rows_are_invalid():
    plan = make_dispatch(jnp.asarray(_ids("random"), jnp.int32), E, None, ROW_TILE)
    assert not np.asarray(plan.valid_R)[T * K :].any()


def test_the_row_tile_is_capped_for_large_loads():
    assert megablox.default_row_tile(1 << 20, 8) == megablox.MAX_ROW_TILE


def test_the_row_tile_is_a_share_of_the_mean_load():
    """Qwen3-30B's shape: 131,072 rows over 128 experts, 1,024 each on average."""
    assert megablox.default_row_tile(131072, 128) == 1024 // megablox.LOAD_PER_TILE


def test_the_row_tile_is_a_power_of_two_within_the_share():
    assert megablox.default_row_tile(8 * 40 * megablox.LOAD_PER_TILE, 8) == 32


def test_the_row_tile_has_a_floor():
    assert megablox.default_row_tile(8, 8) == megablox.MIN_ROW_TILE


def test_tiles_default_where_the_table_has_no_entry():
    assert megablox.tiles_for("fwd", 512, 4096, 28672, device_kind="no such chip") == megablox.DEFAULT_TILE


def test_tiles_clamp_to_a_small_dimension_rounded_to_the_lane_width():
    assert megablox.tiles_for("drhs", 512, 200, 768, device_kind="x") == (512, 256, 768)


def test_no_measured_tile_is_cut_by_the_rows_padding():
    """A table tile's tm above the row tile would be clamped to a tile nobody measured."""
    table = megablox.load_table()
    tms = [tile[0] for kinds in table.values() for by_kn in kinds.values() for tile in by_kn.values()]
    assert tms and max(tms) <= megablox.MAX_ROW_TILE


def test_the_row_tile_caps_tm():
    assert megablox.tiles_for("dlhs", 64, 4096, 4096, device_kind="x")[0] == 64


def test_tiles_come_from_the_measured_table(tmp_path, monkeypatch):
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"tiles": {"TPU test": {"fwd": {"2048x1536": [256, 1024, 768]}}}}))
    monkeypatch.setattr(megablox, "load_table", functools.partial(megablox.load_table.__wrapped__, path))
    assert megablox.tiles_for("fwd", 512, 2048, 1536, device_kind="TPU test") == (256, 1024, 768)


def test_a_tile_over_the_vmem_budget_is_halved():
    """Mixtral's ``dy @ wo^T`` (fp32 output) at (1024, 512, 1024) did not compile on the v5e."""
    fitted = megablox.clamp_tile((1024, 512, 1024), 1024, 4096, 14336, kind="dlhs", out_bytes=4)
    assert fitted == (512, 512, 1024)


def test_a_tile_within_the_vmem_budget_is_kept():
    assert megablox.clamp_tile((1024, 512, 1024), 1024, 4096, 14336, kind="fwd") == (1024, 512, 1024)


def test_the_weight_gradients_vmem_counts_their_output_block():
    """tgmm's (128, 1024, 2048) did not compile at Mixtral's shape: its (tk, tn) output is big."""
    assert megablox.vmem_bytes("drhs", (128, 1024, 2048), 2, 2) > megablox.VMEM_BUDGET


# (k, n) of the GEMMs at the presets' expert shapes (Mixtral, Qwen3, DeepSeek-V3, the bench's
# step model), both dtypes: every tile the backend would run is within the budget
PRESET_KN = [
    (4096, 14336),
    (14336, 4096),
    (4096, 28672),
    (28672, 4096),
    (2048, 768),
    (768, 2048),
    (2048, 1536),
    (1536, 2048),
    (7168, 2048),
    (2048, 7168),
    (7168, 4096),
    (4096, 7168),
    (1024, 512),
    (512, 1024),
    (1024, 1024),
]


@pytest.mark.parametrize("kind", megablox.KINDS)
@pytest.mark.parametrize("nbytes", [2, 4])
def test_every_preset_gemm_tile_fits_the_vmem_budget(kind, nbytes):
    for device_kind in [*megablox.load_table(), "no such chip"]:
        for k, n in PRESET_KN:
            for out_bytes in {nbytes, 4}:
                tile = megablox.tiles_for(kind, 1024, k, n, device_kind, in_bytes=nbytes, out_bytes=out_bytes)
                assert megablox.vmem_bytes(kind, tile, nbytes, out_bytes) <= megablox.VMEM_BUDGET, (
                    k,
                    n,
                    tile,
                )


def test_the_backend_fits_each_gemms_tile_to_its_output_dtype(monkeypatch):
    """The rows' gradient through wo has an fp32 output: its tile is fitted to that, not to x's."""
    seen = []
    real = megablox._kernels()

    class Recording:
        tgmm = staticmethod(real.tgmm)

        @staticmethod
        def gmm(lhs, rhs, sizes, preferred_element_type, tiling, **kw):
            seen.append((jnp.dtype(preferred_element_type), tiling))
            return real.gmm(
                lhs, rhs, sizes, preferred_element_type=preferred_element_type, tiling=tiling, **kw
            )

    monkeypatch.setattr(megablox, "_kernels", Recording)
    monkeypatch.setattr(megablox, "VMEM_BUDGET", megablox.vmem_bytes("dlhs", (16, 128, 256), 2, 2))
    x, w0 = _normal(32, H).astype(jnp.bfloat16), _normal(E, H, F, seed=1).astype(jnp.bfloat16)
    ops = expert_operands(x, w0, w0, w0.swapaxes(1, 2), jnp.full((E,), 4, jnp.int32))
    jax.grad(lambda x: megablox.megablox_swiglu((x, *ops[1:]), row_tile=16).astype(jnp.float32).sum())(x)
    fp32_tiles = [tile for dtype, tile in seen if dtype == jnp.float32]
    assert fp32_tiles and all(
        megablox.vmem_bytes("dlhs", t, 2, 4) <= megablox.VMEM_BUDGET for t in fp32_tiles
    )


def test_an_unknown_gemm_kind_is_refused():
    with pytest.raises(ValueError, match="unknown GEMM kind"):
        megablox.tiles_for("backward", 512, 128, 128)


def test_the_shipped_table_names_its_command():
    assert "moe_train.bench" in json.loads(megablox.TILE_FILE.read_text())["written_by"]


def test_rows_not_a_multiple_of_the_tile_are_refused():
    x = jnp.zeros((40, H), jnp.float32)
    w = jnp.zeros((E, H, F), jnp.float32)
    with pytest.raises(ValueError, match="multiple of the row tile"):
        ops = expert_operands(x, w, w, w.swapaxes(1, 2), jnp.zeros((E,), jnp.int32))
        megablox.megablox_swiglu(ops, row_tile=16)


@pytest.mark.skipif(on_tpu, reason="off a TPU only")
def test_auto_does_not_pick_megablox_off_a_tpu():
    assert resolve_backend("auto", jnp.bfloat16) != "megablox"


@pytest.mark.skipif(on_tpu, reason="off a TPU only")
def test_an_explicit_megablox_off_a_tpu_names_the_tpu():
    with pytest.raises(BackendUnavailable, match="needs a TPU"):
        resolve_backend("megablox", jnp.bfloat16)


@pytest.mark.skipif(not on_tpu, reason="needs a TPU")
def test_auto_picks_megablox_on_a_tpu():
    assert resolve_backend("auto", jnp.bfloat16) == "megablox"


def test_row_tiles_of_megablox_leave_the_tiled_layout_off():
    assert layer.row_tiles("megablox", None, 131072, 128) == (None, megablox.default_row_tile(131072, 128))


def test_row_tiles_of_megablox_with_tile_rows_pad_each_group_to_them():
    assert layer.row_tiles("megablox", 256, 131072, 128) == (256, 256)


def test_megablox_tile_rows_off_the_sublane_packing_are_refused():
    with pytest.raises(ValueError, match="moe.tile_rows=100"):
        layer.row_tiles("megablox", 100, 131072, 128)


def _ep_grads(ops, dispatcher: str, ep: int, inner: int, backend: str, tile_rows=None):
    from moe_train.moe import Routing
    from moe_train.parallel import sharding
    from moe_train.parallel.jobplan import EPPlan

    mesh = sharding.make_mesh(jax.devices()[:8], (8 // ep, ep // inner, inner))

    def loss(ops):
        y, _ = layer.dropless_moe(
            *ops,
            routing=Routing(K),
            plan=EPPlan(dispatcher, ep),
            seq_len=16,
            backend=backend,
            tile_rows=tile_rows,
        )
        return jnp.sum(y * jnp.cos(y)), y

    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(ops)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (a TPU v5e chip is 1)")
@pytest.mark.parametrize(
    "dispatcher,ep,inner,tile_rows", [("a2a", 4, 4, None), ("hierarchical", 8, 2, None), ("a2a", 4, 4, 16)]
)
def test_expert_parallel_megablox_equals_tiled(monkeypatch, dispatcher, ep, inner, tile_rows):
    """Under shard_map, with rows for other shards in the spare group, on sorted rows and (with
    ``tile_rows``) each group padded to the tile; off a TPU the platform check is lifted so that
    dropless_moe runs the kernels in interpret mode."""
    resolve = layer.resolve_backend
    monkeypatch.setattr(
        layer, "resolve_backend", lambda n, d=None, **kw: n if n == "megablox" else resolve(n, d, **kw)
    )
    keys = jax.random.split(jax.random.key(0), 5)
    ops = (
        jax.random.normal(keys[0], (128, H)),
        jax.random.normal(keys[1], (H, E)) * 0.5,
        *(jax.random.normal(k, s) * 0.1 for k, s in zip(keys[2:], [(E, H, F), (E, H, F), (E, F, H)])),
    )
    (_, y), grads = _ep_grads(ops, dispatcher, ep, inner, "megablox", tile_rows)
    (_, y_ref), grads_ref = _ep_grads(ops, dispatcher, ep, inner, "tiled")
    errors = [_max_rel(a, b) for a, b in zip((y, *grads), (y_ref, *grads_ref))]
    assert max(errors) < 1e-5, errors
