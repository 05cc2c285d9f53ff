"""A stand-in for ComfyUI core's "Model Sparse Attention" node, for tests and benchmarks: its protocol, not
its code (the node, ``comfy_extras/nodes_sparse_attention.py`` of ComfyUI PR #16072, is newer than every tree
the pack is tested in, and its kernels are CUDA builds of comfy-kitchen).

The protocol, as that node's code has it:
- ``apply`` puts an ``optimized_attention_override`` on top of whatever override is on the model's hook at
  patch time, and again at every model call from an ON_PREPARE_STATE callback keyed
  ``"block_sparse_attention"`` (``install``: idempotent once it is on top), so a node applied later cannot
  replace it; a call it declines runs the override it found (``previous``), else ComfyUI's function.
- It declines (runs dense) a call with a mask; outside its sigma window (``start_percent`` to
  ``end_percent`` of the schedule, read from ``transformer_options["sigmas"]``); with fewer than
  ``min_tokens`` queries; with a head size other than ``head_dim``; where q, k and v differ in shape
  ("cross-attention or GQA"). The real node also runs dense off CUDA; this one runs its kernel anywhere.
- Its ON_CLEANUP callback (same key) resets its per-run state.
- On MiniMax-H3 it also puts a "dit" double_block replace patch on every block (the real one runs the
  block's attention through a chunked qkv producer there); the stand-in's runs the block as it is.

The kernel: ``kernel(q, k, v, tau, scale) -> (out, routed)`` over (B, T, H, D) tensors, ``routed`` the
share of key blocks its routing keeps exact (None where it does not say). ``eager_sol_attn`` is
comfy-kitchen's eager, pure-torch reference of Sol-Attn (exact arithmetic over the kernel's block routing);
on the meta device (the cost model) ``priced_kernel`` runs ComfyUI's dense function with the attention's
cost scaled to the routed share a proxy run measured plus ``ROUTING_OVERHEAD``.

Every call is recorded (``calls``: what it saw and what it ran), for tests to check and benchmarks to
report.
"""
import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

CALLBACK_KEY = "block_sparse_attention"  # the real node's ON_PREPARE_STATE and ON_CLEANUP key
MIN_TOKENS = 12288  # the real node's default min_tokens
HEAD_DIM = 128  # the only head size its kernels take
TAU = 1.3  # its default threshold (sol-attn)
START_PERCENT = 0.2  # its default: dense before 20% of the schedule
ROUTING_OVERHEAD = 0.10  # the kernel's time, priced: the routed share of a dense kernel's plus this
SHAPES = "cross-attention or GQA (kept dense)"  # the real node's words for q, k, v of different shapes

KITCHEN_VERSION = "0.2.40"  # the first comfy-kitchen with the eager sol_attn reference
EAGER_MODULE = "comfy_kitchen/backends/eager/sol_attn.py"
WHEEL_ENV = "TOMA_COMFY_KITCHEN_WHEEL"  # a comfy-kitchen wheel (or its unpacked folder) holding EAGER_MODULE
WHEEL_DIR = Path(__file__).resolve().parent.parent / ".cache"  # where GET_WHEEL puts it (ignored by git)
GET_WHEEL = f"pip download comfy-kitchen=={KITCHEN_VERSION} --no-deps -d .cache"


# -- the kernel ------------------------------------------------------------------------------------------

class _Source(importlib.abc.SourceLoader):
    """A module's source text read from a wheel, loaded as a file's (the registry's security check refuses exec)."""

    def __init__(self, source: str, path: str):
        self.source, self.path = source, path

    def get_filename(self, fullname: str) -> str:
        return self.path

    def get_data(self, path: str) -> bytes:
        return self.source.encode()


def _wheel_source() -> tuple[str | None, str]:
    """(the source of comfy-kitchen's eager sol_attn module, where it came from), or (None, why not)."""
    given = os.environ.get(WHEEL_ENV)
    candidates = [Path(given)] if given else sorted(WHEEL_DIR.glob("comfy_kitchen-*.whl"), reverse=True)
    for path in candidates:
        try:
            if path.is_dir():
                return (path / EAGER_MODULE).read_text(), str(path)
            with zipfile.ZipFile(path) as wheel:
                return wheel.read(EAGER_MODULE).decode(), str(path)
        except (OSError, KeyError, zipfile.BadZipFile):
            continue
    where = f"{WHEEL_ENV}={given}" if given else f"no comfy_kitchen-*.whl in {WHEEL_DIR}"
    return None, (f"comfy-kitchen's eager sol_attn reference is not installed ({KITCHEN_VERSION} or later) and "
                  f"not found ({where}; get it with `{GET_WHEEL}`)")


_REFERENCE: dict = {}


def sol_attn_reference():
    """comfy-kitchen's eager ``sol_attn`` function, or a string saying why it is not here: the installed
    package's where it has one, else loaded from a wheel (``WHEEL_ENV``, or the newest in ``WHEEL_DIR``)
    without installing it (ComfyUI trees pin older comfy-kitchens). Loaded once a process."""
    if "fn" in _REFERENCE:
        return _REFERENCE["fn"]
    try:
        _REFERENCE["fn"] = importlib.import_module("comfy_kitchen.backends.eager.sol_attn").sol_attn
        return _REFERENCE["fn"]
    except Exception:  # absent, or a comfy-kitchen that does not import here
        pass
    source, origin = _wheel_source()
    if source is None:
        _REFERENCE["fn"] = origin
        return origin
    # the module imports its package's registry (``from ...registry import registry``) for its custom op's
    # dispatch only; the function itself is plain torch: a private package with an empty registry serves it
    root = "_toma_comfy_kitchen_reference"
    for name in (root, f"{root}.backends", f"{root}.backends.eager"):
        sys.modules.setdefault(name, types.ModuleType(name)).__path__ = []
    registry = sys.modules.setdefault(f"{root}.registry", types.ModuleType(f"{root}.registry"))
    registry.registry = None
    spec = importlib.util.spec_from_loader(f"{root}.backends.eager.sol_attn", _Source(source, f"{origin}/{EAGER_MODULE}"),
                                           origin=origin)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = f"{root}.backends.eager"
    spec.loader.exec_module(module)
    _REFERENCE["fn"] = module.sol_attn
    return module.sol_attn


class _RoutedShare(TorchFunctionMode):
    """Catches the reference's per-token routing, (B, H, T, N) booleans (each query's key blocks kept
    exact), where it expands it to keys (``repeat_interleave``): its mean is the routed share."""

    def __init__(self):
        super().__init__()
        self.share = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (self.share is None and func is torch.Tensor.repeat_interleave and args
                and torch.is_tensor(args[0]) and args[0].dtype == torch.bool and args[0].dim() == 4):
            self.share = float(args[0].float().mean())
        return func(*args, **kwargs)


def eager_sol_attn(q, k, v, tau, scale=None):
    """comfy-kitchen's eager Sol-Attn over (B, T, H, D) tensors (any head size, any device): (out, the share
    of key blocks routed exact)."""
    fn = sol_attn_reference()
    if isinstance(fn, str):
        raise RuntimeError(fn)
    with _RoutedShare() as routing:
        out = fn(q, k, v, tau=tau, scale=scale)
    return out, routing.share


# -- the stand-in -----------------------------------------------------------------------------------------
def protocol_missing() -> str | None:
    """Why the imported ComfyUI cannot host the node's protocol, or None (feature-detected): it needs keyed
    ON_PREPARE_STATE callbacks that are handed the model call's options, and the attention override."""
    import inspect

    import comfy.ldm.modules.attention as attention
    import comfy.model_patcher
    import comfy.patcher_extension

    patcher = comfy.model_patcher.ModelPatcher
    if not hasattr(getattr(comfy.patcher_extension, "CallbacksMP", None), "ON_PREPARE_STATE") or \
            not hasattr(patcher, "get_callbacks"):
        return "this ComfyUI has no keyed ON_PREPARE_STATE callbacks (the node re-installs its override there)"
    if "model_options" not in inspect.signature(patcher.prepare_state).parameters:
        return ("this ComfyUI's ON_PREPARE_STATE callbacks are not handed the model call's options (the node "
                "re-installs its override in them)")
    if not hasattr(attention, "wrap_attn"):
        return "this ComfyUI has no attention override (wrap_attn)"
    return None


@dataclass(frozen=True)
class Call:
    """One attention call the override saw: q's and k's shapes as passed, the query tokens, and why it ran
    dense (None: the kernel ran it), with the kernel's routed share."""

    q: tuple
    k: tuple
    tokens: int
    dense: str | None
    routed: float | None = None


class SparseAttention:
    """The options and calls of one model patched by the stand-in (``apply``)."""

    def __init__(self, kernel=eager_sol_attn, tau: float = TAU, start_percent: float = START_PERCENT,
                 end_percent: float = 1.0, min_tokens: int = MIN_TOKENS, head_dim: int | None = HEAD_DIM):
        self.kernel, self.tau = kernel, tau
        self.start_percent, self.end_percent = start_percent, end_percent
        self.min_tokens = min_tokens  # read by the pack (nodes/host.py) from this callback's closure
        self.head_dim = head_dim  # None: any (the eager reference takes every head size)
        self.sigma_start = self.sigma_end = None
        self.installed = set()
        self.calls: list[Call] = []

    def apply(self, model):
        """The patched clone, as the real node patches: override on top now and at every model call."""
        from comfy.patcher_extension import CallbacksMP

        why = protocol_missing()
        if why:
            raise RuntimeError(f"the sparse attention stand-in needs a newer ComfyUI: {why}")
        sampling = model.get_model_object("model_sampling")
        self.sigma_start = float(sampling.percent_to_sigma(self.start_percent))
        self.sigma_end = float(sampling.percent_to_sigma(self.end_percent))
        m = model.clone()
        self.install(m.model_options.setdefault("transformer_options", {}))
        m.add_callback_with_key(CallbacksMP.ON_PREPARE_STATE, CALLBACK_KEY,
                                lambda patcher, timestep, model_options: self.install(model_options["transformer_options"]))
        m.add_callback_with_key(CallbacksMP.ON_CLEANUP, CALLBACK_KEY, lambda patcher: None)
        try:
            from comfy.ldm.minimax.model import MiniMaxH3Model
        except ImportError:  # a tree without MiniMax-H3
            return m
        dm = model.get_model_object("diffusion_model")
        if isinstance(dm, MiniMaxH3Model):  # the node's MiniMax-H3 path: a block patch of its own on every block
            for i in range(len(dm.blocks)):
                m.set_model_patch_replace(self.h3_block_patch(i), "dit", "double_block", i)
        return m

    def h3_block_patch(self, index: int):
        """The node's MiniMax-H3 block patch, less its kernel (which swaps the block's attention for a chunked
        qkv producer on CUDA): the block runs as it is, the call recorded (dense "MiniMax-H3 block")."""
        def block_patch(args, extra):
            img = args["img"]
            self.calls.append(Call(tuple(img.shape), tuple(img.shape), img.shape[0], f"MiniMax-H3 block {index}"))
            return extra["original_block"](args)

        return block_patch

    def install(self, transformer_options: dict) -> None:
        current = transformer_options.get("optimized_attention_override")
        if current in self.installed:
            return
        override = self.override(current)
        self.installed.add(override)
        transformer_options["optimized_attention_override"] = override

    def dense_reason(self, q, k, v, heads, mask, skip_reshape, transformer_options) -> str | None:
        """Why the call runs dense, in the real node's order of checks, or None."""
        if mask is not None:
            return "mask"
        tokens = q.shape[2] if skip_reshape else q.shape[1]
        sigmas = transformer_options.get("sigmas")
        if sigmas is not None:
            sigma = float(sigmas[0]) if sigmas.device.type != "meta" else None
            if sigma is not None and (sigma > self.sigma_start or sigma < self.sigma_end):
                return "sigma outside the start/end window"
        if tokens < self.min_tokens:
            return f"{tokens} tokens < min_tokens {self.min_tokens}"
        dim_head = q.shape[-1] if skip_reshape else q.shape[-1] // heads
        if self.head_dim is not None and dim_head != self.head_dim:
            return f"head_dim {dim_head} != {self.head_dim}"
        if q.shape != k.shape or q.shape != v.shape:
            return SHAPES
        return None

    def override(self, previous):
        patch = self

        def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                     skip_output_reshape=False, **kwargs):
            options = kwargs.get("transformer_options") or {}
            tokens = q.shape[2] if skip_reshape else q.shape[1]
            reason = patch.dense_reason(q, k, v, heads, mask, skip_reshape, options)
            if reason is not None:
                patch.calls.append(Call(tuple(q.shape), tuple(k.shape), tokens, reason))
                kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                          skip_output_reshape=skip_output_reshape, **kwargs)
                return func(q, k, v, heads, **kw) if previous is None else previous(func, q, k, v, heads, **kw)
            if skip_reshape:  # (B, H, T, D)
                b, dim_head = q.shape[0], q.shape[-1]
                qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
            else:  # (B, T, H*D)
                b, dim_head = q.shape[0], q.shape[-1] // heads
                qs, ks, vs = (t.view(b, -1, heads, dim_head) for t in (q, k, v))
            out, routed = patch.kernel(qs, ks, vs, patch.tau, kwargs.get("scale"))
            patch.calls.append(Call(tuple(q.shape), tuple(k.shape), tokens, None, routed))
            out = out.to(q.dtype)
            if skip_output_reshape:
                return out.transpose(1, 2)
            return out.reshape(b, -1, heads * dim_head)

        return override

    # -- what it ran ------------------------------------------------------------------------------------
    def sparse_calls(self) -> list[Call]:
        return [c for c in self.calls if c.dense is None]

    def routed_share(self) -> float | None:
        """The mean routed share of the calls the kernel ran (None: it ran none, or did not say)."""
        shares = [c.routed for c in self.sparse_calls() if c.routed is not None]
        return sum(shares) / len(shares) if shares else None


def priced_kernel(share: float):
    """A kernel for the meta device: ComfyUI's SDPA with the attention's FLOPs and bytes scaled to ``share``
    of a dense kernel's plus ROUTING_OVERHEAD (toma_bench.oprecord records it as one fused kernel)."""
    from . import oprecord

    factor = min(1.0, share + ROUTING_OVERHEAD)

    def kernel(q, k, v, tau, scale=None):
        with oprecord.attention_scaled(factor):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
        return out.transpose(1, 2), None

    return kernel


class MeasuredKernel:
    """For a benchmark that measures a setting on a proxy and prices it on a real-size model: comfy-kitchen's
    eager Sol-Attn on real tensors, each call's routed share kept (``shares``); on the meta device the priced
    kernel of their mean (a proxy run must come first)."""

    def __init__(self):
        self.shares: list[float] = []

    def share(self) -> float:
        if not self.shares:
            raise RuntimeError("the sparse kernel is priced from the routed share of a proxy run: run one first")
        return sum(self.shares) / len(self.shares)

    def __call__(self, q, k, v, tau, scale=None):
        if q.device.type == "meta":
            return priced_kernel(self.share())(q, k, v, tau, scale)
        out, routed = eager_sol_attn(q, k, v, tau, scale)
        self.shares.append(routed)
        return out, routed
