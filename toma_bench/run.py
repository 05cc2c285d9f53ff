"""The benchmarks' runner: what every speed benchmark does the same way.

- ``common_arguments``: ``--device``, ``--threads`` and ``--repeats``, each benchmark keeping its own
  choices, defaults and help text; ``resolve_device`` turns ``--device auto`` into a device;
  ``set_threads`` applies ``--threads``.
- ``header``: the run header, printed once at the top of every benchmark's output: the command, when,
  where (machine, CPUs, load), torch and its threads, the device, then the benchmark's own details.
- ``clock`` and ``timed``: wall and process-CPU seconds of one call, the device synced around it.
- ``interleave``: rounds in which every variant runs once, in an order rotated each round, so that a
  slow spell of a shared machine hits every variant alike; ``Timings`` keeps a variant's wall and CPU
  samples (one per round, or several: per step, per call) and gives their medians and the per-round
  speed-ups against the reference.
- ``stage_share`` and ``merged_tokens``: what the pack's runtime summaries say of a run (its stage
  clocks in % of the run's wall time; tokens -> merged tokens per level).

On a shared CPU rank by process CPU time, which other jobs do not inflate, and use one thread (a
descheduled OpenMP thread stalls the others); on CUDA the wall time is the one that counts.
"""
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .metrics import speedups


# -- variants ------------------------------------------------------------------------------------------
def unpatched(model):
    return model


@dataclass(frozen=True)
class Variant:
    """One model of a benchmark's table: ``patch`` turns the base MODEL into it (through the nodes, as a
    user would). ``family`` is the method (a plot's line), ``setting`` what its knob is set to ("r=0.5");
    a row that is no point of a sweep has its whole label as ``family``."""

    family: str
    setting: str = ""
    patch: Callable = unpatched

    @property
    def label(self) -> str:
        return f"{self.family} {self.setting}".strip()


def comfy_tome(model, ratio: float):
    """ComfyUI's own ToMe node, TomePatchModel (comfy_extras.nodes_tomesd; V1 ``patch`` in the March-2024
    tree, V3 ``execute`` returning a NodeOutput in current ComfyUI)."""
    from comfy_extras.nodes_tomesd import TomePatchModel

    if hasattr(TomePatchModel, "define_schema"):
        out = TomePatchModel.execute(model=model, ratio=ratio)
        return out.args[0] if hasattr(out, "args") else out[0]
    return TomePatchModel().patch(model, ratio)[0]


# -- command line --------------------------------------------------------------------------------------
def common_arguments(ap, *, devices=("auto", "cpu", "cuda"), device_default="auto", device_help: str = None,
                     repeats_default=3, repeats_help: str = None, threads_default=None, threads_help: str = None):
    """Add ``--device`` (when ``devices``), ``--repeats`` (when ``repeats_help``) and ``--threads`` to ``ap``
    with the benchmark's own choices, defaults and help."""
    if devices:
        ap.add_argument("--device", choices=list(devices), default=device_default,
                        help=device_help or "auto: CUDA when available, else the CPU")
    if repeats_help:
        ap.add_argument("--repeats", type=int, default=repeats_default, help=repeats_help)
    ap.add_argument("--threads", type=int, default=threads_default,
                    help=threads_help or "torch CPU threads (default: torch's choice)")


def resolve_device(ap, device: str) -> str:
    """``--device``: "auto" becomes "cuda" where CUDA is available, else "cpu"; "cuda" without CUDA is an
    argparse error (through ``ap``)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    return device


def set_threads(threads: int | None) -> None:
    """``--threads``: torch's CPU threads; None leaves torch's choice."""
    if threads:
        torch.set_num_threads(threads)


# -- the run header ---------------------------------------------------------------------------------------
def load_average() -> str:
    return ", ".join(f"{v:.1f}" for v in os.getloadavg())


def header(prog: str, argv, device: str, *details: str) -> str:
    """The run header: the command (``prog`` and its arguments ``argv``, sys.argv[1:] when None), then
    one line of date, machine, load average, torch and its CPU threads, ``device`` and ``details``."""
    argv = sys.argv[1:] if argv is None else argv
    where = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; {platform.node()}, "
             f"{platform.machine()} {os.cpu_count()} CPUs, load average {load_average()} at start; torch "
             f"{torch.__version__}, {torch.get_num_threads()} CPU thread(s); {device}")
    return "\n".join([f"$ {prog} {shlex.join(argv)}".rstrip(), "; ".join([where, *details])])


def footer() -> str:
    """The line that closes a run: the load average at its end (a busy machine shows here)."""
    return f"load average {load_average()} at the end"


def device_name(device: str) -> str:
    """What a header calls ``device``: the GPU's name, or "CPU"."""
    return torch.cuda.get_device_name() if device == "cuda" else "CPU"


# -- timing -------------------------------------------------------------------------------------------------
def device_sync(device) -> Callable[[], None]:
    """A function waiting for ``device`` ("cuda", "cpu" or a torch.device) to finish its queued work."""
    cuda = getattr(device, "type", device) == "cuda"
    return torch.cuda.synchronize if cuda else (lambda: None)


def clock() -> tuple[float, float]:
    """(wall, process CPU) seconds now."""
    return time.perf_counter(), time.process_time()


def timed(fn, sync=lambda: None):
    """(what ``fn()`` returned, wall seconds, process-CPU seconds), ``sync`` called around the call."""
    sync()
    wall, cpu = clock()
    out = fn()
    sync()
    return out, time.perf_counter() - wall, time.process_time() - cpu


@dataclass
class Timings:
    """One variant's timed samples: ``wall`` and ``cpu`` seconds, one per round (or per step, per call)."""

    wall: list = field(default_factory=list)
    cpu: list = field(default_factory=list)

    def add(self, wall, cpu) -> None:
        """A sample, or lists of samples."""
        self.wall += wall if isinstance(wall, list) else [wall]
        self.cpu += cpu if isinstance(cpu, list) else [cpu]

    @property
    def median_wall(self) -> float:
        return statistics.median(self.wall)

    @property
    def median_cpu(self) -> float:
        return statistics.median(self.cpu)

    def speedups(self, reference: "Timings", kind: str = "cpu") -> tuple[float, float, float]:
        """Per round, the reference's ``kind`` ("cpu" or "wall") seconds / this variant's of the same
        round: (median, lowest, highest)."""
        return speedups(getattr(reference, kind), getattr(self, kind))


def rotated(count: int, round_index: int) -> list[int]:
    """0..count-1 starting at ``round_index`` mod count: each variant leads one round in turn."""
    start = round_index % count if count else 0
    return list(range(start, count)) + list(range(start))


def interleave(variants: list, rounds: int, run: Callable, progress=None) -> list[Timings]:
    """``rounds`` rounds in which ``run(variant)`` runs every variant once, in an order rotated each
    round; ``run`` returns (wall, cpu): seconds, or lists of samples. One Timings per variant, in order.
    ``progress(line)`` hears the end of every round."""
    timings = [Timings() for _ in variants]
    for r in range(rounds):
        start = time.perf_counter()
        for i in rotated(len(variants), r):
            timings[i].add(*run(variants[i]))
        if progress is not None:
            progress(f"  round {r + 1}/{rounds}: {time.perf_counter() - start:.0f} s, load "
                     f"{os.getloadavg()[0]:.1f}")
    return timings


# -- what the pack's runtime says of a run -------------------------------------------------------------------
def stage_share(summaries: list[dict], stages) -> float:
    """Median over the timed runs (runtime summaries with a wall time) of the runtime's seconds in
    ``stages`` ("select", "merge", "unmerge"), in % of the run's wall time."""
    timed_runs = [s for s in summaries if s.get("wall_seconds")]
    return 100 * statistics.median(sum(s["seconds"][k] for k in stages) / s["wall_seconds"] for s in timed_runs)


def level_text(fields: dict) -> str:
    """A level as the tables name it, from its fields in a runtime summary: a UNet level by its grid
    ('32x32'), a block group with its grid ('two-stream 64x64')."""
    size = "x".join(map(str, fields["grid"]))
    return size if "downsample" in fields else f"{fields['group']} {size}"


def merged_tokens(summary: dict | None, level_name: Callable[[dict], str] = level_text, sep: str = ", ",
                  nothing: str = "all") -> str:
    """'<level> 1024->512, ...' from a runtime summary, each level named by ``level_name(fields)`` (its
    fields in the summary); ``nothing`` where the summary has no merged level."""
    if not summary or not summary["levels"]:
        return nothing
    return sep.join(f"{level_name(v)} {v['tokens']}->{v['merged_tokens']}" for v in summary["levels"].values())


def runtime_of(pack, model):
    """The pack's MergeRuntime of ``model``, or None for a model no node of the pack patched."""
    try:
        return pack.nodes.runtime.runtime_of(model)
    except ValueError:
        return None


def removed_fraction(pack, model) -> float | None:
    """Tokens removed at the merged levels by the last plan of the run, averaged over levels: 0 where the
    pack patched ``model`` but nothing merged, None where it did not patch it."""
    runtime = runtime_of(pack, model)
    if runtime is None:
        return None
    levels = runtime.summary()["levels"].values()
    return statistics.mean(1 - v["merged_tokens"] / v["tokens"] for v in levels) if levels else 0.0
