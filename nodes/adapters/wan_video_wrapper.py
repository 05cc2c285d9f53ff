"""Adapter for kijai's ComfyUI-WanVideoWrapper (its nodes: nodes/wan_video_wrapper.py).

The wrapper samples Wan with its own loader, its own sampler loop (``WanVideoSampler``) and its own attention
function; none of ComfyUI's patch points (replace patches, attention overrides, object patches, sampler
wrappers) is used there. What it does use, and what this module relies on (kijai's code of 2026; the pack
imports nothing from it and finds everything on the model it is given):
- WANVIDEOMODEL is a ``ModelPatcher`` whose ``model.diffusion_model`` is the wrapper's ``WanModel``, shared by
  every clone; ``WanVideoSampler`` deep-copies ``model_options["transformer_options"]`` once per run and hands
  the copy to every ``WanModel.forward`` call, with the call's step (``current_step``), its fraction of the
  steps (``current_step_percentage``), ``last_step``, ``is_uncond``, the latents ``x`` and ``seq_len``.
- Each block builds q, k, v ((B, L, heads, head_dim), RoPE applied) and calls ``self.self_attn.forward(q, k, v,
  seq_lens, ...)`` explicitly, which calls the wrapper's ``attention(q, k, v, k_lens=seq_lens, attention_mode,
  heads, ...)`` and its output projection ``o``.

So the node installs two instance-level wrappers on the shared model (never on a class or a module global),
once per ``WanModel`` (``WanModelHooks``): one on ``WanModel.forward``, one on each block's
``self_attn.forward`` (``SelfAttentionHook``). Both are inert unless the run's ``transformer_options`` carries
``OPTIONS_KEY``, which only the node's clone has: plain data (``{"patch": <number>}``, the sampler deep-copies
it), naming the node's ``WrapperPatch`` in a weak table of the hooks; the clone itself holds the patch. A
clone without the key, or the node with ratio 0, samples exactly as the unpatched model; a second node on the
same clone replaces the key (the nearer node merges).

One model call, read top down (``WrapperPatch.model_call``): the run is the deep-copied key (a new one: a new
run, caches cleared, the earlier run's stats sent); the step, its progress (the sampler's own fraction of the
steps, which start and end percent compare with) and, from step 1 on, the run's length come from the call's
arguments, so nothing is read from a tensor; cond and uncond calls, and the context windows of one step (each
window a call: the n-th call of a role in a step is window n), get plans of their own. Inputs whose tokens the
node cannot merge yet (``UNMERGED_INPUTS``, ``UNMERGED_MODES``) run the call unmerged, counted per block in
the stats with the input named. Then the runtime settles the call's decisions (``MergeRuntime.call_at``) and
the model runs; in each merged block (every block but the first 5/38, as on native Wan) the self-attention
hook plans the block's grid from its values (the self-attention sees no block input: the values are a linear
map of it, layer-normalised as the native blocks' inputs are), merges keys and values alike by the plan
(``attention_override.MergedKeysValues``: each merged key is its group's weighted average after RoPE), shortens ``seq_lens``
(the key lengths flash attention's varlen kernel reads) by the tokens merged away, and hands them on:
queries stay whole, nothing is unmerged. With proportional attention the hook calls the wrapper's
``attention()`` itself on heads padded with the key bias (``toma_core.attention``) and applies ``o`` to the
unpadded output; SageAttention takes head dims 64 and 128 only, so under a sage mode proportional attention
is off (said once in the log and the stats).

The wrapper's caches (TeaCache, MagCache, EasyCache) skip the blocks inside ``forward``: a skipped call merges
nothing and counts no merged step (its decisions were settled before it ran: a plan due then is built at the
next call that runs). Block swap moves blocks, not their attributes; per-block torch.compile (the wrapper's
compile settings, blocks only) traces the hook inside each block with no graph break. The sampler's last model
call is not known as such: stats go to the node after every model call of the last step (the last one has the
whole run), and, for a run cut short, when the next run starts.
"""
import inspect
import itertools
import logging
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...toma_core.attention import heads_with_key_bias
from .. import placement
from ..runtime import Level, MergeRuntime
from ..runtime.steps import Where
from .attention_override import MergedKeysValues
from .dit import TOKEN_COUNT
from .layout import VIDEO, merged_blocks
from .wan import per_frame

log = logging.getLogger("ComfyUI-ToMA")

OPTIONS_KEY = "comfyui_toma_wanvideowrapper"  # the run's transformer_options: {"patch": number} (plain data)
HOLD_KEY = "comfyui_toma_wanvideowrapper"  # model_options (not deep-copied per run): this MODEL's WrapperPatches
HOOKS_ATTRIBUTE = "_comfyui_toma_hooks"  # the WanModel's WanModelHooks
name = "WanVideoWrapper"
placements = (placement.KEYS_VALUES,)  # keys and values of the self-attention (placement.settle)
fallback = placement.KEYS_VALUES
needs_attention_override = ()  # its self-attention hook merges them, not ComfyUI's attention override
# WanVideoSampler, not ComfyUI's sampler, runs its model (nodes/patching.py): the steps come from its calls, the
# host-pace rule stays out (runtime/pace.py says why) and the patches are found through ``patches_of``
own_sampler = True

# What the node reads of the wrapper's code, by name (a wrapper without one of them is refused, saying which)
FORWARD_PARAMETERS = ("x", "t", "context", "seq_len", "is_uncond", "current_step", "current_step_percentage",
                      "last_step", "transformer_options")
SELF_ATTENTION_PARAMETERS = ("q", "k", "v", "seq_lens")  # its first parameters, in this order
SELF_ATTENTION_ATTRIBUTES = ("num_heads", "attention_mode", "o")
ATTENTION_PARAMETERS = ("q", "k", "v", "k_lens", "attention_mode", "heads")  # the attention() the block calls
ATTENTION_PASSED_ON = ("frame_tokens", "transformer_options")  # self_attn.forward keywords attention() takes too
# WanModel.forward inputs that add tokens outside the video grid, or attend otherwise, which run unmerged
UNMERGED_INPUTS = {
    "phantom_ref": "Phantom's subject frames",
    "fun_ref": "a Fun model's reference latent",
    "standin_input": "Stand-In's reference image",
    "multitalk_audio": "MultiTalk/InfiniteTalk audio",
    "audio_proj": "FantasyTalking audio",
    "humo_audio": "HuMo audio",
    "s2v_audio_input": "S2V audio",
    "s2v_ref_latent": "S2V's reference latent",
    "attn_cond": "attention conditioning tokens",
    "one_to_all_input": "One-to-All's reference",
    "scail_input": "SCAIL's reference and pose",
    "scail2_input": "SCAIL-2's reference and pose",
    "dual_control_input": "LongVie2's previous latent",
    "lynx_embeds": "Lynx's face and reference",
    "sdancer_input": "SteadyDancer's reference frames",
    "longcat_num_cond_latents": "LongCat's condition latents",
}
UNMERGED_MODES = {"radial_sage_attention": "radial attention", "sageattn_ultravico": "UltraViCo attention"}
SAGE = "sage"  # in the name of every SageAttention mode (sageattn, sageattn_3, sageattn_varlen, ...)
NO_PROPORTIONAL_UNDER_SAGE = ("proportional attention is off under SageAttention (attention mode {}): its kernels "
                              "take head dims 64 and 128 only, and the key bias needs a channel more")
_patch_numbers = itertools.count(1)


def parameters_of(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def diffusion_model_of(model):
    return getattr(getattr(model, "model", None), "diffusion_model", None)


def self_attention_of(block):
    """The block's self-attention module (a block compiled by the wrapper is its ``_orig_mod``)."""
    return getattr(getattr(block, "_orig_mod", block), "self_attn", None)


def unsupported(dm) -> str | None:
    """Why ToMA cannot merge the WanModel ``dm`` of a WANVIDEOMODEL, or None."""
    if dm is None or not isinstance(getattr(dm, "blocks", None), torch.nn.ModuleList) or not len(dm.blocks):
        return "it has no diffusion model with blocks (model.model.diffusion_model.blocks): is it a WANVIDEOMODEL?"
    forward = parameters_of(type(dm).forward)
    if "transformer_options" not in forward:
        return ("its WanModel.forward takes no transformer_options (ComfyUI-WanVideoWrapper of before mid-2025), so "
                "ToMA cannot tell its runs apart; update ComfyUI-WanVideoWrapper")
    lacking = [name for name in FORWARD_PARAMETERS if name not in forward]
    if lacking:
        return f"its WanModel.forward takes no {', '.join(lacking)}, which ToMA reads"
    if len(getattr(dm, "patch_size", ())) != 3:
        return "its WanModel has no 3-D patch_size"
    for index, block in enumerate(dm.blocks):
        attention = self_attention_of(block)
        if attention is None:
            return f"its block {index} has no self_attn"
        missing = [name for name in SELF_ATTENTION_ATTRIBUTES if not hasattr(attention, name)]
        leading = parameters_of(type(attention).forward)[1:len(SELF_ATTENTION_PARAMETERS) + 1]
        if missing or tuple(leading) != SELF_ATTENTION_PARAMETERS:
            return (f"the self_attn of its block {index} has forward({', '.join(leading)}, ...) and lacks "
                    f"{', '.join(missing) or 'nothing'}; ToMA expects forward({', '.join(SELF_ATTENTION_PARAMETERS)}, "
                    f"...) and {', '.join(SELF_ATTENTION_ATTRIBUTES)}")
    return None


def attention_function(dm):
    """The wrapper's ``attention()`` that its self-attention calls (proportional attention calls it on padded
    heads), read from that forward's module; None where there is none of the expected parameters."""
    forward = type(self_attention_of(dm.blocks[0])).forward
    function = getattr(forward, "__globals__", {}).get("attention")
    if not callable(function):
        return None
    try:
        names = parameters_of(function)
    except (TypeError, ValueError):
        return None
    return function if all(name in names for name in ATTENTION_PARAMETERS) else None


class CallLayout(NamedTuple):
    """The tokens of one model call's self-attention: ``lead`` tokens that stay whole (the first latent frame
    under per-frame timesteps), the video grid (frames, h, w) that merges, then zero padding up to ``length``
    (the sampler's ``seq_len``)."""

    lead: int
    grid: tuple
    length: int

    @property
    def tokens(self) -> int:
        frames, h, w = self.grid
        return frames * h * w


def call_layout(arguments: dict, patch_size) -> CallLayout | None:
    """The layout of a WanModel.forward call from its arguments (shapes and host numbers only); None where the
    latents are not one video grid that fits ``seq_len``."""
    x, seq_len = arguments.get("x"), arguments.get("seq_len")
    if not isinstance(x, (list, tuple)) or not x or not torch.is_tensor(x[0]) or x[0].dim() != 4:
        return None
    if any(tuple(u.shape) != tuple(x[0].shape) for u in x) or not isinstance(seq_len, int):
        return None
    frames, h, w = (side // p for side, p in zip(x[0].shape[1:], patch_size))
    lead = 0
    if per_frame(arguments.get("t")):  # the first frame has a timestep of its own (Wan 2.2 5B image-to-video)
        lead, frames = h * w, frames - 1
    layout = CallLayout(lead, (frames, h, w), seq_len)
    return layout if frames > 0 and h > 0 and w > 0 and lead + layout.tokens <= seq_len else None


def given(value) -> bool:
    """Whether a WanModel.forward input is in use (not None, 0, False or empty; a tensor always is)."""
    if value is None:
        return False
    if isinstance(value, (bool, int, float, str, list, tuple, dict)):
        return bool(value)
    return True


class ActiveCall(NamedTuple):
    """What the self-attention hooks read during one merging model call (plain values: traced under
    torch.compile, they become the graph's guards)."""

    patch: "WrapperPatch"
    level: Level
    lead: int
    tokens: int
    length: int
    options: dict  # {"cond_or_uncond": (role, window)}: the plan keys' batch layout (runtime.batch_key)
    proportional: bool


class SelfAttentionHook:
    """Instance-level ``forward`` of one block's self-attention: during a merging model call of the block's
    model (``WanModelHooks.active``), the patch's keys/values merge; otherwise the forward it replaced runs."""

    def __init__(self, hooks: "WanModelHooks", index: int, module):
        self.hooks, self.index, self.module = hooks, index, module
        self.previous = module.forward

    def __call__(self, q, k, v, seq_lens, *args, **kwargs):
        active = self.hooks.active
        if active is None or self.index not in active.patch.blocks:
            return self.previous(q, k, v, seq_lens, *args, **kwargs)
        return active.patch.self_attention(active, self, q, k, v, seq_lens, args, kwargs)


class WanModelHooks:
    """The wrappers on one shared WanModel: its instance-level ``forward`` and a SelfAttentionHook per block,
    and the patches (one per node) its clones name in their transformer_options, held weakly."""

    def __init__(self, dm):
        self.model, self.blocks, self.patch_size = dm, dm.blocks, tuple(dm.patch_size)
        self.previous = dm.forward  # the forward it wraps (the class's, or another instance-level one)
        # the arguments are bound as the WanModel's own forward takes them (what ``unsupported`` checked): a forward
        # wrapped before the node may take (*args, **kwargs)
        self.signature = inspect.signature(type(dm).forward.__get__(dm))
        self.patches = weakref.WeakValueDictionary()  # number -> WrapperPatch
        self.active: ActiveCall | None = None  # the merging model call under way

    def cover_blocks(self) -> None:
        """A SelfAttentionHook on every block's self-attention that has none (blocks the wrapper replaced)."""
        for index, block in enumerate(self.blocks):
            module = self_attention_of(block)
            hook = module.__dict__.get("forward")
            if not (isinstance(hook, SelfAttentionHook) and hook.hooks is self and hook.index == index):
                module.forward = SelfAttentionHook(self, index, module)

    def forward(self, *args, **kwargs):
        options = kwargs.get("transformer_options")
        if options is None and "transformer_options" not in kwargs:
            try:
                options = self.signature.bind(*args, **kwargs).arguments.get("transformer_options")
            except TypeError:
                options = None
        entry = options.get(OPTIONS_KEY) if isinstance(options, dict) else None
        patch = self.patches.get(entry.get("patch")) if isinstance(entry, dict) else None
        if patch is None or self.active is not None:  # not this node's run (or a nested call): as it was
            return self.previous(*args, **kwargs)
        return patch.model_call(self, entry, args, kwargs)


def hooks_of(dm) -> WanModelHooks:
    """The WanModelHooks of ``dm``, installed on first use (instance attributes only)."""
    hooks = dm.__dict__.get(HOOKS_ATTRIBUTE)
    if hooks is None:
        hooks = WanModelHooks(dm)
        setattr(dm, HOOKS_ATTRIBUTE, hooks)
        dm.forward = hooks.forward
    hooks.cover_blocks()
    return hooks


class WrapperPatch:
    """One node's patch of a WANVIDEOMODEL: its runtime, which blocks merge, and the run it is in."""

    def __init__(self, runtime: MergeRuntime, blocks: range, proportional: bool, attention):
        self.runtime, self.blocks, self.proportional = runtime, blocks, proportional
        self.attention = attention  # the wrapper's attention(), for proportional attention (None: not found)
        self.passed_on = () if attention is None else tuple(
            name for name in ATTENTION_PASSED_ON if name in parameters_of(attention))
        self.run_entry = None  # the run's transformer_options entry (a new copy every run)
        self.step = None  # the step of the last model call
        self.calls: dict = {}  # role -> model calls of it so far in this step (context windows)

    def __deepcopy__(self, memo):
        # held in model_options, which ComfyUI deep-copies on every clone: all clones share the patch
        return self

    # -- host side, once per model call -----------------------------------------------------------
    def follow(self, entry: dict, step: int, progress: float) -> None:
        """Run boundaries (a new deep copy of the entry, or a step going back: a new run), the run's length
        (step / its fraction of the steps, from step 1 on) and the calls of the step so far."""
        runtime = self.runtime
        if entry is not self.run_entry or (self.step is not None and step < self.step):
            runtime.end_run()  # a run cut short before its last step reports now
            runtime.begin_run()
            self.run_entry, self.step, self.calls = entry, None, {}
        if step > 0 and progress > 0:
            runtime.learn_total(round(step / progress))
        if step != self.step:
            self.step, self.calls = step, {}

    def role(self, arguments: dict) -> tuple:
        """(cond/uncond, window): the plan keys' layout of this call; the n-th call of a role in a step is its
        n-th context window (or another pass of the step: each gets plans of its own)."""
        context = arguments.get("context")
        role = ("uncond" if arguments.get("is_uncond") else
                "cond" if not isinstance(context, (list, tuple)) or len(context) < 2 else "cond+uncond")
        window = self.calls.get(role, 0)
        self.calls[role] = window + 1
        return role, window

    def unmerged_by(self, arguments: dict, hooks: WanModelHooks) -> tuple[str, str] | None:
        """(reason, message) where this model call runs unmerged: an input whose tokens ToMA does not merge
        yet, or an attention mode it does not run merged; None otherwise."""
        dm = hooks.model
        for name, what in UNMERGED_INPUTS.items():
            if name == "fun_ref" and getattr(dm, "ref_conv", None) is None:
                continue  # only models with a reference conv add its tokens
            if given(arguments.get(name)):
                return f"{what} ({name})", f"the self-attention of model calls given {what} ({name})"
        if arguments.get("current_step") in (getattr(dm, "video_attention_split_steps", None) or ()):
            return ("split self-attention (video_attention_split_steps)",
                    "the self-attention the wrapper splits by prompt (video_attention_split_steps)")
        for mode in self.attention_modes(arguments, hooks):
            if mode in UNMERGED_MODES:
                return f"{UNMERGED_MODES[mode]} ({mode})", f"{UNMERGED_MODES[mode]} (attention mode {mode})"
        return None

    def attention_modes(self, arguments: dict, hooks: WanModelHooks) -> set:
        """The attention modes the merged blocks of this call run: their own, and the run's override
        (WanVideoSetAttentionModeOverride) where it covers the call's step and one of them."""
        modes = {self_attention_of(hooks.blocks[i]).attention_mode for i in self.blocks if i < len(hooks.blocks)}
        override = (arguments.get("transformer_options") or {}).get("attention_mode_override")
        if not isinstance(override, dict) or not isinstance(override.get("mode"), str):
            return modes
        step = arguments.get("current_step")
        if not override.get("start_step", 0) <= step < override.get("end_step", step + 1):
            return modes
        blocks = override.get("blocks")
        try:
            covered = blocks is None or any(i in blocks for i in self.blocks)
        except TypeError:  # not a collection of block indices: as the wrapper would read it, it may cover them
            covered = True
        return modes | {override["mode"]} if covered else modes

    def model_call(self, hooks: WanModelHooks, entry: dict, args: tuple, kwargs: dict):
        runtime = self.runtime
        try:
            bound = hooks.signature.bind(*args, **kwargs)
        except TypeError:
            return hooks.previous(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        step, progress = int(arguments["current_step"]), float(arguments["current_step_percentage"])
        self.follow(entry, step, progress)
        role = self.role(arguments)
        why = self.unmerged_by(arguments, hooks)
        layout = call_layout(arguments, hooks.patch_size)
        if why is None and layout is None:
            why = ("no video grid", "model calls whose latents are no video grid that fits seq_len")
        if why is not None:
            for _ in self.blocks:  # counted per block, as the native nodes count block calls
                runtime.unmerged(why[0], "%s runs %s unmerged: ToMA does not merge those tokens yet",
                                 runtime.name, why[1])
            return self.run_unmerged(hooks, arguments, args, kwargs)
        proportional = self.proportional
        if proportional:
            sage = sorted(mode for mode in self.attention_modes(arguments, hooks) if SAGE in mode)
            if sage:
                runtime.caveat(NO_PROPORTIONAL_UNDER_SAGE.format(", ".join(sage)))
                proportional = False
        hooks.cover_blocks()
        x = arguments["x"]
        call = runtime.call_at(Where(step, progress, runtime.steps.total), x[0].device, len(x), role)
        level = Level(VIDEO, layout.grid)
        runtime.plans.expect(call, [runtime.plans.key(level, index, (len(x), role)) for index in self.blocks])
        hooks.active = ActiveCall(self, level, layout.lead, layout.tokens, layout.length, {"cond_or_uncond": role},
                                  proportional)
        try:
            return runtime.run_call(call, hooks.previous, *args, **kwargs)
        finally:
            hooks.active = None
            if arguments.get("last_step"):
                runtime.report_run()

    def run_unmerged(self, hooks: WanModelHooks, arguments: dict, args: tuple, kwargs: dict):
        try:
            return hooks.previous(*args, **kwargs)
        finally:
            if arguments.get("last_step"):
                self.runtime.report_run()

    # -- inside the blocks (traced under torch.compile) -------------------------------------------
    def self_attention(self, active: ActiveCall, hook: SelfAttentionHook, q, k, v, seq_lens, args, kwargs):
        """One merged block's self-attention: keys and values of the grid merged by the block's plan, the key
        lengths shortened with them, queries whole."""
        runtime, run = self.runtime, hook.previous
        if not all(torch.is_tensor(t) and t.dim() == 4 and t.shape[1] == active.length for t in (q, k, v)):
            runtime.unmerged(TOKEN_COUNT, "%s runs self-attention calls unmerged whose queries, keys and values do "
                             "not all hold the %d tokens of their model call (another input's tokens)", runtime.name,
                             active.length)
            return run(q, k, v, seq_lens, *args, **kwargs)
        B, L, H, D = k.shape
        begin, end = active.lead, active.lead + active.tokens
        values = v[:, begin:end].flatten(2)
        plan = runtime.plan(active.level, hook.index, values, lambda: F.layer_norm(values, values.shape[-1:]),
                            active.options)
        if plan is None:
            return run(q, k, v, seq_lens, *args, **kwargs)
        spans = MergedKeysValues(runtime, [(begin, active.tokens, plan)], L, active.proportional)
        mode = kwargs.get("attention_mode_override") or hook.module.attention_mode
        proportional = active.proportional and self.attention is not None and SAGE not in mode
        if proportional and (args or any(kwargs.get(name) is not None for name in ("lynx_ref_feature", "onetoall_ref"))):
            runtime.unmerged("attention call layout", "%s runs self-attention calls unmerged that carry inputs besides "
                             "q, k, v its proportional attention does not pass on", runtime.name)
            return run(q, k, v, seq_lens, *args, **kwargs)
        with runtime.stages.stage("merge"):
            mk = spans.merged_rows(k.flatten(2), 1).unflatten(2, (H, D))
            mv = spans.merged_rows(v.flatten(2), 1).unflatten(2, (H, D))
            k_lens = None if seq_lens is None else seq_lens - (active.tokens - plan.num_merged)
            if proportional:
                q, mk, mv = heads_with_key_bias(q, mk, mv, spans.key_bias(B, q.device), token_axis=1)
        if not proportional:
            return run(q, mk, mv, k_lens, *args, **kwargs)
        passed = {name: kwargs[name] for name in self.passed_on if name in kwargs}
        out = self.attention(q, mk, mv, k_lens=k_lens, attention_mode=mode, heads=H, **passed)
        out = out.reshape(B, L, H, q.shape[-1])[..., :D]  # (B, L, H, e) or (B, L, H * e) -> the unpadded heads
        return hook.module.o(out.flatten(2))


def patches_of(model) -> list:
    """The WrapperPatches of every ToMA (WanVideoWrapper) node on ``model``, in patch order."""
    return list((getattr(model, "model_options", None) or {}).get(HOLD_KEY, ()))


def patch(model, runtime: MergeRuntime, where: placement.Placement):
    """The patched clone of the WANVIDEOMODEL ``model`` (checked by ``unsupported`` first): the keys and
    values of every merged block's self-attention merged as ``where`` says."""
    dm = diffusion_model_of(model)
    attention = attention_function(dm)
    if where.proportional and attention is None:
        runtime.caveat("proportional attention is off: the self-attention of this WanVideoWrapper calls no "
                       f"attention({', '.join(ATTENTION_PARAMETERS)}, ...) that ToMA can call itself")
    patch = WrapperPatch(runtime, merged_blocks(len(dm.blocks), VIDEO), where.proportional, attention)
    hooks = hooks_of(dm)
    number = next(_patch_numbers)
    hooks.patches[number] = patch
    patched = model.clone()
    options = patched.model_options.setdefault("transformer_options", {})
    if OPTIONS_KEY in options:
        runtime.caveat("replaces the ToMA (WanVideoWrapper) node before it on this model (the nearer node merges)")
    options[OPTIONS_KEY] = {"patch": number}
    patched.model_options[HOLD_KEY] = patches_of(patched) + [patch]
    return patched
