"""Merge window, pattern reuse and the sigma-based step clock."""
import math

import pytest

from toma_core import CAToMe, ReuseSchedule, RunClock, ShortRun, StepDecision, ToMA, ToMeSD, step_from_sigmas


def karras(n: int, sigma_min: float = 0.0292, sigma_max: float = 14.6146, rho: float = 7.0) -> list[float]:
    """Karras et al. (2022) schedule of n steps plus the final 0, as k-diffusion / ComfyUI build it."""
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return [(hi + i / (n - 1) * (lo - hi)) ** rho for i in range(n)] + [0.0]


def expected(step: int, total: int, start: float, end: float, reuse: int, weights: int, first: int):
    """The rule, stated per step: merge inside [start, end) of the run; counting from the first merged
    step, new destinations every `reuse` steps and new weights every `weights` steps within each
    destination period (a new destination set always comes with new weights)."""
    progress = step / total
    if not (start <= progress < end or (end >= 1.0 and progress >= start)):
        return StepDecision(False, False, False)
    offset = (step - first) % reuse
    return StepDecision(True, offset == 0, offset % weights == 0)


@pytest.mark.parametrize("total", [20, 50])
@pytest.mark.parametrize("reuse,weights", [(5, 2), (3, 1), (1, 1), (4, 4), (7, 3)])
def test_reuse_decisions_follow_the_rule(total, reuse, weights):
    start, end = 0.1, 0.9
    sched = ReuseSchedule(start_percent=start, end_percent=end, reuse_interval=reuse, weights_interval=weights)
    merged = [s for s in range(total) if start <= s / total < end]
    assert merged == list(range(math.ceil(start * total), math.ceil(end * total)))  # a contiguous window
    got = [sched.decide(s, s / total, "g") for s in range(total)]
    want = [expected(s, total, start, end, reuse, weights, merged[0]) for s in range(total)]
    assert got == want
    # and in counts: one destination set per `reuse` merged steps, rounded up
    assert sum(d.new_destinations for d in got) == -(-len(merged) // reuse)
    assert all(d.new_weights for d in got if d.new_destinations)


def test_reuse_decisions_spelled_out_for_20_steps():
    sched = ReuseSchedule(start_percent=0.1, end_percent=0.9, reuse_interval=5, weights_interval=2)
    got = [sched.decide(s, s / 20, 0) for s in range(20)]
    merge = [s for s, d in enumerate(got) if d.merge]
    dst = [s for s, d in enumerate(got) if d.new_destinations]
    wts = [s for s, d in enumerate(got) if d.new_weights]
    # 0.1 * 20 = 2 and 0.9 * 20 = 18: steps 2..17 merge; destinations at 2, 7, 12, 17
    assert merge == list(range(2, 18))
    assert dst == list(range(2, 18, 5))
    # weights at offsets 0, 2, 4 of each 5-step destination period
    assert wts == [d + o for d in dst for o in (0, 2, 4) if d + o < 18]


def test_end_percent_one_keeps_merging_to_the_last_step():
    sched = ReuseSchedule(start_percent=0.5, end_percent=1.0, reuse_interval=2)
    got = [sched.decide(s, s / 10, "g").merge for s in range(10)]
    assert got == [s >= 5 for s in range(10)]
    assert sched.in_window(1.0)


def test_groups_are_independent_and_later_blocks_reuse():
    sched = ReuseSchedule(start_percent=0.0, end_percent=1.0, reuse_interval=3, weights_interval=2)
    a, b = [], []
    for step in range(12):
        a.append(sched.decide(step, step / 12, ("level", 0)))
        # the second block of group a in the same step reuses what the first one computed
        assert sched.decide(step, step / 12, ("level", 0)) == StepDecision(True, False, False)
        if step >= 4:  # group b first seen at step 4
            b.append(sched.decide(step, step / 12, ("level", 1)))
    assert [s for s, d in enumerate(a) if d.new_destinations] == [0, 3, 6, 9]
    assert [s + 4 for s, d in enumerate(b) if d.new_destinations] == [4, 7, 10]
    assert [s for s, d in enumerate(a) if d.new_weights] == [0, 2, 3, 5, 6, 8, 9, 11]
    assert [s + 4 for s, d in enumerate(b) if d.new_weights] == [4, 6, 7, 9, 10]


def test_reset_and_step_going_back_recompute():
    sched = ReuseSchedule(reuse_interval=10, weights_interval=10)
    assert sched.decide(0, 0.0, "g") == StepDecision(True, True, True)
    assert sched.decide(1, 0.05, "g") == StepDecision(True, False, False)
    sched.reset()
    assert sched.decide(2, 0.1, "g") == StepDecision(True, True, True)
    assert sched.decide(3, 0.15, "g") == StepDecision(True, False, False)
    # a new run that was not announced by reset(): the step index goes back
    assert sched.decide(0, 0.0, "g") == StepDecision(True, True, True)


@pytest.mark.parametrize("every,start,end,merged", [
    (1, 0.0, 1.0, list(range(10))),
    (2, 0.0, 1.0, [0, 2, 4, 6, 8]),
    (3, 0.0, 1.0, [0, 3, 6, 9]),
    (1, 0.2, 0.7, [2, 3, 4, 5, 6]),
    (2, 0.1, 0.8, [2, 4, 6]),  # counted from step 0, not from the window's first step
    (3, 0.2, 1.0, [3, 6, 9]),
])
def test_merge_every_kth_step_inside_the_window(every, start, end, merged):
    sched = ReuseSchedule(start_percent=start, end_percent=end, reuse_interval=1, merge_every=every)
    got = [sched.decide(s, s / 10, "g") for s in range(10)]
    assert [s for s, d in enumerate(got) if d.merge] == merged
    assert all(d == StepDecision(False, False, False) for d in got if not d.merge)


def test_merge_every_keeps_counting_reuse_in_steps():
    # destinations are reused for reuse_interval steps, skipped steps included: with merge every 3rd
    # step and reuse 5, step 3 reuses step 0's destinations and step 6 chooses new ones
    sched = ReuseSchedule(reuse_interval=5, weights_interval=5, merge_every=3)
    got = {s: sched.decide(s, s / 12, "g") for s in range(12)}
    assert [s for s, d in got.items() if d.merge] == [0, 3, 6, 9]
    assert [s for s, d in got.items() if d.new_destinations] == [0, 6]
    assert got[3] == got[9] == StepDecision(True, False, False)


def decisions(sched: ReuseSchedule, total: int | None, steps: int) -> list[StepDecision]:
    sched.reset()
    return [sched.decide(s, s / steps, "g", total) for s in range(steps)]


def test_a_short_run_follows_the_short_run_settings():
    """From 40%, one step in 2, destinations reused 5 steps; in runs of at most 8 steps: every step from
    the first, a new plan every step."""
    short = ShortRun(8, start_percent=0.0, merge_every=1, reuse_interval=1)
    sched = ReuseSchedule(start_percent=0.4, reuse_interval=5, merge_every=2, short_run=short)
    for total in (4, 8):
        assert decisions(sched, total, total) == [StepDecision(True, True, True)] * total
    plain = ReuseSchedule(start_percent=0.4, reuse_interval=5, merge_every=2)
    for total, steps in ((9, 9), (20, 20), (None, 4)):  # longer runs, and runs of unknown length, keep theirs
        assert decisions(sched, total, steps) == decisions(plain, total, steps)
    assert [s for s, d in enumerate(decisions(sched, 9, 9)) if d.merge] == [4, 6, 8]


def test_a_short_run_keeps_what_it_does_not_name():
    sched = ReuseSchedule(start_percent=0.25, reuse_interval=5, weights_interval=1,
                          short_run=ShortRun(8, reuse_interval=2))
    got = decisions(sched, 8, 8)
    assert [s for s, d in enumerate(got) if d.merge] == [2, 3, 4, 5, 6, 7]  # from 25%, as in longer runs
    assert [s for s, d in enumerate(got) if d.new_destinations] == [2, 4, 6]
    assert all(d.new_weights for d in got if d.merge)
    assert sched.timing(20).reuse_interval == 5 and sched.timing(8).reuse_interval == 2


def test_short_run_in_words():
    assert ShortRun(8, start_percent=0.0, merge_every=1, reuse_interval=1).in_words() == (
        "from 0% of the schedule, on every step, plans reused for at most 1 step")
    assert ShortRun(8, reuse_interval=2).in_words() == "plans reused for at most 2 steps"


@pytest.mark.parametrize("kwargs,name", [
    ({"steps": 0}, "steps"), ({"start_percent": 1.2}, "start_percent"), ({"merge_every": 0}, "merge_every"),
    ({"reuse_interval": 1.5}, "reuse_interval"),
])
def test_invalid_short_run_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ShortRun(**kwargs)


@pytest.mark.parametrize("kwargs,name", [
    ({"start_percent": -0.1}, "start_percent"),
    ({"start_percent": 1.5}, "start_percent"),
    ({"end_percent": 1.01}, "end_percent"),
    ({"end_percent": -1}, "end_percent"),
    ({"start_percent": 0.8, "end_percent": 0.2}, "start_percent"),
    ({"reuse_interval": 0}, "reuse_interval"),
    ({"reuse_interval": 2.5}, "reuse_interval"),
    ({"weights_interval": 0}, "weights_interval"),
    ({"weights_interval": -3}, "weights_interval"),
    ({"merge_every": 0}, "merge_every"),
    ({"merge_every": 1.5}, "merge_every"),
])
def test_invalid_schedule_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ReuseSchedule(**kwargs)


@pytest.mark.parametrize("steps", [1, 2, 20, 50])
def test_step_from_sigmas_on_a_karras_schedule(steps):
    sched = karras(steps) if steps > 1 else [14.6146, 0.0]
    for i in range(steps):
        s = sched[i]
        assert step_from_sigmas(s, sched) == i
        assert step_from_sigmas(s * (1 + 3e-7), sched) == i  # the sigma as an fp32 tensor rounds it
        assert step_from_sigmas(s * (1 - 3e-7), sched) == i
        nxt = sched[i + 1]
        for mid in ((s + nxt) / 2, math.sqrt(s * nxt) if nxt > 0 else s / 10, s * 0.999):
            assert step_from_sigmas(mid, sched) == i  # a multi-stage solver's intermediate sigma
    assert step_from_sigmas(sched[0] * 1.5, sched) == 0  # above the schedule


def test_run_clock_with_schedule():
    sched = karras(10)
    clock = RunClock()
    clock.begin(sched)
    seen = []
    for i in range(10):
        for _ in range(3):  # cond, uncond and a split batch: several calls at one sigma
            seen.append(clock.step(sched[i]))
        if i < 9:
            seen.append(clock.step(math.sqrt(sched[i] * sched[i + 1])))  # second solver stage
    assert seen[::4] == list(range(10))
    assert all(seen[j] <= seen[j + 1] for j in range(len(seen) - 1))
    assert clock.total == 10


def test_run_clock_never_starts_a_run_on_a_rising_sigma():
    # dpmpp_2s_ancestral: each step evaluates sigma_i, then a point below sigma_down, and the next step's
    # sigma lies above that point; heun evaluates the next step's sigma as its second stage
    sched = karras(6)
    clock = RunClock()
    clock.begin(sched)
    calls = []
    for i in range(6):
        calls.append((sched[i], i))
        low = sched[i + 1] * 0.5 if sched[i + 1] > 0 else sched[i] / 10
        calls.append((math.sqrt(sched[i] * low), i))
    assert [clock.step(s) for s, _ in calls] == [i for _, i in calls]
    clock.begin(sched)  # a new run only when the host says so
    assert clock.step(sched[2]) == 2


def test_run_clock_without_schedule_counts_distinct_sigmas():
    sched = karras(8)
    clock = RunClock()
    clock.begin(None)
    for i in range(8):
        for _ in range(2):
            assert clock.step(sched[i]) == i
    assert clock.total is None
    assert clock.step(sched[0]) == 0  # a sigma seen before keeps its step: no new run
    assert clock.step(sched[3] * 1.01) == 8  # a sigma not seen before in this run is a new step
    clock.begin(None)
    assert clock.step(sched[5]) == 0


@pytest.mark.parametrize("strategy, grid, why", [
    (ToMA(0.5, 1), (8, 8), "window_size 1: each window holds a single token"),
    (ToMA(0.5, 1, temporal_window=1), (3, 8, 8), "window_size 1 and temporal_window 1: each window holds a single"),
    (ToMA(0.5, 1, temporal_window=2), (1, 8, 8), "window_size 1: each window holds a single token"),
    (ToMA(0.5, 4, ReuseSchedule(0.3, 0.3)), (8, 8), "start_percent equals end_percent (0.3)"),
    (ToMA(0.5, 4, ReuseSchedule(1.0, 1.0)), (8, 8), "start_percent equals end_percent (1.0)"),
])
def test_inputs_that_merge_nothing_say_why(strategy, grid, why):
    assert strategy.merges_nothing(grid).startswith(why)


@pytest.mark.parametrize("strategy, grid", [
    (ToMA(0.5, 2), (8, 8)),
    (ToMA(0.5, 1, temporal_window=2), (3, 8, 8)),  # windows of one token over two frames merge
    (ToMA(0.5, 4, ReuseSchedule(0.3, 0.31)), (8, 8)),
    (ToMeSD(0.5), (8, 8)),
    (CAToMe(0.7), (8, 8)),
])
def test_inputs_that_may_merge_give_no_reason(strategy, grid):
    assert strategy.merges_nothing(grid) is None
