"""Seconds spent per stage of merging (select, merge, unmerge) in a sampling run, for the stats and the
cost model."""
import contextlib
import time

import torch


class StageClock:
    """Seconds spent per stage of merging (select, merge, unmerge) in a sampling run.

    On CUDA the work of a stage finishes long after the host has launched it, so a host clock would measure
    launch time. There each stage is bracketed by two CUDA events on the current stream, and the elapsed
    times are read only when ``seconds()`` is asked for at the end of a run: reading an event waits for
    it, which must never happen in a block call. On other devices the stages are timed with the host
    clock (``kind`` says which)."""

    def __init__(self, stages):
        self.totals = dict.fromkeys(stages, 0.0)
        self.pending = []  # (stage, start event, end event) not read yet
        self.cuda = False
        self.untimed = False  # some stages ran inside a compiled graph, where nothing times them
        # callables (stage, entering) told when a stage begins and ends, kept across resets: the cost
        # model (toma_bench.costmodel) tags the ops it records with them
        self.listeners = []

    @property
    def kind(self) -> str:
        return "cuda events" if self.cuda else "host"

    def use(self, device: torch.device) -> None:
        """Time the next stages as work on ``device``."""
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        self.totals = dict.fromkeys(self.totals, 0.0)
        self.pending.clear()
        self.untimed = False

    def stage(self, stage: str):
        """Time the block as ``stage`` ("select", "merge", "unmerge"); untimed while torch.compile traces it (a
        clock read there would break the graph, and inside a compiled graph there is no stage to time: the stats
        say the stages went untimed)."""
        if torch.compiler.is_compiling():
            self.untimed = True
            return contextlib.nullcontext()
        return self.timing(stage)

    @contextlib.contextmanager
    def timing(self, stage: str):
        """Time the block as ``stage``, telling the listeners where it begins and ends."""
        for listener in self.listeners:
            listener(stage, True)
        started = self.start()
        try:
            yield
        finally:
            self.stop(stage, started)
            for listener in self.listeners:
                listener(stage, False)

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, stage: str, started) -> None:
        if isinstance(started, float):
            self.totals[stage] += time.perf_counter() - started
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((stage, started, end))

    def seconds(self) -> dict[str, float]:
        """Seconds per stage so far (waits for the device to finish the timed work)."""
        for stage, start, end in self.pending:
            end.synchronize()
            self.totals[stage] += start.elapsed_time(end) / 1000.0
        self.pending.clear()
        return dict(self.totals)
