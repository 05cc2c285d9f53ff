"""Adapter for UNet models (SD1.x, SD2.x, SDXL and relatives): patches through ComfyUI's ModelPatcher.

scope "attention", "keys/values", "queries" (nodes.placement): each block's self-attention module has
its ``forward`` object-patched. "attention" merges its input (q, k and v come from the merged tokens)
and unmerges after the output projection (rows of U sum to 1, so unmerging commutes with that linear
layer and we do the cheap side); "keys/values" takes keys and values from the merged tokens and
queries from all (nothing to unmerge); "queries" the other way round (the output is unmerged). With
``proportional``, merged keys weigh as the tokens they stand for (toma_core.attention), through the
module's own projections and ComfyUI's attention function. An ``attn1_patch`` put first in the list
tells the patched forward which block call it serves (see ``UNetPatch``).
scope "block": each BasicTransformerBlock's ``forward`` is object-patched: self-attention,
cross-attention and feed-forward all run on merged tokens, and the block's update is unmerged onto the
full-resolution residual stream.
Object patches of a module's ``forward`` leave the module itself untouched, so LoRA keys stay valid.
"""
import functools
import inspect
import logging
import math
import types
import weakref

from .. import placement
from ...toma_core.attention import with_key_bias, without_padding
from ..host import block_patches_of_caller, install_run_hooks, original_attr
from ..runtime import Level, MergeRuntime, hold, holds, unet_level

log = logging.getLogger("ComfyUI-ToMA")

# Why a block call the node would merge runs unmerged (MergeRuntime.unmerged: the run report counts them)
OTHER_TOKENS = "another patch's tokens"  # another node changed the block's tokens or keys first
OTHER_ATTENTION = "another patch's attention"  # another node replaced the block's self-attention
OTHER_CODE = "another patch's code"  # scope block: the block runs another node's patches on its full tokens

LEVEL_CHOICES = ("auto", "auto+next", "all", "1", "2", "4", "1,2", "2,4")


def transformer_blocks(diffusion_model):
    """[(dotted path relative to the BaseModel, block)] of every BasicTransformerBlock in the UNet."""
    from comfy.ldm.modules.attention import BasicTransformerBlock

    # a compiled diffusion model left in place by an earlier clone's object patch (the pinned tree keeps
    # object patches applied after sampling) names its modules under "_orig_mod.": paths must not
    diffusion_model = getattr(diffusion_model, "_orig_mod", diffusion_model)
    return [(f"diffusion_model.{name}", m) for name, m in diffusion_model.named_modules()
            if isinstance(m, BasicTransformerBlock)]


def attention_levels(diffusion_model) -> list[int]:
    """Downsample factors (1, 2, 4, ...) of the UNet levels that hold transformer blocks, sorted."""
    from comfy.ldm.modules.attention import SpatialTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import Downsample

    levels, ds = set(), 1
    for block in getattr(diffusion_model, "input_blocks", None) or []:
        for layer in block:
            if isinstance(layer, Downsample):
                ds *= 2
            elif isinstance(layer, SpatialTransformer):
                levels.add(ds)
    if any(isinstance(layer, SpatialTransformer) for layer in getattr(diffusion_model, "middle_block", None) or []):
        levels.add(ds)
    return sorted(levels)


def resolve_levels(choice, available: list[int]) -> frozenset[int]:
    """The downsample factors to merge: ``choice`` is one of LEVEL_CHOICES or a set of factors."""
    if not isinstance(choice, str):
        return frozenset(int(v) for v in choice)
    if choice == "auto":
        return frozenset(available[:1])
    if choice == "auto+next":
        return frozenset(available[:2])
    if choice == "all":
        return frozenset(available)
    try:
        return frozenset(int(v) for v in choice.split(","))
    except ValueError:
        raise ValueError(f"levels must be one of {', '.join(LEVEL_CHOICES)} or a comma list of downsample "
                         f"factors; got {choice!r}") from None


def token_grid(n_tokens: int, transformer_options) -> tuple[int, int, int] | None:
    """(h, w, downsample) of the token grid of this block call, or None when ``n_tokens`` tokens are not
    the grid of a UNet level. Current ComfyUI gives the exact shape (``activations_shape``) and nothing
    else is guessed where it does; the March-2024 tree gives only the latent shape, from which the grid
    is derived the way ToMe does (Downsample is a stride-2 conv with padding 1, so sizes round up)."""
    shape = transformer_options.get("activations_shape")
    latent = transformer_options.get("original_shape")
    if latent is None:
        return None
    if shape is not None:
        h, w = int(shape[-2]), int(shape[-1])
        return (h, w, max(1, round(latent[-2] / h))) if h * w == n_tokens else None
    H, W = int(latent[-2]), int(latent[-1])
    ds = max(1, math.ceil(math.sqrt(H * W // n_tokens)))
    h, w = -(-H // ds), -(-W // ds)
    if h * w != n_tokens:
        return None
    return h, w, ds


# Patch lists that make another node's code run inside a transformer block: with scope "block" it would
# see merged tokens it did not expect.
BLOCK_PATCH_LISTS = ("attn1_patch", "attn1_output_patch", "attn2_patch", "attn2_output_patch", "middle_patch")


def replaced_attention(transformer_options) -> list[str]:
    """Which of this block's attentions another node replaced ("attn1", "attn2"). Keys are matched as
    ComfyUI matches them: (block name, id, index inside the SpatialTransformer), then (block name, id)."""
    block = transformer_options.get("block")
    if block is None:
        return []
    keys = (tuple(block) + (transformer_options.get("block_index", 0),), tuple(block))
    replace = transformer_options.get("patches_replace") or {}
    return [name for name in ("attn1", "attn2") if any(k in (replace.get(name) or {}) for k in keys)]


class UNetPatch:
    """Everything one patched UNet needs: the runtime and the levels to merge.

    Scope "attention" merges inside each block's self-attention module: ``observe`` (the first
    attn1_patch) notes the block call's options and token shape, and the object-patched ``attn1.forward``
    merges its input, runs the attention and unmerges the output. Other nodes' attn1 patches thus run
    outside ToMA's merge on both sides (their input patches before, their output patches after),
    whatever their order; a block whose attention another node replaced (SAG, PAG) never calls
    ``attn1.forward`` and stays unmerged; tokens another patch already changed (HyperTile, ToMe, a ToMA
    node nearer the sampler) no longer have the shape ``observe`` saw, and ToMA leaves them alone.
    """

    def __init__(self, runtime: MergeRuntime, levels: frozenset[int], scope: str = placement.ATTENTION,
                 proportional: bool = False):
        self.runtime = runtime
        self.levels = levels
        self.scope = scope
        self.proportional = proportional
        # (options, token shape, whether it arrived as self-attention) noted by observe, taken by attn1.forward
        self.current = None

    def __deepcopy__(self, memo):
        # observe (in model_options, deep-copied by every clone) and the object-patched forwards (shared
        # by clones) must reach one object
        return self

    def plan_for(self, x, features, transformer_options, arrived, keys_changed=False):
        """The plan for this block call, or None to run it unmerged. ``arrived``: the (batch, tokens)
        shape the block's input had before any attention patch; ``keys_changed``: another node changed the
        self-attention's keys (the block then runs unmerged, and the stats say who took it)."""
        grid = token_grid(arrived[1], transformer_options)
        if grid is None or grid[2] not in self.levels:
            return None
        level = unet_level(*grid)
        if tuple(x.shape[:2]) != tuple(arrived) or keys_changed:
            taker = self.runtime.leave(level, transformer_options, lambda: self.token_changer(level))
            self.runtime.unmerged(OTHER_TOKENS, "%s leaves level %s unmerged: %s changed its tokens or keys first (%d "
                                  "tokens in batch %d instead of %d in batch %d)", self.runtime.name, level, taker,
                                  x.shape[1], x.shape[0], arrived[1], arrived[0])
            return None
        block = (tuple(transformer_options.get("block") or ()), transformer_options.get("block_index", 0))
        return self.runtime.plan(level, block, x, features, transformer_options)

    def token_changer(self, level: Level) -> str:
        """Which node changed this block's tokens before its self-attention, in words: the other nodes'
        attn1 patches of this block call (HyperTile, ComfyUI's ToMe, ...), else a node of this pack nearer
        the sampler that merged the level (it merges inside the attention, before this node's merge)."""
        attn1 = (block_patches_of_caller() or {}).get("attn1_patch") or []
        others = [fn for fn in attn1 if not isinstance(getattr(fn, "__self__", None), UNetPatch)]
        if others:
            return " and ".join(dict.fromkeys(patch_node_name(fn) for fn in others))
        nearer = [fn.__self__.runtime.name for fn in attn1 if isinstance(getattr(fn, "__self__", None), UNetPatch)
                  and fn.__self__ is not self and fn.__self__.runtime.merges(level)]
        if nearer:
            return f"the {nearer[0]} node nearer the sampler"
        return "another node's attention patch"

    # scope "attention" -------------------------------------------------------------------------
    def observe(self, n, context_attn1, value_attn1, extra_options):
        if self.current is not None:  # the last block called no attn1.forward: another node replaced it
            options, arrived, _ = self.current
            grid = token_grid(arrived[1], options)
            if grid is not None and grid[2] in self.levels:
                # SAG and PAG replace it; a nearer token merge node with proportional attention runs it itself
                level = unet_level(*grid)
                taker = self.runtime.leave(level, options, lambda: self.token_changer(level))
                self.runtime.unmerged(OTHER_ATTENTION, "%s leaves level %s unmerged in the blocks whose "
                                      "self-attention %s replaced (SAG, PAG, or a nearer token merge node)",
                                      self.runtime.name, level, taker)
        self.current = (extra_options, tuple(n.shape[:2]), context_attn1 is None or context_attn1 is n)
        return n, context_attn1, value_attn1

    def attention_forward(self, original):
        owner = weakref.ref(self)  # object patches outlive the MODEL on the BaseModel: see runtime.hold

        def forward(attention, x, context=None, value=None, mask=None, **kwargs):
            patch = owner()
            call = None
            if patch is not None:
                call, patch.current = patch.current, None
            self_attention = (context is None or context is x) and (value is None or value is x)
            # attending to a context instead (disable_self_attn), only the queries can merge; a call that
            # arrived as self-attention but reaches us otherwise had its tokens or keys changed by another
            # node (HyperTile, ComfyUI's ToMe, a nearer token merge node): plan_for says so and steps aside
            changed = call is not None and call[2] and not self_attention
            mergeable = patch is not None and (self_attention or patch.scope != placement.KEYS_VALUES)
            plan = (None if call is None or mask is not None or not (mergeable or changed)
                    else patch.plan_for(x, lambda: x, *call[:2], keys_changed=changed))
            if plan is None:
                return original(x, context=context, value=value, mask=mask, **kwargs)
            with patch.runtime.stages.stage("merge"):
                merged = plan.merge(x)
            if not self_attention:
                out = original(merged, context=context, value=value, **kwargs)
                with patch.runtime.stages.stage("unmerge"):
                    return plan.unmerge(out)
            queries, keys = {placement.ATTENTION: (merged, merged), placement.KEYS_VALUES: (x, merged),
                             placement.QUERIES: (merged, x)}[patch.scope]
            if patch.proportional:
                out = proportional_attention(attention, queries, keys, plan.log_mass, kwargs, patch.runtime.notice)
            else:
                out = original(queries, context=keys, value=keys, **kwargs)
            if queries is x:
                return out
            with patch.runtime.stages.stage("unmerge"):
                return plan.unmerge(out)

        forward.toma_unet = (original, owner)
        return forward

    # scope "block" -----------------------------------------------------------------------------
    def block_forward(self, original):
        owner = weakref.ref(self)  # object patches outlive the MODEL on the BaseModel: see runtime.hold

        def forward(block, x, context=None, transformer_options={}):
            patch = owner()
            if patch is None or patch.steps_aside(transformer_options):
                return original(x, context=context, transformer_options=transformer_options)
            plan = patch.plan_for(x, lambda: block.norm1(x), transformer_options, tuple(x.shape[:2]))
            if plan is None:
                return original(x, context=context, transformer_options=transformer_options)
            with patch.runtime.stages.stage("merge"):
                xm = plan.merge(x)
            # the block gets its own copy: the March-2024 block adds its attention outputs in place
            ym = original(xm.clone(), context=context, transformer_options=transformer_options)
            with patch.runtime.stages.stage("unmerge"):
                return plan.unmerge_update(x, xm, ym)

        forward.toma_unet = (original, owner)
        return forward

    def steps_aside(self, transformer_options) -> bool:
        """Scope "block": whether this block runs code of another node that expects its full tokens."""
        patches = transformer_options.get("patches") or {}
        lists = [name for name in BLOCK_PATCH_LISTS if patches.get(name)]
        replaced = replaced_attention(transformer_options)
        if not lists and not replaced:
            return False
        self.runtime.unmerged(OTHER_CODE, "%s (scope block) leaves the blocks with %s of another node unmerged: "
                              "that code expects the block's full tokens", self.runtime.name,
                              " and ".join([f"{name} patches" for name in lists] +
                                           [f"an {name} replacement" for name in replaced]))
        return True


@functools.lru_cache(maxsize=8)
def accepted_keywords(fn) -> frozenset | None:
    """The keyword names ``fn`` takes (None: any, it has **kwargs), through any ``functools.wraps`` chain
    (``inspect.signature`` follows ``__wrapped__``); read once per function, not per block call (the
    March-2024 attention functions take neither attn_precision nor transformer_options)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


# attention functions that refused keywords their signature seemed to take: a bare ``(*args, **kwargs)``
# wrapper another node put around ComfyUI's ``optimized_attention`` hides what it finally calls
refused_keywords: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def call_attention(fn, q, k, v, heads, extra: dict, notice):
    """``fn(q, k, v, heads, **extra)`` with only the keywords ``fn`` takes. Where ``fn`` hides its
    signature and refuses one with a TypeError, the call is made once more without the extra keywords and
    ``notice`` says so (once); that function is then always called without them."""
    accepted = accepted_keywords(fn)
    refused = refused_keywords.get(fn, frozenset())
    extra = {key: value for key, value in extra.items()
             if (accepted is None or key in accepted) and key not in refused}
    if not extra:
        return fn(q, k, v, heads)
    try:
        return fn(q, k, v, heads, **extra)
    except TypeError as error:
        if not any(repr(key) in str(error) or key in str(error) for key in extra):
            raise
        refused_keywords[fn] = refused | frozenset(extra)
        notice("ComfyUI's attention function %s (wrapped by another node) refused the keywords %s; "
               "proportional attention calls it without them", getattr(fn, "__qualname__", fn),
               ", ".join(sorted(extra)))
        return fn(q, k, v, heads)


def proportional_attention(attention, queries, keys, log_mass, kwargs, notice):
    """What ComfyUI's CrossAttention ``attention`` computes for ``queries`` over ``keys`` (and values
    from them), with each key's logits raised by its ``log_mass`` (B, N'): its own projections, the bias
    in an extra head channel (toma_core.attention), ComfyUI's attention function (so fused kernels, and
    attention overrides in ``transformer_options``, still apply). ``notice``: the runtime's log-once."""
    from comfy.ldm.modules import attention as comfy_attention

    q, k, v = attention.to_q(queries), attention.to_k(keys), attention.to_v(keys)
    heads, d = attention.heads, q.shape[-1] // attention.heads
    q, k, v = with_key_bias(q, k, v, log_mass, heads)
    extra = {"attn_precision": getattr(attention, "attn_precision", None),
             "transformer_options": kwargs.get("transformer_options", {})}
    out = call_attention(comfy_attention.optimized_attention, q, k, v, heads, extra, notice)
    return attention.to_out(without_padding(out, heads, d))


def patch_node_name(fn) -> str:
    """The node an attention patch function comes from: nodes define their patch functions inside their
    own methods ("HyperTile.patch.<locals>.hypertile_in", "TomePatchModel.execute.<locals>.tomesd_m"),
    so the first part of its qualified name is the node's class name; else that name as it is."""
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return qualname.split(".")[0] if ".<locals>." in qualname else qualname


# What every adapter offers (nodes/adapters/__init__.py): its name in messages, and the names users know
# its models by.
name = "SD1.x/SD2.x/SDXL UNet"
names = ("SD1.x", "SD2.x", "SDXL")
placements = placement.UNET_PLACEMENTS  # the scopes a UNet honours (placement.settle)
fallback = placement.UNET_AUTO
needs_attention_override = ()  # its attention scopes object-patch the self-attention: no host override needed
own_sampler = False  # its models sample in ComfyUI's sampler (nodes/patching.py)


def supports(model) -> bool:
    dm = getattr(model.model, "diffusion_model", None)
    return dm is not None and hasattr(dm, "input_blocks") and bool(transformer_blocks(dm))


def preset_kind(model) -> str:
    """"sd1" for a UNet with attention at full resolution (SD1.x/SD2.x), "sdxl" for one without."""
    return "sd1" if 1 in attention_levels(model.model.diffusion_model) else "sdxl"


def forward_before_ours(m, key):
    """What ``key`` of the BaseModel is for ``m`` before our patch, less any forward of ours that a MODEL
    ``m`` does not hold left applied there (object patches stay applied after sampling): chained, it would
    run as one more no-op wrapper each time a node patches again, and under torch.compile its owner, dying
    between runs, fails a guard (a recompile)."""
    current = original_attr(m, key)
    while (ours := getattr(getattr(current, "__func__", None), "toma_unet", None)) is not None:
        original, owner = ours
        if owner() is not None and holds(m, owner()):
            break
        current = original
    return current


def patch(model, runtime: MergeRuntime, where: placement.Placement):
    """The patched clone of ``model`` (a ComfyUI ModelPatcher), merging at ``where``'s levels (a
    LEVEL_CHOICES string or a set of downsample factors) with its scope."""
    if not runtime.strategy.patches_unets:
        log.warning("ToMA: %s is for DiTs and does not patch UNets; %s (%s) returned unpatched (use the ToMA node on "
                    "UNets)", runtime.name, type(model.model).__name__, name)
        return model
    scope = where.scope
    dm = model.model.diffusion_model
    available = attention_levels(dm)
    levels = resolve_levels(where.levels, available)
    if not levels & set(available):  # e.g. ToMeSD's max_downsample 1 on SDXL: a silent no-op otherwise
        log.warning("ToMA: %s merges nothing: this UNet has attention only at downsample %s, none of %s",
                    runtime.name, ", ".join(map(str, available)), ", ".join(map(str, sorted(levels))))
    patch = UNetPatch(runtime, levels, scope, where.proportional)
    m = model.clone()
    hold(m, patch)
    if scope != placement.BLOCK:
        patches = m.model_options.setdefault("transformer_options", {}).setdefault("patches", {})
        patches["attn1_patch"] = [patch.observe] + patches.get("attn1_patch", [])  # first: sees the block's tokens
        for path, block in transformer_blocks(dm):
            key = f"{path}.attn1.forward"
            forward = patch.attention_forward(forward_before_ours(m, key))
            m.add_object_patch(key, types.MethodType(forward, block.attn1))
    else:
        for path, block in transformer_blocks(dm):
            key = f"{path}.forward"
            m.add_object_patch(key, types.MethodType(patch.block_forward(forward_before_ours(m, key)), block))
    install_run_hooks(m, runtime)
    log.info("ToMA: %s patched on UNet levels %s (scope %s%s)", runtime.name,
             ", ".join(f"1/{d}" for d in sorted(levels)) or "none", scope,
             ", proportional attention" if patch.proportional else "")
    return m
