"""The host's Comfy Compiler (ComfyUI v0.34 on, ``comfy/model_prefetch.py``), as token merging meets it.

comfy-aimdo's malloc graph records the allocations of each transformer block and replays them on later calls
(``malloc_graph_begin``, then ``prefetch_queue_pop(..., malloc_scope="block")`` before each block). A tensor
made inside a block's scope and kept past it (our plans, merge weights, rotation counts, the tables derived from
a plan) lives in memory the graph hands out again: packs that kept such tensors crashed on the second prompt. So
everything the pack keeps is made under ``kept_past_block()``: the host's ``pause_malloc_graph()`` where it has
it, nothing where not. toma_core, which never imports ComfyUI, makes its lazily cached tensors under the same
context through ``toma_core.memory`` (``install`` hands it this one).

``prefetch_queue_pop(..., enable_graph=True)`` may also capture a block as a CUDA graph and replay it in place of
its Python: a replayed block would skip every decision of ours, and a captured merged block would replay a stale
plan, so a block the host graphs runs unmerged (``graphed_by_host``).
"""
import contextlib
import sys

import torch

from ...toma_core import memory

HOST_MODULE = "comfy.model_prefetch"  # ComfyUI's: imported by every model that runs its blocks in the graph
GRAPHED = "CUDA graph"  # the run report's reason for blocks the host replays from a CUDA graph
GRAPHED_IN_WORDS = ("%s runs blocks unmerged that ComfyUI captures and replays as CUDA graphs (the Comfy "
                    "Compiler's enable_graph): a replayed block runs none of ToMA's code, so it would replay a "
                    "stale merge")


def host_prefetch():
    """ComfyUI's ``comfy.model_prefetch`` where a model has imported it, else None: a host whose models never
    import it runs no malloc graph (looked up, never imported: no import side effects in a block call)."""
    return sys.modules.get(HOST_MODULE)


def kept_past_block():
    """The context under which the pack makes a tensor it keeps past the block call that made it: the host's
    ``pause_malloc_graph()`` where it has one (a no-op there while no graph records), else a null context.
    Traced code (torch.compile) gets the null context: the host's pause is not traceable, and a compiled
    graph's allocations are torch.compile's, not the malloc graph's."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    pause = getattr(host_prefetch(), "pause_malloc_graph", None)
    return contextlib.nullcontext() if pause is None else pause()


def graphed_by_host(module) -> bool:
    """Whether the host runs block ``module`` as a CUDA graph: it holds a captured graph (``_comfy_graph``), or
    it runs now on one of the host's graph capture streams (its warm-up and capture runs). Host-side reads only."""
    if module is not None and getattr(module, "_comfy_graph", None) is not None:
        return True
    if torch.compiler.is_compiling():
        return False
    streams = getattr(host_prefetch(), "GRAPH_CAPTURE_STREAMS", None)
    if not streams:
        return False
    return torch.cuda.is_current_stream_capturing() or torch.cuda.current_stream() in streams.values()


def runs_as_cuda_graph(runtime, module) -> bool:
    """Whether block ``module`` runs unmerged because the host graphs it (``graphed_by_host``): counted in
    ``runtime``'s stats under GRAPHED and said once in the log."""
    if not graphed_by_host(module):
        return False
    runtime.unmerged(GRAPHED, GRAPHED_IN_WORDS, runtime.name)
    return True


def unless_graphed(forward):
    """An object-patched block ``forward(layer, ...)`` (its ``token_merge``: (the block's original forward, the
    runtime)) that runs the original forward where the host graphs the block."""
    original, runtime = forward.token_merge

    def patched(layer, *args, **kwargs):
        if runs_as_cuda_graph(runtime, layer):
            return original(*args, **kwargs)
        return forward(layer, *args, **kwargs)

    patched.token_merge = forward.token_merge
    return patched


def install() -> None:
    """Hand toma_core the context its cached tensors are made under (``toma_core.memory``)."""
    memory.set_allocation_context(kept_past_block)
