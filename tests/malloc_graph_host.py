"""A stand-in of ComfyUI's malloc-graph API (the Comfy Compiler, ComfyUI v0.34 on), our own code, written after
the public ``comfy/model_prefetch.py`` of Comfy-Org/ComfyUI at 03fb330a7f50e51fd7b3de126a288b089871c5e6 (its
names and signatures; comfy-aimdo's recorder itself is not public here). A model runs its blocks inside the graph
as Qwen-Image 2.1's later model file does (``malloc_graph_begin``, ``prefetch_queue_pop(None, device, block,
malloc_scope="block")`` before each block, ``prefetch_queue_pop(None, device, None, malloc_scope="block")`` and
``malloc_graph_end`` after the last); ``pause_malloc_graph`` brackets allocations the graph must not own.

In place of aimdo's allocator, a TorchDispatchMode (``Recorder``) notes every storage an op allocates while a
graph records and is not paused, with where it was made (the block scope, the op, the caller's file). A "rogue" is
one of them still alive when the next graph begins or when asked (``rogues``): memory the real graph hands out
again on its next replay, which crashed packs that kept such tensors (xmarre/ComfyUI-Spectrum-MiniMax-H3 #99).
"""
import contextlib
import sys
import types
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PACK_FOLDERS = ("nodes", "toma_core")  # where the pack's frames are (a rogue is ours if one made it)


@dataclass
class Allocation:
    storage: StorageWeakRef
    scope: str
    op: str
    shape: tuple
    made_by: str  # the innermost frame of the pack (nodes/, toma_core/), else of anything

    def alive(self) -> bool:
        return not self.storage.expired()


def _maker() -> str:
    frame, first = sys._getframe(2), None
    while frame is not None:
        name = frame.f_code.co_filename
        if any(f"/{part}/" in name for part in PACK_FOLDERS) and "/tests/" not in name:
            return f"{'/'.join(name.rsplit('/', 2)[-2:])}:{frame.f_lineno} {frame.f_code.co_name}"
        first = first or f"{name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return first


class Recorder(TorchDispatchMode):
    """The allocations of ops run while ``recording()``: each output storage no input of the op held."""

    def __init__(self, host):
        super().__init__()
        self.host = host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.host.recording():
            inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if (isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()
                        and t.untyped_storage()._cdata not in inputs):
                    self.host.allocations.append(Allocation(StorageWeakRef(t.untyped_storage()), self.host.scope,
                                                            str(func), tuple(t.shape), _maker()))
        return out


class _Graph:
    """What ``malloc_graph_begin`` starts: its block scope and pause depth (the public file's graph object has
    push/pop, iterate, pause/resume)."""

    def __init__(self):
        self.scope = "graph"
        self.paused = 0


class MallocGraphHost:
    """The module installed as ``comfy.model_prefetch`` (``installed``), with the API of the public file."""

    def __init__(self):
        self.graph: _Graph | None = None
        self.allocations: list[Allocation] = []
        self.found: list[Allocation] = []  # rogues found when a later graph began
        self.recorder = Recorder(self)
        self.graphs = 0  # graphs begun (one per model call)
        self.GRAPH_CAPTURE_STREAMS = {}
        self.module = types.ModuleType("comfy.model_prefetch")
        for name in ("malloc_graph_begin", "malloc_graph_end", "malloc_graph_scope", "pause_malloc_graph",
                     "prefetch_queue_pop", "make_prefetch_queue", "cleanup_prefetch_queues"):
            setattr(self.module, name, getattr(self, name))
        self.module.GRAPH_CAPTURE_STREAMS = self.GRAPH_CAPTURE_STREAMS

    @property
    def scope(self) -> str:
        return self.graph.scope if self.graph is not None else "none"

    def recording(self) -> bool:
        return self.graph is not None and not self.graph.paused

    def rogues(self) -> list[Allocation]:
        """The recorded allocations alive now (forgetting the dead ones), and those found alive earlier."""
        self.allocations = [a for a in self.allocations if a.alive()]
        return self.found + list(self.allocations)

    # -- the public API ---------------------------------------------------------------------------------------
    def malloc_graph_begin(self, device):
        self.found += self.rogues()  # alive past their graph: into a later model call
        self.allocations = []
        self.graph = _Graph()
        self.graphs += 1
        self.recorder.__enter__()

    def malloc_graph_end(self):
        if self.graph is not None:
            self.recorder.__exit__(None, None, None)
            self.graph = None

    def malloc_graph_scope(self, device):
        @contextlib.contextmanager
        def scope():
            self.malloc_graph_begin(device)
            try:
                yield
            finally:
                self.malloc_graph_end()
        return scope()

    @contextlib.contextmanager
    def pause_malloc_graph(self, sync=False):
        graph = self.graph
        if graph is not None:
            graph.paused += 1
        try:
            yield
        finally:
            if graph is not None:
                graph.paused -= 1

    def prefetch_queue_pop(self, queue, device, module, dtype=None, core=None, enable_graph=False, generator=None,
                           malloc_scope=None):
        if self.graph is not None and malloc_scope is not None:
            self.graph.scope = f"{malloc_scope} {type(module).__name__}" if module is not None else "after blocks"
        if core is not None:
            core()

    def make_prefetch_queue(self, queue, device, transformer_options):
        return None

    def cleanup_prefetch_queues(self):
        self.malloc_graph_end()


@contextlib.contextmanager
def installed(monkeypatch):
    """A MallocGraphHost as ``comfy.model_prefetch`` while the block runs."""
    import comfy

    host = MallocGraphHost()
    monkeypatch.setitem(sys.modules, "comfy.model_prefetch", host.module)
    monkeypatch.setattr(comfy, "model_prefetch", host.module, raising=False)
    try:
        yield host
    finally:
        host.malloc_graph_end()


def blocks_in_graph(model, host: MallocGraphHost, blocks: list[tuple[str, str]]):
    """A clone of ``model`` (a ModelPatcher) whose diffusion model runs its blocks inside ``host``'s graph as
    Qwen-Image 2.1's later model file does: each block's "dit" replace patch (the one set, or a plain call of the
    block) is wrapped so that the first begins the graph, each pops the block's scope before it runs, and the last
    ends the graph after it. ``blocks``: [(the diffusion model's attribute, the hook of its patches)], in the order
    the model calls them."""
    clone = model.clone()
    dm = clone.model.diffusion_model
    order = [(hook, i, getattr(dm, attribute)[i]) for attribute, hook in blocks
             for i in range(len(getattr(dm, attribute)))]
    patches = clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    for n, (hook, i, module) in enumerate(order):
        inner = patches.get((hook, i))

        def step(args, extras, inner=inner, module=module, first=n == 0, last=n == len(order) - 1):
            device = next(module.parameters()).device
            if first:
                host.malloc_graph_begin(device)
            host.prefetch_queue_pop(None, device, module, malloc_scope="block")
            out = inner(args, extras) if inner is not None else extras["original_block"](args)
            if last:
                host.prefetch_queue_pop(None, device, None, malloc_scope="block")
                host.malloc_graph_end()
            return out

        clone.set_model_patch_replace(step, "dit", hook, i)
    return clone
