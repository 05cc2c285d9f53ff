"""DiTo, after arXiv 2605.22011 (toma_core/dito.py): its plans, schedule and penalty on their own, then the node
on tiny Flux and SD3 models sampled through ComfyUI's sampler."""
import logging

import pytest
import torch

from toma_bench import comfy_host, models, sampling
from toma_bench.metrics import relative_l2
from toma_core import DiTo, DiToPlan, MatchingPlan, MatchingSchedule, interval_from_pmr, pair_match_ratio
from toma_core.dito import MATCHED, REDUCING, dito_plan, match_outputs

HW = (6, 8)
N = HW[0] * HW[1]


def seed(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64)


def outputs(batch=2, channels=16, value=0):
    return torch.randn(batch, N, channels, generator=torch.Generator().manual_seed(value))


def matched(ratio=0.5, penalty=0.5, out=None, given=None, cells=1):
    """A matching plan built and shown ``out`` (its block's update), as at a matching step."""
    out = outputs() if out is None else out
    plan = dito_plan(out, HW, ratio, penalty, given=given, seed=seed(cells))
    assert isinstance(plan, MatchingPlan)
    plan.unmerge_update(torch.zeros_like(out), torch.zeros_like(out), out)
    return plan


# -- the plans ----------------------------------------------------------------------------------------
def test_matching_step_runs_unmerged_bit_for_bit():
    x, y = outputs(value=1), outputs(value=2)
    plan = dito_plan(x, HW, 0.5, 0.5, seed=seed(0))
    assert plan.merge(x) is x and plan.num_merged == N
    assert torch.equal(plan.unmerge_update(x, x, y), y)  # the block's output itself, not x + (y - x)
    assert plan.unmerge(y) is y
    assert torch.equal(plan.destination_tokens(), torch.arange(N).expand(2, -1))


def test_reduction_plan_shapes_positions_and_mass():
    x = outputs(value=3)
    plan = dito_plan(x, HW, 0.5, 0.5, given=matched().destinations)
    assert isinstance(plan, DiToPlan)
    r = int(N * 0.5)
    merged = plan.merge(x)
    assert merged.shape == (2, N - r, 16) and plan.num_merged == N - r
    assert plan.unmerge(merged).shape == x.shape
    assert plan.unmerge_update(x, merged, merged).shape == x.shape
    positions = plan.destination_tokens()
    assert positions.shape == (2, N - r)
    # every merged token sits at a token of its own: no two share a position, none is a merged-away source
    assert all(row.unique().numel() == N - r for row in positions)
    assert plan.log_mass.shape == (2, N - r)
    assert torch.allclose(plan.log_mass.exp().sum(1), torch.full((2,), float(N)))


def test_nothing_merged_reproduces_every_token():
    """At r = 0 every token stays (kept sources and destinations): unmerge(merge(x)) is x bit for bit."""
    x = outputs(value=4)
    plan = matched(ratio=0.0).state.plan
    assert plan.num_merged == N
    assert torch.equal(plan.unmerge(plan.merge(x)), x)


def test_matching_follows_the_outputs_not_the_inputs():
    """Two tokens whose outputs are equal are the first pair merged, whatever the block's input was."""
    out = outputs(value=5)
    probe = dito_plan(out, HW, 0.5, 0.0, seed=seed(1))
    src, dst = probe.src_index[0], probe.dst_index[0]
    out[:, src[7]] = out[:, dst[3]]
    plan = match_outputs(out, probe.src_index, probe.dst_index, 1, torch.zeros(2, N), 0.0)[0]
    assert (plan.merged[:, 0] == 7).all() and (plan.target[:, 0] == 3).all()
    assert plan.unmerge(plan.merge(out))[:, src[7]].allclose(out[:, dst[3]])


def test_no_output_seen_is_a_clear_error():
    plan = dito_plan(outputs(), HW, 0.5, 0.5, seed=seed(0))
    with pytest.raises(ValueError, match="saw no output"):
        dito_plan(outputs(), HW, 0.5, 0.5, given=plan.destinations)


def test_runs_on_the_meta_device():
    """Every size comes from the shapes: a whole matching and reduction on the meta device, where no value
    can be read back (a host sync would fail there)."""
    out = outputs().to("meta")
    plan = dito_plan(out, HW, 0.5, 0.5, seed=seed(0).to("meta"))
    plan.unmerge(out)
    reduced = dito_plan(out, HW, 0.5, 0.5, given=plan.destinations)
    assert reduced.unmerge(reduced.merge(out)).shape == out.shape and reduced.destination_tokens().is_meta


# -- the schedule: correspondences set at matching steps, reused over the reduction steps -----------------
def test_schedule_matches_every_interval_and_reuses_in_between():
    schedule = MatchingSchedule(interval=3)
    decisions = [schedule.decide(step, step / 8, "key", 8) for step in range(8)]
    assert [(d.merge, d.new_destinations, d.new_weights) for d in decisions] == [
        (True, True, True),  # the key's first matching: nothing carried
        (True, False, True),  # the reduction plan from the matching
        (True, False, False), (True, False, True), (True, False, True), (True, False, False),
        (True, False, True), (True, False, True)]
    again = schedule.decide(6, 6 / 8, "key", 8)  # a second model call of step 6: reuse
    assert (again.new_destinations, again.new_weights) == (False, False)
    schedule.reset()
    assert schedule.decide(5, 5 / 8, "key", 8).new_destinations


def test_state_flows_from_matching_to_reduction_and_back():
    first = matched(cells=1)
    reduced = dito_plan(outputs(), HW, 0.5, 0.5, given=first.destinations)
    assert reduced is first.state.plan and first.state.phase == MATCHED
    assert reduced.destinations.phase == REDUCING
    again = dito_plan(outputs(), HW, 0.5, 0.5, given=reduced.destinations, seed=seed(2))
    assert isinstance(again, MatchingPlan)
    assert torch.equal(again.counts, reduced.state.counts) and again.counts.sum() == 2 * int(N * 0.5)


@pytest.mark.parametrize("bad", [{"interval": 1}, {"interval": 2.5}, {"start_percent": 1.5}])
def test_schedule_refuses_bad_settings(bad):
    with pytest.raises(ValueError):
        MatchingSchedule(**bad)


# -- the selection-frequency penalty ------------------------------------------------------------------
def reselection(penalty: float, rounds: int = 6) -> float:
    """Mean share of the sources merged at one matching that the next merges again, the outputs and the cells
    the same every time (the case reuse makes worst)."""
    out, given, merged, shares = outputs(value=9), None, None, []
    for _ in range(rounds):
        plan = matched(ratio=0.25, penalty=penalty, out=out, given=given, cells=3)
        sources = set(plan.src_index[0][plan.state.plan.merged[0]].tolist())
        if merged is not None:
            shares.append(len(sources & merged) / len(sources))
        merged, given = sources, plan.state.plan.destinations
    return sum(shares) / len(shares)


def test_penalty_lowers_reselection():
    assert reselection(0.0) == 1.0  # without it, the same tokens are merged at every matching
    assert reselection(0.5) < 0.5


def test_penalty_counts_reset_with_the_run():
    """A key's first plan of a run (given None) starts from zero counts."""
    assert dito_plan(outputs(), HW, 0.5, 0.5, seed=seed(0)).counts.sum() == 0


# -- Pair Match Ratio --------------------------------------------------------------------------------
def test_pair_match_ratio():
    a = matched(penalty=0.0, cells=4).state.plan
    assert torch.equal(pair_match_ratio(a, a), torch.ones(2))
    b = matched(penalty=0.0, out=outputs(value=11), cells=4).state.plan
    assert (pair_match_ratio(a, b) < 1).all()
    with pytest.raises(ValueError, match="same cells"):
        pair_match_ratio(a, matched(cells=5).state.plan)
    assert interval_from_pmr([0.9, 0.8, 0.6, 0.9], 0.7) == 3
    assert interval_from_pmr([0.5], 0.7) == 2


def test_strategy_says_when_nothing_merges():
    assert DiTo(0.5).merges_nothing((1, 8)) and DiTo(0.5).merges_nothing((8, 8)) is None
    assert DiTo(0.5).merges_nothing((2, 2, 8)) is None  # a video grid: frames * h rows


# -- the node on tiny DiTs ------------------------------------------------------------------------------
node_tests = pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)
CONFIGS = {"flux": models.FLUX_TINY, "sd3": models.SD3_TINY}


@pytest.fixture(scope="module")
def built(pack):
    return {"flux": models.build_flux(seed=1), "sd3": models.build_sd3(seed=2)}


def sample(model, arch="flux", hw=(24, 24), steps=6, batch=2):
    conditioning = models.dit_conditioning(arch, CONFIGS[arch], batch, 77, 0, None)
    return sampling.sample(model, conditioning, torch.zeros(batch, 16, *hw), steps=steps, cfg=1.0,
                           scheduler="simple", seed=0)


def dito(pack, model, ratio=0.5, interval=3, penalty=0.5):
    (patched,) = pack.nodes.NODE_CLASS_MAPPINGS["DiToPatchModel"]().patch(model, ratio, interval, penalty)
    return patched, pack.nodes.runtime.runtime_of(patched)


@node_tests
@pytest.mark.comfy
@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_node_changes_the_output_at_half_and_not_at_zero(pack, built, arch):
    model = built[arch]
    reference = sample(model, arch)
    (off,) = pack.nodes.NODE_CLASS_MAPPINGS["DiToPatchModel"]().patch(model, 0.0, 3, 0.5)
    assert torch.equal(sample(off, arch), reference)
    patched, runtime = dito(pack, model)
    out = sample(patched, arch)
    assert torch.isfinite(out).all() and 0.0 < relative_l2(out, reference) < 0.2
    levels = runtime.summary()["levels"]
    assert levels and all(v["tokens"] == 144 and v["merged_tokens"] == 72 for v in levels.values())


@node_tests
@pytest.mark.comfy
def test_matching_steps_rebuild_and_reduction_steps_reuse(pack, built):
    """Interval 3 over 6 steps: matching (unmerged) plans at steps 0 and 3, reduction plans built at 1 and 4
    and reused at 2 and 5; a reduction plan merges by the matching of the step before it."""
    patched, runtime = dito(pack, built["flux"])
    built_plans = []
    strategy = runtime.strategy
    original = type(strategy).build

    def spy(self, features, grid, generator=None, destinations=None, seed=None):
        plan = original(self, features, grid, generator, destinations, seed)
        built_plans.append((runtime._call.where.step, type(plan).__name__, destinations, plan))
        return plan

    type(strategy).build = spy
    try:
        sample(patched)
    finally:
        type(strategy).build = original
    report = runtime.report()
    for level, stats in report.levels.items():
        assert [(r.step, type(r.plan).__name__) for r in stats.records] == [
            (0, "MatchingPlan"), (1, "DiToPlan"), (3, "MatchingPlan"), (4, "DiToPlan")], level
    kinds = {step: {kind for s, kind, _, _ in built_plans if s == step} for step in range(6)}
    assert kinds == {0: {"MatchingPlan"}, 1: {"DiToPlan"}, 2: set(), 3: {"MatchingPlan"}, 4: {"DiToPlan"}, 5: set()}
    for _, kind, given, plan in built_plans:
        if kind == "DiToPlan":
            assert given.phase == MATCHED and given.plan is plan


@node_tests
@pytest.mark.comfy
def test_no_state_leaks_between_runs(pack, built):
    patched, runtime = dito(pack, built["flux"])
    first = sample(patched)
    sample(patched, hw=(16, 20), batch=1)
    assert torch.equal(sample(patched), first)
    assert all(plan.destinations.counts.sum() <= 2 * 2 * 72 for plan in runtime.report().plans.values())


@node_tests
@pytest.mark.comfy
@pytest.mark.parametrize("inputs, words", [
    ({"ratio": 0.8}, ["ratio", "0.0", "0.75"]),
    ({"ratio": 0.5, "matching_interval": 1}, ["matching_interval", "2", "50"]),
    ({"ratio": 0.5, "matching_interval": 2.5}, ["matching_interval", "integer"]),
    ({"ratio": 0.5, "penalty": -0.1}, ["penalty", "0.0", "4.0"]),
    ({"ratio": 0.5, "seed": -1}, ["seed", "0"]),
])
def test_bad_inputs_name_the_input_and_range(pack, built, inputs, words):
    with pytest.raises(ValueError) as error:
        pack.nodes.NODE_CLASS_MAPPINGS["DiToPatchModel"]().patch(built["flux"], **inputs)
    assert all(w in str(error.value) for w in words), str(error.value)


@pytest.mark.comfy
def test_a_unet_comes_back_unpatched_with_a_message(pack, caplog):
    unet = models.build_unet("sd15", seed=0, config=dict(models.SD15_SMALL, model_channels=32, num_heads=4))
    with caplog.at_level(logging.WARNING, logger="ComfyUI-ToMA"):
        (out,) = pack.nodes.NODE_CLASS_MAPPINGS["DiToPatchModel"]().patch(unet, 0.5)
    assert out is unet
    assert "DiTo is for DiTs" in caplog.text and "unpatched" in caplog.text


@node_tests
@pytest.mark.comfy
def test_compiles_without_a_graph_break(pack, built):
    """Under torch.compile (eager backend) the matching in the block call and the reuse trace: no graph
    break, at most one graph per merge path (a key's first call, a matching after a reduction plan, a
    reduction), none in a second run, and the eager output."""
    from toma_bench import compiling

    (patched,) = pack.nodes.NODE_CLASS_MAPPINGS["DiToPatchModel"]().patch(built["flux"], 0.5, 2, 0.5)
    run = lambda m: sample(m, hw=(16, 16), steps=4, batch=1)  # noqa: E731
    with compiling.constant_free_memory():
        eager = run(patched)
        model = compiling.compiled(patched, backend="eager")
        with compiling.counting() as first:
            out = run(model)
        with compiling.counting(fresh=False) as second:
            again = run(model)
    assert first.clean() and first.graphs <= 3, str(first)
    assert second.graphs == 0 and second.clean(), str(second)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, out)
