"""The dispatcher contract (moe_train/moe/dispatch/contract.py): every dispatcher implements
``Dispatcher``, returns ``Arrived`` and its declared metadata type, and both are pytrees whose
leaves are arrays (dtypes and sizes are static fields). Traced only, never compiled."""

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from moe_train.config.schema import DISPATCHERS
from moe_train.moe import dispatch
from moe_train.moe.dispatch import BY_NAME, Arrived, Context, Dispatcher
from moe_train.moe.stats import EXCHANGE
from moe_train.parallel import sharding
from moe_train.parallel.jobplan import EPPlan

T, H, K, E = 64, 8, 2, 8
MESHES = {  # (data, expert_x, expert): EP groups over two domains where there is an exchange
    "local": (8, 1, 1),
    "allgather": (1, 2, 4),
    "a2a": (1, 2, 4),
    "hierarchical": (1, 2, 4),
}


def test_every_choice_has_a_dispatcher():
    assert set(BY_NAME) == (set(DISPATCHERS) - {"auto"}) | {"local"}
    assert set(MESHES) == set(BY_NAME)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_metadata_type_is_a_frozen_pytree_dataclass(name):
    cls = BY_NAME[name]
    assert isinstance(cls, type)
    sent_type = cls.sent_type
    assert sent_type.__name__ == cls.__name__ + "Sent"
    assert getattr(dispatch, sent_type.__name__) is sent_type
    assert sent_type.__dataclass_params__.frozen
    assert dataclasses.is_dataclass(sent_type)


def _trace(name: str, fp8: bool):
    """Trace ``name``'s dispatch and combine on every shard; what each returned."""
    mesh_shape = MESHES[name]
    ep = mesh_shape[1] * mesh_shape[2]
    plan = EPPlan(name, ep, None, 1, "fp8" if fp8 else "activation")
    d = BY_NAME[name](Context(plan, E // ep, mesh_shape[1], mesh_shape[2]))
    seen = {}

    def shard(x_TH, weights_TK, experts_TK):
        arrived, sent = d.dispatch(x_TH, weights_TK, experts_TK)
        y_TH, exchange = d.combine(arrived.x_AH, sent)
        seen.update(arrived=arrived, sent=sent, y=y_TH, exchange=exchange)
        return y_TH

    spec = P(sharding.TOKEN_AXES)
    mesh = sharding.make_mesh(jax.devices()[:8], mesh_shape)
    with jax.set_mesh(mesh):
        fn = jax.shard_map(shard, in_specs=(spec, spec, spec), out_specs=spec)
        jax.eval_shape(
            fn,
            jax.ShapeDtypeStruct((T, H), jnp.bfloat16),
            jax.ShapeDtypeStruct((T, K), jnp.float32),
            jax.ShapeDtypeStruct((T, K), jnp.int32),
        )
    return d, seen


def _is_pytree_of_arrays(value) -> bool:
    leaves, treedef = jax.tree.flatten(value)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    return all(isinstance(leaf, jax.Array) for leaf in leaves) and type(rebuilt) is type(value)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_dispatcher_satisfies_the_contract(name, fp8):
    d, seen = _trace(name, fp8)
    assert isinstance(d, Dispatcher)
    assert type(seen["sent"]) is type(d).sent_type
    assert isinstance(seen["arrived"], Arrived)
    assert _is_pytree_of_arrays(seen["sent"]) and _is_pytree_of_arrays(seen["arrived"])
    assert seen["y"].shape == (T // 8, H) and seen["y"].dtype == jnp.bfloat16
    assert set(seen["exchange"]) == set(EXCHANGE)


def test_dispatch_package_imports_at_module_level():
    """No import inside a function of the dispatch package (no lazy imports, no cycle)."""
    root = Path(dispatch.__file__).parent
    for path in sorted(root.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                nested = [n for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)]
                assert not nested, f"{path.name}: {fn.name} imports inside the function"
