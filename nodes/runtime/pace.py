"""Where the host, not the GPU, sets a sampling run's pace, ToMA stops merging for the rest of the run.

Merging saves GPU work and adds kernels (selection, merge, unmerge) that the host has to issue. Where the GPU
waits for the host's kernels, the saved work buys nothing and every added kernel costs host time: merged, the
run is slower than unpatched (SD1.5 at 512 px, eager, on a datacenter host: modelled 0.89x).

The signal (``HostPace``). Around each model call (``MergeRuntime.run_call``, outside the diffusion model that
torch.compile traces) the runtime records an event on the device's current stream before the model runs and
another after it returns, when the host is done issuing the call, and reads the host clock at both. Nothing
waits: a call is judged at the next model call's start, before that call's decisions, by ``query()`` (no sync):
- the call's end event not reached yet: the GPU was still running the call when the host came back to issue
  the next one. The GPU sets the pace.
- reached: the GPU's span from the call's start event to its end event (``elapsed_time``, read only once both
  are reached) against the host's span issuing the call. The GPU reaches the start event as the host records
  it (ComfyUI's sampler leaves the queue empty between calls; where it does not, the previous call's end event
  was not reached, above), so where the GPU finished within ``SLACK`` of the host it spent the call waiting for
  the host's kernels: the host sets the pace. Where it ran longer, it had work queued: the GPU sets it.
Querying the call's start event when the host is done issuing would not tell: an empty queue reaches it at
once, whichever sets the pace.

The rule: where each of the first ``DECIDING_CALLS`` model calls of a run that merged is judged host-bound,
every later call of the run runs unmerged (the schedule's decisions become "no merge"), said once in the log
and in the run's stats (``MergeRuntime.report``: ``host_paced``). Every run decides anew. Only the calls the
host announces are judged (a model call outside ComfyUI's sampler has no end the runtime sees).

Where it stays out, and why:
- under torch.compile (ComfyUI's TorchCompileModel, any backend or mode: ``ModelCall.compiled``). The first
  calls of a process trace and compile, and each new merge path compiles on its first call: seconds of host
  time, so a call's host span says nothing of the pace until its graphs are warm, and CUDA-graph trees record
  their graphs eagerly on the calls after. Once warm with CUDA graphs (backend cudagraphs, mode
  reduce-overhead), the host replays one graph a call and never sets the pace: every call would be judged
  GPU-bound anyway. The cost model prices the compiled defaults at 1.02x or more on every profile.
- on a device without an event type (CPU, meta): there the host clock is the only clock.
- where ``TOMA_HOST_PACE=off`` (read when a node patches): merging never stops for the pace.
- in the baselines (ToMeSD, CA-ToMe), which run as their papers do, and in the WanVideoWrapper node, whose
  blocks the wrapper compiles on its own (out of the runtime's sight) and whose video sizes keep the GPU busy.
"""
import os
import time

import torch

# merged calls judged before the rule decides, all of which must be host-bound: each costs what merging adds where
# the host sets the pace (SD1.5 512 eager, a datacenter host: the first, which selects destinations, 7 ms; the
# next 1 ms), and the second keeps a first call slowed by the process's warm-up from deciding alone
DECIDING_CALLS = 2
SLACK = 0.05  # a GPU that finishes within 5% of the host's issue span was waiting for it
REASON = "the host sets the pace"
ENV = "TOMA_HOST_PACE"  # "off": never stop merging for the pace


def device_event(device: torch.device):
    """A timing event of ``device``'s type (``torch.cuda.Event``, ``torch.xpu.Event``, ...: feature-detected),
    or None where the device has none (CPU, meta)."""
    if device.type in ("cpu", "meta"):
        return None
    event = getattr(getattr(torch, device.type, None), "Event", None)
    return None if event is None else event(enable_timing=True)


def rule_on() -> bool:
    """Whether the rule is on (``TOMA_HOST_PACE``: "on", the default, or "off")."""
    value = os.environ.get(ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{ENV} must be 'on' or 'off' (the rule that stops merging where the host sets the "
                         f"pace), got {os.environ[ENV]!r}")
    return value == "on"


class HostPace:
    """The rule for one patched model's runs (the module docstring). ``events``: device -> a new event with
    ``record()``, ``query()`` and ``elapsed_time(end)`` (ms), or None where the device has none."""

    def __init__(self, events=device_event, deciding_calls: int = DECIDING_CALLS, slack: float = SLACK):
        self.events = events
        self.deciding_calls = deciding_calls
        self.slack = slack
        self.reset()

    def reset(self) -> None:
        """A new run: nothing judged, merging on."""
        self.verdicts: list[bool] = []  # of the run's merged calls judged so far: True where host-bound
        self.stopped_after: int | None = None  # merged calls the run made before the rule stopped merging
        self.unmerged_calls = 0  # model calls run unmerged since
        self._pending = None  # (start event, end event, host seconds) of the last merged call, not judged yet

    @property
    def stopped(self) -> bool:
        return self.stopped_after is not None

    def judge(self) -> bool:
        """Judge the last merged call, at a model call's start (before its decisions); whether the rule stops
        merging here."""
        if self._pending is None:
            return False
        start, end, host = self._pending
        self._pending = None
        # elapsed_time only once both events are reached (query, no wait): it never waits for the device
        self.verdicts.append(end.query() and start.elapsed_time(end) / 1000 <= host * (1 + self.slack))
        if len(self.verdicts) == self.deciding_calls and all(self.verdicts):
            self.stopped_after = len(self.verdicts)
            return True
        return False

    def stops(self, notice, name: str) -> bool:
        """Whether the model call beginning now runs unmerged, the host setting the run's pace: the previous
        merged call judged (``judge``, no wait), and the rule's stop said once through ``notice`` (the runtime's,
        ``name`` the patched model's method); the calls it stops counted."""
        if self.judge():
            notice("%s runs the rest of the run unmerged: %s (the GPU waited for the host's kernels in the first %d "
                   "model calls that merged, so merging would only add kernels); %s=off keeps merging",
                   name, REASON, self.stopped_after, ENV, key=("unmerged", REASON))
        if self.stopped:
            self.unmerged_calls += 1
        return self.stopped

    def start(self, device: torch.device):
        """Before a model call on ``device`` runs: (its start event, the host clock), or None where the call is
        not judged (the run decided, or the device has no events)."""
        if self.stopped or len(self.verdicts) >= self.deciding_calls:
            return None
        event = self.events(device)
        if event is None:
            return None
        event.record()
        return event, time.perf_counter()

    def finish(self, started, device: torch.device, merged: bool) -> None:
        """After the model call ``start`` began returned (the host done issuing it): kept for judging where it
        merged."""
        if started is None or not merged:
            return
        host = time.perf_counter() - started[1]
        end = self.events(device)
        end.record()
        self._pending = (started[0], end, host)

    def summary(self) -> dict | None:
        """The run's stop for the stats (None: merging went on): the merged calls before it, the calls after."""
        if not self.stopped:
            return None
        return {"reason": REASON, "after_calls": self.stopped_after, "unmerged_calls": self.unmerged_calls}
