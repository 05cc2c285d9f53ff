"""A MODEL compiled as ComfyUI's TorchCompileModel compiles it, and what dynamo did while it sampled.

``compiled(model)`` is a clone of the MODEL whose diffusion model runs through ``torch.compile`` the way
the tree's own node does it: ``comfy_api.torch_helpers.set_torch_compile_wrapper`` (an APPLY_MODEL
wrapper that swaps the compiled module in for each model call) where the tree has it; in a tree without
it (the pinned March-2024 tree), the diffusion model object-patched with ``torch.compile`` of itself, as
that node first did. ``DynamoCount`` reads ``torch._dynamo.utils.counters`` and the guard failures
around a block of code: graphs compiled, graph breaks (with their reasons), recompiles (with the failed
guard), frames dynamo gave up on and left to eager. Backend "eager" traces without generating code: it
is cheap on the CPU and finds every graph break and recompile the other backends would.
"""
import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch._dynamo
import torch._dynamo.utils


def compiled(model, backend: str = "eager", mode: str | None = None, dynamic: bool | None = None):
    """A clone of ``model`` (a ModelPatcher) whose diffusion model is compiled with ``backend``, the way
    the tree's TorchCompileModel node does it."""
    m = model.clone()
    try:
        from comfy_api.torch_helpers import set_torch_compile_wrapper
    except ImportError:
        set_torch_compile_wrapper = None
    if set_torch_compile_wrapper is not None:
        set_torch_compile_wrapper(model=m, backend=backend, mode=mode, dynamic=dynamic)
    else:
        module = m.object_patches.get("diffusion_model", m.object_patches_backup.get("diffusion_model",
                                                                                     m.model.diffusion_model))
        # object patches stay applied after sampling (docs/architecture.md): the live attribute may be
        # another clone's compiled module
        module = getattr(module, "_orig_mod", module)
        m.add_object_patch("diffusion_model", torch.compile(model=module, backend=backend, mode=mode, dynamic=dynamic))
    return m


@dataclass
class DynamoCount:
    """What dynamo did inside ``with count:``. ``fresh``: dynamo's caches are reset on entry, so every
    graph of the block is counted, the first compile included; otherwise only what the block added to
    what was compiled before it (a second run)."""

    fresh: bool = True
    graphs: int = 0
    graph_breaks: Counter = field(default_factory=Counter)  # reason -> times
    recompiles: list = field(default_factory=list)  # "function: failed guard", each guard failure
    frames: int = 0  # frames dynamo was asked to convert
    frames_converted: int = 0  # ... and converted (the others were skipped, left to eager)
    _before: tuple = field(default=(), repr=False)

    @property
    def breaks(self) -> int:
        return sum(self.graph_breaks.values())

    @property
    def frames_skipped(self) -> int:
        return self.frames - self.frames_converted

    @staticmethod
    def _now():
        counters = torch._dynamo.utils.counters
        recompiles = [f"{getattr(code, 'co_name', code)}: {reason}"
                      for code, reasons in torch._dynamo.utils.guard_failures.items() for reason in reasons]
        return (counters["stats"]["unique_graphs"], Counter(counters["graph_break"]), recompiles,
                counters["frames"]["total"], counters["frames"]["ok"])

    def __enter__(self):
        if self.fresh:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
        self._before = self._now()
        return self

    def __exit__(self, *exc):
        (graphs, breaks, recompiles, frames, ok), before = self._now(), self._before
        self.graphs = graphs - before[0]
        self.graph_breaks = breaks - before[1]
        self.recompiles = recompiles[len(before[2]):]
        self.frames, self.frames_converted = frames - before[3], ok - before[4]
        return False

    def clean(self) -> bool:
        """No graph break and no frame left to eager (a recompile is a graph of another path: the caller
        bounds the graphs)."""
        return not self.graph_breaks and not self.frames_skipped

    def __str__(self) -> str:
        lines = [f"{self.graphs} graphs, {self.breaks} graph breaks, {len(self.recompiles)} recompiles, "
                 f"{self.frames_skipped} of {self.frames} frames skipped"]
        lines += [f"  break x{n}: {reason}" for reason, n in self.graph_breaks.most_common()]
        lines += [f"  recompile: {r}" for r in self.recompiles]
        return "\n".join(lines)


def counting(fresh: bool = True) -> DynamoCount:
    """``with counting() as count:``: a DynamoCount of the block (``fresh``: see DynamoCount)."""
    return DynamoCount(fresh)


@contextlib.contextmanager
def constant_free_memory():
    """ComfyUI's free-memory query answers what it answered on entry, inside the block. On the CPU
    ComfyUI attends with its sub-quadratic attention, which asks psutil for the free memory in every
    attention call: a graph break (a file read) in the model itself, in every model, patched or not. On a
    GPU ComfyUI attends with PyTorch's SDPA and asks nothing; this makes a CPU trace show what a GPU trace
    would (the chunk sizes it picks depend only on that figure)."""
    import comfy.model_management as mm

    query = mm.get_free_memory
    answer = query(mm.get_torch_device(), True)

    def free_memory(dev=None, torch_free_too=False):
        return answer if torch_free_too else answer[0]

    mm.get_free_memory = free_memory
    try:
        yield
    finally:
        mm.get_free_memory = query
