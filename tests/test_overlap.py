"""``make bench``'s overlap section: chunked exchanges give the unchunked results, fp8
dispatch moves fewer bytes within its bound (in-process, 8 fake devices, tiny sizes)."""

import pytest

from moe_train.bench import overlap

TINY = overlap.Sizes(tokens=64, hidden=16, ffn=16, experts=8, top_k=2, min_reps=1, target_s=0.01)


@pytest.fixture(scope="module")
def rows():
    """The two-stage dispatcher's rows (tests/test_fp8_dispatch.py and tests/test_ep.py
    check every dispatcher's results; this checks the section's own numbers)."""
    return {
        (r["chunks"], r["dispatch_dtype"]): r
        for r in overlap.dispatcher_rows(TINY, "hierarchical", overlap.operands(TINY))
    }


def test_chunks_give_the_unchunked_results(rows):
    for chunks in (2, 4):
        r = rows[chunks, "activation"]
        assert r["y_rel_diff"] <= 1e-6 and r["grad_rel_diff"] <= 1e-5, r


def test_chunks_move_the_same_bytes(rows):
    assert rows[4, "activation"]["fwd_bytes_per_device"] == rows[1, "activation"]["fwd_bytes_per_device"]


def test_fp8_dispatch_moves_fewer_bytes_within_its_bound(rows):
    fp8, ref = rows[1, "fp8"], rows[1, "activation"]
    assert fp8["fwd_bytes_per_device"] < ref["fwd_bytes_per_device"]
    assert 0 < fp8["y_rel_diff"] <= 4e-2
