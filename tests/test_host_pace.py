"""The rule that stops merging for a run where the host, not the GPU, sets the pace (nodes/runtime/pace.py).

On the CPU there are no device events: a stand-in event is put where the runtime makes them
(``runtime.pace.events``), and its ``query()`` and ``elapsed_time`` answer as each test says: the GPU caught up
with the host (host-bound) or still busy (GPU-bound). A tiny SD1.5-layout UNet is sampled through ComfyUI's own
sampler, CFG batched: one model call a step.
"""
import logging

import pytest
import torch

from test_syncs import check_bound, watched_run
from toma_bench import models, sampling

pytestmark = pytest.mark.comfy

LOGGER = "ComfyUI-ToMA"
UNET_TINY = dict(models.SD15_SMALL, model_channels=32, num_heads=2)
STEPS = 6
TOMA = {"ratio": 0.5, "window_size": 4, "reuse_interval": 5}


class StandInEvent:
    """A device event as the rule uses one. ``reached``: what ``query()`` answers; ``gpu_ms``: the GPU's span
    from this (start) event to an end event. Waiting for it is an error, as is reading a span before both
    events answered that they were reached: either would make the host wait for the device."""

    def __init__(self, made: list, reached: bool, gpu_ms: float):
        self.reached, self.gpu_ms = reached, gpu_ms
        self.recorded = self.queried = False
        made.append(self)

    def record(self):
        self.recorded = True

    def query(self) -> bool:
        assert self.recorded
        self.queried = True
        return self.reached

    def elapsed_time(self, end) -> float:
        assert end.queried and end.reached, "elapsed_time read before the end event was reached: a wait"
        return self.gpu_ms

    def synchronize(self):
        raise AssertionError("the host-pace rule waited for the device")

    wait = synchronize


class StandIn:
    """The runtime's event factory: every event it makes answers ``reached`` and ``gpu_ms``."""

    def __init__(self, reached=True, gpu_ms=0.0):
        self.reached, self.gpu_ms = reached, gpu_ms
        self.made: list[StandInEvent] = []

    def __call__(self, device):
        return StandInEvent(self.made, self.reached, self.gpu_ms)


HOST_BOUND = dict(reached=True, gpu_ms=0.0)  # the GPU's span is nothing next to the host's: it waited
GPU_STILL_BUSY = dict(reached=False)  # the call's end not reached when the next call starts
GPU_LONGER = dict(reached=True, gpu_ms=1e6)  # reached, but the GPU ran far longer than the host issued


@pytest.fixture(scope="module")
def unet():
    return models.build_unet("sd15", 0, config=UNET_TINY)


def toma(pack, model, node="ToMAPatchModel", **inputs):
    (patched,) = pack.nodes.NODE_CLASS_MAPPINGS[node]().patch(model, **(inputs or TOMA))
    return patched


def sample(model, steps=STEPS):
    conditioning = models.conditioning("sd15", 1, height=128, width=128)
    noise = sampling.seeded_noise((1, 4, 16, 16), 0)
    return sampling.sample(model, conditioning, torch.zeros(1, 4, 16, 16), steps=steps, cfg=2.0, noise=noise)


def merged_steps(runtime) -> set:
    return set().union(*(stats.steps for stats in runtime.report().levels.values()))


def paced_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno >= logging.WARNING and "the host sets the pace" in r.getMessage()]


def test_host_bound_runs_stop_merging_after_the_deciding_calls_said_once(pack, unet, caplog):
    patched = toma(pack, unet)
    runtime = pack.nodes.runtime.runtime_of(patched)
    stand_in = runtime.pace.events = StandIn(**HOST_BOUND)
    deciding = runtime.pace.deciding_calls
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            stand_in.made.clear()
            sample(patched)
            # the first merged calls merge and are judged (a start and an end event each), the rest run unmerged
            assert merged_steps(runtime) == set(range(deciding))
            assert len(stand_in.made) == 2 * deciding and all(e.recorded for e in stand_in.made)
            paced = {"reason": "the host sets the pace", "after_calls": deciding, "unmerged_calls": STEPS - deciding}
            assert runtime.report().host_paced == paced and runtime.summary()["host_paced"] == paced
            assert (f"ran unmerged: the host sets the pace (merging stopped after {deciding} model calls; "
                    f"{STEPS - deciding} model calls unmerged)") in pack.nodes.live_stats.stats_lines(runtime.summary())
    said = paced_warnings(caplog)
    assert len(said) == 1 and "TOMA_HOST_PACE=off" in said[0], said  # once, though both runs stopped


@pytest.mark.parametrize("gpu", [GPU_STILL_BUSY, GPU_LONGER], ids=["end-not-reached", "gpu-span-longer"])
def test_gpu_bound_runs_keep_merging(pack, unet, gpu, caplog):
    patched = toma(pack, unet)
    runtime = pack.nodes.runtime.runtime_of(patched)
    stand_in = runtime.pace.events = StandIn(**gpu)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sample(patched)
    assert merged_steps(runtime) == set(range(STEPS))
    assert runtime.report().host_paced is None and runtime.summary()["host_paced"] is None
    assert runtime.pace.verdicts == [False] * runtime.pace.deciding_calls
    assert len(stand_in.made) == 2 * runtime.pace.deciding_calls  # nothing recorded once decided
    assert not paced_warnings(caplog)
    assert not any("host sets the pace" in line for line in pack.nodes.live_stats.stats_lines(runtime.summary()))


def test_every_run_decides_anew(pack, unet):
    patched = toma(pack, unet)
    runtime = pack.nodes.runtime.runtime_of(patched)
    stand_in = runtime.pace.events = StandIn(**HOST_BOUND)
    sample(patched)
    assert runtime.report().host_paced is not None
    stand_in.reached = False  # the next run's GPU sets the pace: it merges every step again
    sample(patched)
    assert merged_steps(runtime) == set(range(STEPS)) and runtime.report().host_paced is None
    stand_in.reached = True
    sample(patched)
    assert merged_steps(runtime) == set(range(runtime.pace.deciding_calls))


def test_one_gpu_bound_call_among_the_deciding_ones_keeps_merging(pack, unet):
    patched = toma(pack, unet)
    runtime = pack.nodes.runtime.runtime_of(patched)
    runtime.pace.events = StandIn(**HOST_BOUND)
    verdicts = [True] * (runtime.pace.deciding_calls - 1) + [False]
    answers = iter(verdicts)  # the last deciding call's end not reached when the next call began

    def query(event):
        event.queried = True
        return next(answers)

    stand_in_query = StandInEvent.query
    StandInEvent.query = query
    try:
        sample(patched)
    finally:
        StandInEvent.query = stand_in_query
    assert runtime.pace.verdicts == verdicts
    assert merged_steps(runtime) == set(range(STEPS)) and runtime.report().host_paced is None


def test_the_rule_reads_nothing_back_in_a_model_call(pack, unet):
    patched = toma(pack, unet)
    runtime = pack.nodes.runtime.runtime_of(patched)
    runtime.pace.events = StandIn(**HOST_BOUND)
    counter = watched_run(patched, sample)
    assert runtime.report().host_paced is not None, "the rule did not stop: the count would prove less"
    check_bound(counter)


def test_compiled_calls_and_devices_without_events_are_not_judged(pack, unet):
    patched = toma(pack, unet)
    runtime = pack.nodes.runtime.runtime_of(patched)
    # on the CPU the runtime makes no event: nothing judged, merging on
    assert runtime.pace.events(torch.device("cpu")) is None and runtime.pace.events(torch.device("meta")) is None
    sample(patched)
    assert runtime.pace.verdicts == [] and merged_steps(runtime) == set(range(STEPS))
    # a call whose diffusion model runs under torch.compile: its host span includes tracing (pace.py says why)
    stand_in = runtime.pace.events = StandIn(**HOST_BOUND)
    runtime.begin_run()
    where = pack.nodes.runtime.steps.Where(0, 0.0, STEPS)
    level = pack.nodes.runtime.unet_level(4, 4, 1)
    for _ in range(2 * runtime.pace.deciding_calls):
        call = runtime.call_at(where, torch.device("cpu"), 2, (0, 1))
        call.compiled = True
        runtime.run_call(call, lambda: call.merged.setdefault(level, 8))  # a call that merged
    assert not stand_in.made and runtime.pace.verdicts == []


def test_only_toma_has_the_rule_and_the_environment_turns_it_off(pack, unet, monkeypatch):
    assert pack.nodes.runtime.runtime_of(toma(pack, unet)).pace is not None
    tomesd = toma(pack, unet, "ToMeSDPatchModel", ratio=0.5, max_downsample=1)
    assert pack.nodes.runtime.runtime_of(tomesd).pace is None  # the baselines run as published
    monkeypatch.setenv("TOMA_HOST_PACE", "off")
    assert pack.nodes.runtime.runtime_of(toma(pack, unet)).pace is None
    monkeypatch.setenv("TOMA_HOST_PACE", "maybe")
    with pytest.raises(ValueError, match="TOMA_HOST_PACE must be 'on' or 'off'.*'maybe'"):
        toma(pack, unet)


def test_ratio_zero_is_untouched(pack, unet):
    patched = toma(pack, unet, ratio=0.0, window_size=4, reuse_interval=5)
    with pytest.raises(ValueError):
        pack.nodes.runtime.runtime_of(patched)  # no runtime, so no rule and no event
    assert torch.equal(sample(patched, steps=2), sample(unet, steps=2))
