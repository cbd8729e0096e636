"""Checkpoint manifests: every saved array's shape, dtype, two checksums and whether it is finite.

A checkpoint is trusted only if the arrays read back are the arrays that were saved. At save,
``fingerprint`` computes, on the devices and in one jitted call over the whole train state,
for every array:

* ``sum``: the sum of its values' bit patterns modulo 2**32 (each element read as an
  unsigned integer of its width), and
* ``weighted``: the same sum with element ``i`` (row-major) weighted by ``i + 1``, so that
  swapped or shifted blocks change it too;
* ``finite``: whether every value is finite (integer arrays always are).

Integer addition modulo 2**32 is associative and commutative, so both sums are exact and do
not depend on how the array is sharded, on the device count, or on the reduction order: a
checkpoint written on 8 devices verifies when it is restored onto 2. A random change of
any byte changes ``sum`` with probability 1 - 2**-32.

The manifest is saved as one more item of the same Orbax checkpoint, so it is committed
atomically with the state. ``verify`` compares a restored tree with it and names the
arrays that differ: the whole state (resume) or the part a reader read (``partial``: the
weights' params and expert bias); ``verify_leaf`` checks one host array (``to-hf`` reads
leaf by leaf), in blocks of ``BLOCK`` elements so that a large memory-mapped leaf is never
copied whole. Both compute the same sums (``_leaf_sums``, with the block's offset).

``from-hf`` writes the same manifest for each part of a converted checkpoint
(``host_fingerprint``, from the host arrays it saves); its readers verify it as above.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moe_train.config.checks import first_few

VERSION = 1
BLOCK = 1 << 24  # elements per block when checking one host array (64 MiB as uint32)


class CorruptCheckpoint(Exception):
    """A checkpoint that cannot be read or does not match its manifest (one line)."""


def _bits_u32(x: jax.Array) -> jax.Array:
    """Every element's bit pattern as uint32 (1, 2 and 4-byte dtypes)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = x.dtype.itemsize
    if width not in (1, 2, 4):
        raise TypeError(f"manifest: unsupported dtype {x.dtype} (itemsize {width})")
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_sums(x: jax.Array, offset: Any = 0) -> jax.Array:
    """[sum, weighted, finite] of one array as uint32[3]; ``offset``: the row-major index of
    its first element when ``x`` is one block of a larger array."""
    bits = _bits_u32(x).reshape(-1)
    weight = jnp.arange(1, bits.size + 1, dtype=jnp.uint32) + jnp.uint32(offset)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    return jnp.stack(
        [jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32), finite.astype(jnp.uint32)]
    )


@jax.jit
def _all_sums(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_leaf_sums(x) for x in leaves]


_block_sums = jax.jit(_leaf_sums)


def _key(k: Any) -> str:
    for attr in ("name", "key", "idx"):  # GetAttrKey, DictKey / FlattenedIndexKey, SequenceKey
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _paths(tree: Any) -> tuple[list[str], list[Any]]:
    """Leaf names like ``params/embed`` (the same for a dataclass field and a dict key)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return ["/".join(_key(k) for k in p) for p, _ in flat], [x for _, x in flat]


def fingerprint(tree: Any) -> dict[str, Any]:
    """The manifest of ``tree`` (arrays on any devices/shardings; a collective when the
    arrays span several processes: every process must call it)."""
    names, leaves = _paths(tree)
    sums = jax.device_get(_all_sums(leaves))
    arrays = {}
    for name, x, s in zip(names, leaves, sums):
        s = np.asarray(s)
        arrays[name] = {
            "shape": list(x.shape),
            "dtype": str(x.dtype),
            "sum": int(s[0]),
            "weighted": int(s[1]),
            "finite": bool(s[2]),
        }
    return {"version": VERSION, "arrays": arrays}


def non_finite(manifest: dict[str, Any]) -> list[str]:
    """Names of the arrays with a NaN or inf."""
    return [name for name, a in manifest["arrays"].items() if not a["finite"]]


def leaf_entry(x: np.ndarray, block: int = BLOCK) -> dict[str, Any]:
    """The manifest entry of one host array (a memory map too), summed in blocks of ``block``
    elements in row-major order: exactly ``fingerprint``'s sums (both are modulo 2**32)."""
    flat = np.asarray(x).reshape(-1)
    total, weighted, finite = 0, 0, True
    for start in range(0, flat.size, block):
        s = np.asarray(_block_sums(flat[start : start + block], np.uint32(start % 2**32)))
        total, weighted = (total + int(s[0])) % 2**32, (weighted + int(s[1])) % 2**32
        finite = finite and bool(s[2])
    return {
        "shape": list(x.shape),
        "dtype": str(x.dtype),
        "sum": total,
        "weighted": weighted,
        "finite": finite,
    }


def host_fingerprint(tree: Any) -> dict[str, Any]:
    """The manifest of a tree of host arrays (memory maps too: ``from-hf`` writes its parts
    from them), leaf by leaf with ``leaf_entry``: what ``fingerprint`` gives on devices."""
    names, leaves = _paths(tree)
    return {"version": VERSION, "arrays": {n: leaf_entry(x) for n, x in zip(names, leaves)}}


def differences(saved: dict[str, Any], restored: dict[str, Any]) -> list[str]:
    """What differs between a saved manifest and a restored state's, one phrase per array."""
    want, got = saved["arrays"], restored["arrays"]
    out = [f"{name} missing" for name in want if name not in got]
    out += [f"{name} not in the manifest" for name in got if name not in want]
    for name in want.keys() & got.keys():
        a, b = want[name], got[name]
        if (a["shape"], a["dtype"]) != (b["shape"], b["dtype"]):
            out.append(f"{name} is {b['dtype']}{b['shape']}, saved as {a['dtype']}{a['shape']}")
        elif (a["sum"], a["weighted"]) != (b["sum"], b["weighted"]):
            out.append(f"{name} checksum differs")
        elif not b["finite"]:
            out.append(f"{name} has non-finite values")
    return sorted(out)


def _compare(saved: dict[str, Any], got: dict[str, Any], where: str, partial: bool) -> None:
    """Raise CorruptCheckpoint naming ``where`` when ``got`` does not match ``saved`` (with
    ``partial``, only the arrays ``got`` holds are compared)."""
    if saved.get("version") != VERSION:
        raise CorruptCheckpoint(f"{where}: manifest version {saved.get('version')!r} is not {VERSION}")
    if partial:
        saved = {**saved, "arrays": {k: v for k, v in saved["arrays"].items() if k in got["arrays"]}}
    diffs = differences(saved, got)
    if diffs:
        shown = first_few(diffs, 3, "; ", " (+{} more)")
        count = (
            f"{len(diffs)} of {len(got['arrays'])} arrays read do"
            if len(got["arrays"]) > 1
            else "the array read does"
        )
        raise CorruptCheckpoint(f"{where}: {count} not match the manifest: {shown}")


def verify(saved: dict[str, Any], tree: Any, where: str, partial: bool = False) -> None:
    """Raise CorruptCheckpoint when ``tree`` (as restored) does not match ``saved``; with
    ``partial`` ``tree`` holds some of the saved arrays (each must match), else all."""
    _compare(saved, fingerprint(tree), where, partial)


def verify_leaf(saved: dict[str, Any], name: str, x: np.ndarray, where: str) -> None:
    """Raise CorruptCheckpoint when the host array ``x`` read as ``name`` does not match."""
    _compare(saved, {"version": VERSION, "arrays": {name: leaf_entry(x)}}, where, partial=True)
