"""The context under which the engine makes the tensors it caches past the call that made them (a plan's
derived tables, per-shape device constants). The engine knows no host: ComfyUI's glue hands it the host's
(nodes/runtime/malloc_graph.py: the Comfy Compiler's pause), as ComfyUI hands comfy-kitchen its allocation
context; by default nothing."""
import contextlib
import functools

_context = contextlib.nullcontext


def set_allocation_context(factory) -> None:
    """Make cached tensors under ``factory()`` from now on (a zero-argument callable giving a context manager)."""
    global _context
    _context = factory


def kept():
    """A fresh context of the one set (``set_allocation_context``) for making a tensor the engine caches."""
    return _context()


def made_kept(fn):
    """``fn`` run under ``kept()``: the engine's per-shape caches of device tensors (an lru_cache around it)."""
    @functools.wraps(fn)
    def made(*args, **kwargs):
        with kept():
            return fn(*args, **kwargs)
    return made
