"""The planner's search (``moe_train/planner/search.py``): the fastest jobs that fit, over the keys the user
left open, ranked by predicted step time; ``make plan --top N`` prints them and ``make submit``
runs the first."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import re

import pytest

from moe_train import config
from moe_train.planner import choices, layout, memory, search, show
from moe_train.planner import ep_plan as topo_plan
from moe_train.planner.decide import decide
from moe_train.planner.request import Request

# moe_train.planner.show imports slurm.submit, whose submitit sets up logging with dictConfig: that closes
# every handler there is, absl's too, and absl's writes to the stream pytest captured when
# jax was first imported. Importing submitit before any test imports jax keeps it open.
from slurm import submit  # noqa: F401  (first: see above)
from topology import presets

V3_64 = Request(preset="gb200-nvl72", model="deepseek-v3", nodes=64, ep=64)
V3_H100 = Request(preset="h100-dgx", model="deepseek-v3", nodes=128)
USER_SETS = ("train.remat=full", "moe.dispatch_dtype=activation", "moe.overlap_chunks=2")
MIXTRAL = Request(preset="h100-dgx", model="mixtral-8x7b", nodes=8, ep=8, sets=USER_SETS[:2])


def searched(req: Request, top: int = 5) -> search.Found | None:
    cluster = presets.load(req.preset)
    cfg, _ = layout.model_config(req, cluster)
    return search.search(req, cluster, cfg, top)


def found(req: Request, top: int = 5) -> search.Found:
    """The search's jobs for ``req``, whose compute has a step prediction."""
    jobs = searched(req, top)
    assert jobs is not None, f"nothing searched for {req}"
    return jobs


@pytest.fixture(scope="module")
def v3() -> search.Found:
    return found(V3_64)


@pytest.fixture(scope="module")
def v3_user() -> search.Found:
    return found(Request(preset="gb200-nvl72", model="deepseek-v3", nodes=64, ep=32, sets=USER_SETS))


def test_the_best_job_fits(v3):
    best = v3.ranked[0]
    assert best.total_bytes <= best.usable_bytes


def test_the_submitted_job_fits_by_the_memory_verdict():
    assert decide(V3_64).memory.verdict.fits


def test_the_memory_of_the_ranked_job_is_the_submitted_jobs(v3):
    assert decide(V3_64).memory.verdict.total_bytes == v3.ranked[0].total_bytes


def test_ranking_is_by_predicted_step_time(v3):
    steps = [c.step.step_s for c in v3.ranked]
    assert len(steps) >= 3 and steps == sorted(steps)


def test_the_best_job_is_no_slower_than_the_presets(v3):
    assert v3.base_fits and v3.ranked[0].step.step_s <= v3.base_step_s


def test_user_set_keys_are_never_changed(v3_user):
    kept = {(c.settings.ep, c.settings.remat, c.settings.dispatch, c.settings.chunks) for c in v3_user.ranked}
    assert kept == {(32, "full", "activation", 2)}


def test_user_set_keys_are_not_among_the_changes(v3_user):
    keys = {item.split("=")[0] for c in v3_user.ranked for item in c.changes}
    assert not keys & {"parallel.ep", "train.remat", "moe.dispatch_dtype", "moe.overlap_chunks"}


def test_user_set_keys_are_named_as_the_users():
    req = Request(preset="gb200-nvl72", model="deepseek-v3", nodes=64, ep=32, sets=USER_SETS)
    sources = {c.key: c.source for c in decide(req).choices}
    assert all(sources[k.split("=")[0]] == choices.USER for k in (*USER_SETS, "parallel.ep=32"))


@pytest.mark.parametrize("req", [V3_64, V3_H100], ids=["gb200", "h100"])
def test_the_chosen_job_is_chosen_again_from_its_own_items(req):
    # make submit's compile preflight builds the job again from the items it carries
    first = decide(req)
    again = decide(
        Request(preset=req.preset, model=req.model, nodes=req.nodes, ep=first.ep, sets=first.req.sets)
    )
    assert again.req.sets == first.req.sets and again.cfg == first.cfg


def test_an_open_ep_is_searched():
    assert {c.settings.ep for c in found(V3_H100).ranked} != {64}


def test_cut_buckets_only_where_nothing_fits_with_the_presets(v3):
    assert all(c.settings.buckets == v3.base.buckets for c in v3.ranked)


def test_cut_buckets_make_a_job_fit_that_otherwise_does_not():
    # 5 sequences per micro-batch: nothing fits with buckets up to 4x; cut at 2x, one does
    req = dataclasses.replace(V3_64, sets=("train.micro_batch_size=5", "train.remat=full"))
    best = found(req, top=1).ranked[0]
    assert best.settings.buckets[-1] < 4 and best.total_bytes <= best.usable_bytes


def test_remat_and_fp8_dispatch_stay_the_presets_unless_set(v3):
    assert all(
        (c.settings.remat, c.settings.dispatch) == (v3.base.remat, v3.base.dispatch) for c in v3.ranked
    )


def test_a_faster_opt_in_job_is_named_not_taken(v3):
    assert v3.opt_in is not None and v3.opt_in.step.step_s < v3.ranked[0].step.step_s
    assert "moe.dispatch_dtype=fp8" in v3.opt_in.changes
    assert "opting in" in str(choices.summary(v3))


def test_nothing_is_searched_without_a_prediction():
    assert searched(Request(preset="cpu-local", model="tiny", nodes=1, ep=8)) is None


def test_the_gb200_deepseek_plan_takes_under_half_the_presets_step(v3):
    """The model preset's own job (1-sequence micro-batches re-gathering the weights, one
    overlap chunk) is predicted at 291 s on 64 racks; the searched one at 77 s."""
    d = decide(V3_64)
    step = choices.prediction(d.req, d.cfg).step
    assert step is not None and d.fits and step.step_s < 0.5 * v3.base_step_s


def _exhaustive_best(req: Request) -> float:
    """The shortest predicted step of every job of ``req``'s open keys that fits, each built
    with config.build and judged by the memory planner (no search, no cache)."""
    cluster = presets.load(req.preset)
    assert req.ep is not None  # the request names its EP size: the search leaves it
    best = float("inf")
    for gather, size, chunks in itertools.product(("micro_batch", "step"), (1, 2, 4, 8), (1, 2, 4, 8)):
        sets = (
            *req.sets,
            f"parallel.weight_gather={gather}",
            f"train.micro_batch_size={size}",
            f"moe.overlap_chunks={chunks}",
        )
        cfg = config.build(req.model, [*sets, f"parallel.ep={req.ep}"])
        v = memory.plan(cfg, cluster, req.nodes, search=False).verdict
        if v.total_bytes <= (1 - search.HEADROOM) * v.usable_bytes:
            step = topo_plan.make_plan(req.preset, req.nodes, req.model, req.ep, overrides=sets).step
            assert step is not None
            best = min(best, step.step_s)
    return best


def test_the_search_finds_the_exhaustive_best_within_its_chunk_rule():
    # overlap chunks are the fewest within 1% of the shortest step (StepTime.best_chunks)
    best = found(MIXTRAL, top=1).ranked[0].step.step_s
    exhaustive = _exhaustive_best(MIXTRAL)
    assert exhaustive <= best <= 1.01 * exhaustive


@pytest.mark.parametrize(
    "model,preset,nodes,ep,remat",
    [("deepseek-v3", "gb200-nvl72", 64, 64, "full"), ("mixtral-8x7b", "h100-dgx", 8, 8, "none")],
)
def test_memory_shrinks_with_more_micro_batches_from_two_on(model, preset, nodes, ep, remat):
    # the search's pruning (search._fit) rests on this
    base = [f"parallel.ep={ep}", f"train.remat={remat}"]
    per = config.build(model, base).train.batch_size // (nodes * presets.load(preset).gpus_per_node)
    totals = []
    for n in (n for n in range(2, per + 1) if per % n == 0):
        cfg = config.build(model, [*base, f"train.micro_batch_size={per // n}"])
        totals.append(memory.plan(cfg, preset, nodes, search=False).estimate.per_device["total"])
    assert len(totals) > 2 and totals == sorted(totals, reverse=True)


def _show(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = show.main(argv)
    return code, out.getvalue()


# 128 nodes: more than five jobs fit (on 64, four fit the 90% of the memory the search fills)
TOP_ARGS = ["--preset", "gb200-nvl72", "--model", "deepseek-v3", "--nodes", "128", "--ep", "64"]


@pytest.mark.parametrize("n", [1, 5])
def test_top_n_lists_n_rows(n):
    code, out = _show([*TOP_ARGS, "--top", str(n)])
    rows = [ln for ln in out.splitlines() if re.match(r"\s+\d+\s+\d+\.\d+\s", ln)]
    assert code == 0 and len(rows) == n


def test_the_top_rows_first_is_the_job_make_plan_shows():
    out = _show([*TOP_ARGS, "--top", "3"])[1]
    first = next(ln for ln in out.splitlines() if re.match(r"\s+1\s+\d", ln))
    plan = _show(TOP_ARGS)[1]
    trainer = next(ln for ln in plan.splitlines() if "python -m moe_train" in ln)
    assert all(f"--set {item}" in trainer for item in first.split() if "=" in item)


def test_top_starts_with_the_memory_verdict():
    assert _show([*TOP_ARGS, "--top", "2"])[1].startswith("memory: fits")


def test_a_negative_top_is_refused():
    assert _show([*TOP_ARGS, "--top", "-1"])[0] == 2
