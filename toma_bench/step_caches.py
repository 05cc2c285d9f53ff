"""The step caches users stack with ToMA, in one place: apply one by name and threshold, count which model
calls ran under it, and say what a call it skips computes instead (for the cost model).

- core's **EasyCache** and **LazyCache** (``comfy_extras/nodes_easycache.py``, every ComfyUI since late 2025:
  v0.3.64 and v0.33.0 here), with start 0.15 and end 0.95 (their nodes' defaults). Both skip the whole model
  call: the change of the call's input since the last call that ran (on every 8th row and column), scaled
  by the output's last change rate, is summed; while the sum stays under the threshold the call returns its
  input plus the last cached difference (output - input). EasyCache wraps the diffusion model, per
  conditioning; LazyCache the sampler's noise prediction.
- **TeaCache** and **MagCache**, their packs' code from mirrors (toma_bench.pack_source), at their nodes'
  defaults but the threshold. Both run the model's embeddings and final layer on every call and skip the
  blocks: TeaCache when the first block's modulated input changed (rel. L1 through a polynomial calibrated
  on the real model) by less than its threshold since the last call that ran, and adds the last residual
  of the blocks; MagCache when the accumulated error of its calibrated magnitude ratios stays under its
  threshold (at most K calls in a row), and adds the last residual. Neither has a calibration for a proxy:
  their coefficients and ratios are the real models' (FLUX.1-dev's, Wan 2.1 14B's), applied to the proxy's
  numbers as they are. The MagCache mirror has no calibration node, so no proxy calibration was made.

``apply(name, model, threshold, kind)`` -> the MODEL with the cache (``kind``: the proxy's model kind,
flux or wan, which picks TeaCache's and MagCache's model_type). ``counted(model)`` records, per sampler
step, whether the model's blocks ran (the cache did not skip the call). ``skipped_call(name, x, ...)`` and
``ran_call(name, x, out)`` run, on the meta device under the cost model's recording, what the cache computes
on a call it skips and what it adds to a call that runs.
"""
import contextlib
import functools
import importlib
from typing import Callable

import torch

from . import pack_source

CORE = ("EasyCache", "LazyCache")
PACKED = {"TeaCache": "teacache", "MagCache": "magcache"}
NAMES = CORE + tuple(PACKED)
DEFAULT_THRESHOLD = {"EasyCache": 0.2, "LazyCache": 0.2, "TeaCache": 0.4, "MagCache": 0.06}
START, END = 0.15, 0.95  # core caches' window: their nodes' defaults
SUBSAMPLE = 8  # core caches measure change on every 8th row and column (their nodes' subsample_factor)
# the pack caches' model_type per proxy kind: the real-size model the proxy's speed axis prices
MODEL_TYPE = {"flux": "flux", "wan": "wan2.1_t2v_14B"}
# what TeaCache and MagCache keep on the diffusion model between calls, and at times between runs: cleared
# before each run (they clear it themselves only at the first step of a run they can tell)
STATE = ("teacache_state", "magcache_state", "accumulated_err", "accumulated_ratio", "accumulated_rel_l1_distance",
         "accumulated_steps", "cnt", "previous_modulated_input", "previous_residual", "residual_cache")


class CacheMissing(RuntimeError):
    """The cache's code is not in this ComfyUI (core's) or no mirror of it loads here (a pack's)."""


def check(name: str, threshold: float) -> None:
    if name not in NAMES:
        raise ValueError(f"step cache: one of {', '.join(NAMES)}, got {name!r}")
    if not 0 < threshold <= 10:
        raise ValueError(f"{name} threshold: above 0 and at most 10, got {threshold}")


@functools.lru_cache(maxsize=None)
def pack_module(name: str):
    """TeaCache's or MagCache's nodes module (the first mirror whose code imports in this ComfyUI)."""
    try:
        return pack_source.load(PACKED[name])
    except (FileNotFoundError, ImportError) as why:
        raise CacheMissing(f"{name}: {why}") from None


def apply(name: str, model, threshold: float | None = None, kind: str = "flux", model_type: str | None = None,
          **options):
    """``model`` with step cache ``name`` at ``threshold`` (None: its node's default); ``model_type``: the pack
    caches' (default: MODEL_TYPE of ``kind``); ``options``: their other inputs (MagCache's magcache_K,
    retention_ratio)."""
    threshold = DEFAULT_THRESHOLD[name] if threshold is None else threshold
    check(name, threshold)
    if name in CORE:
        try:
            module = importlib.import_module("comfy_extras.nodes_easycache")
        except ImportError:
            raise CacheMissing(f"{name}: this ComfyUI has no comfy_extras/nodes_easycache.py (core's step caches "
                               "came with late-2025 trees)") from None
        out = getattr(module, f"{name}Node").execute(model, reuse_threshold=threshold, start_percent=START,
                                                      end_percent=END, verbose=False)
        return out.args[0] if hasattr(out, "args") else out[0]
    if model_type is None and kind not in MODEL_TYPE:
        raise CacheMissing(f"{name} serves DiTs ({', '.join(MODEL_TYPE)}), not {kind}")
    model_type = model_type or MODEL_TYPE[kind]
    module = pack_module(name)
    if name == "TeaCache":
        return module.TeaCache().apply_teacache(model, model_type, threshold, 0.0, 1.0, "cpu")[0]
    mag = {"retention_ratio": 0.2, "magcache_K": 2, **options}  # the node's defaults
    return module.MagCache().apply_magcache(model, model_type, threshold, mag["retention_ratio"],
                                            mag["magcache_K"], 0, -1)[0]


def passes_through(executor, *args, **kwargs):
    return executor(*args, **kwargs)


def without_core_cache(model):
    """A clone of ``model`` whose core cache wrappers pass every call through, under their own keys (so a node
    that looks for a cache finds it, as it does in the proxy run, and merges as it did there); their holder stays
    in the options: what the cost model samples, which skips the calls itself."""
    m = model.clone()
    m.wrappers = {kind: {key: [passes_through] * len(w) if key in ("easycache", "lazycache") else w
                         for key, w in by_key.items()}
                  for kind, by_key in m.wrappers.items()}
    return m


def without_pack_cache(model):
    """A clone of ``model`` whose pack cache (TeaCache, MagCache: a model function wrapper that swaps the
    diffusion model's forward in for each call) is taken off, its options left in transformer_options where a
    node that looks for the cache finds them (as it does in the proxy run): what the cost model samples."""
    m = model.clone()
    m.model_options.pop("model_function_wrapper", None)
    return m


def clear_state(model) -> None:
    """TeaCache's and MagCache's state on the diffusion model taken off (the proxy's module is shared by
    every variant of a run)."""
    dm = model.model.diffusion_model
    for key in STATE:
        if key in vars(dm):
            delattr(dm, key)


def last_block(diffusion_model) -> torch.nn.Module:
    """The last block of the diffusion model's last block list (Flux's last single block, Wan's last block, a
    UNet's last output block): every cache skips it on a call it skips; TeaCache runs the first block's
    modulation even then, so the count is not taken at the first."""
    lists = [m for m in diffusion_model.children() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(diffusion_model).__name__} has no block list to count calls at")
    return lists[-1][-1]


@contextlib.contextmanager
def counted(model):
    """Yields (steps, callback): hand ``callback`` to the sampler; ``steps`` gets, per sampler step, whether the
    model's last block ran in it (cfg 1 or batched: one model call a step)."""
    steps, ran = [], [False]

    def block_ran(*_):
        ran[0] = True

    def callback(*_):
        steps.append(ran[0])
        ran[0] = False

    hooks = [m.register_forward_pre_hook(block_ran) for m in last_block(model.model.diffusion_model).modules()]
    try:
        yield steps, callback
    finally:
        for hook in hooks:
            hook.remove()


# -- what the cost model prices ---------------------------------------------------------------------------
def _kept(t: torch.Tensor) -> torch.Tensor:
    """A tensor the cache kept from an earlier call, shaped as ``t`` (no kernel makes it now)."""
    return t.new_empty(t.shape)


def _window(x: torch.Tensor, read: Callable) -> None:
    """Core caches' two reads of the call's timestep against their window (start, end), on every call."""
    t = x.new_empty(x.shape[0])
    read(t[0] <= t[0])
    read(t[0] > t[0])


def _tokens(x: torch.Tensor, width: int) -> torch.Tensor:
    """The blocks' hidden states of a DiT call on latent ``x`` (2x2 patches, as Flux and Wan patchify)."""
    n = x[0, 0].numel() // 4
    return x.new_empty(x.shape[0], n, width)


def _embed_and_final(x: torch.Tensor, width: int) -> torch.Tensor:
    """The model's embedding of the latent and its final layer, which run on every call (as linears of
    their sizes)."""
    patch = x.shape[1] * 4
    tokens = _tokens(x, width)
    embedded = torch.nn.functional.linear(tokens.new_empty(*tokens.shape[:2], patch), tokens.new_empty(width, patch))
    return torch.nn.functional.linear(embedded, tokens.new_empty(patch, width))


def skipped_call(name: str, x: torch.Tensor, width: int | None, read: Callable) -> torch.Tensor:
    """What cache ``name`` computes in place of a model call it skips, on the call's latent input ``x``
    (``width``: the DiT's hidden width, for TeaCache and MagCache; ``read``: how a value is read back to
    the host, where the cache decides):

    - EasyCache, LazyCache: the change measure (difference, absolute mean, on every 8th row and column; the
      rate's arithmetic), the decision read back, the cached difference added to the input;
    - TeaCache: the embeddings and final layer; the first block's modulation (SiLU, a linear to 6 widths)
      and its modulated input (layer norm, scale, shift), the rel. L1 change (its polynomial is host
      arithmetic on the value read back), the last residual added;
    - MagCache: the embeddings and final layer, the last residual added (its ratios are host arithmetic).
    """
    if name in CORE:
        _window(x, read)
        small = x[..., ::SUBSAMPLE, ::SUBSAMPLE]
        change = (small - _kept(small)).flatten().abs().mean()
        rate = change * change / change
        read(rate + rate < rate)
        return x + _kept(x)
    if width is None:
        raise ValueError(f"{name}: the DiT's hidden width is needed to price a skipped call")
    hidden = _tokens(x, width)
    if name == "TeaCache":
        vec = x.new_empty(x.shape[0], width)
        mod = torch.nn.functional.linear(torch.nn.functional.silu(vec), vec.new_empty(6 * width, width))
        normed = torch.nn.functional.layer_norm(hidden, (width,))
        modulated = normed * (1 + mod[:, None, :width]) + mod[:, None, width:2 * width]
        previous = _kept(modulated)
        read((modulated - previous).abs().mean() / previous.abs().mean())
    hidden = hidden + _kept(hidden)
    _embed_and_final(x, width)
    return hidden


def ran_call(name: str, x: torch.Tensor, out: torch.Tensor, width: int | None, read: Callable) -> None:
    """What cache ``name`` adds to a model call it runs (its bookkeeping; the call itself is the model's):
    core caches the input's and output's change measures, the decision read back, the difference output -
    input and the output's norm kept; TeaCache the modulation and its change (as on a skipped call) and the
    residual kept; MagCache the residual kept."""
    if name in CORE:
        _window(x, read)
        small_x, small_out = x[..., ::SUBSAMPLE, ::SUBSAMPLE], out[..., ::SUBSAMPLE, ::SUBSAMPLE]
        read((small_x - _kept(small_x)).flatten().abs().mean() < 1)
        (small_out - _kept(small_out)).flatten().abs().mean()
        small_x.clone(), small_out.clone()  # the subsampled input and output kept for the next call
        out - x
        out.flatten().abs().mean()
        return
    hidden = _tokens(x, width)
    if name == "TeaCache":
        vec = x.new_empty(x.shape[0], width)
        mod = torch.nn.functional.linear(torch.nn.functional.silu(vec), vec.new_empty(6 * width, width))
        modulated = torch.nn.functional.layer_norm(hidden, (width,)) * (1 + mod[:, None, :width])
        read((modulated - _kept(modulated)).abs().mean() / modulated.abs().mean())
    hidden - _kept(hidden)


def hidden_width(diffusion_model) -> int | None:
    """A DiT's hidden width (Flux's hidden_size, Wan's dim); None for a UNet."""
    return getattr(diffusion_model, "hidden_size", None) or getattr(diffusion_model, "dim", None)


class Stacked:
    """A benchmark row's patch: the cache ``name`` at ``threshold`` on the model, then ``toma`` (a patch, or
    None: the cache alone), as a user puts ToMA after the cache (so a node that looks for a cache on its
    model finds it). ``cost_patch`` is what the cost model runs inside the calls it makes (it skips the
    calls the proxy run skipped itself): ToMA on the model with the cache's own work taken off, what shows
    the cache left where ToMA sees it (core's holder and wrapper keys, a pack cache's options), so the node
    takes the setting it took in the proxy run (a node that stepped aside there is priced as merging nothing)."""

    def __init__(self, name: str, threshold: float, kind: str, toma: Callable | None = None):
        check(name, threshold)
        self.name, self.threshold, self.kind, self.toma = name, threshold, kind, toma

    def __call__(self, model):
        cached = apply(self.name, model, self.threshold, self.kind)
        return cached if self.toma is None else self.toma(cached)

    def cost_patch(self, model):
        if self.name in CORE:
            return without_core_cache(self(model))
        plain = without_pack_cache(apply(self.name, model, self.threshold, self.kind))
        return plain if self.toma is None else self.toma(plain)
