"""A DiT family is a declaration (``DiTFamily``), and one generic ``supports``/``patch`` serves them all.

A declaration says, as data: the diffusion model class to detect (by import path, imported only when a
model is looked up: older ComfyUI trees lack it, and then the family is simply absent), its block
groups (where the blocks are, how each is intercepted, the fraction never merged), the ``DiTPatch``
class that reads its block calls (which tokens are the image or video grid; text, references, audio and
first frames with their own timestep stay whole), the ``LayoutStash`` class and the wrapper through
which the blocks learn the call's token grid, the placements it honours, and why a model of the class
may still not be served. ``nodes/adapters/families.py`` holds the rows.

Interception:
- ``REPLACE``: ComfyUI's "dit" block-replace patches (``transformer_options["patches_replace"]["dit"]``),
  keyed by (hook, block index).
- ``OBJECT_PATCH``: models that call their blocks directly (Lumina 2's NextDiT) get each block's
  ``forward`` object-patched, as the UNet blocks are.
- The attention override of scopes "attention" and "keys/values" is a placement (``placements``), not an
  interception: the block's patch hands the block an ``optimized_attention_override``
  (``attention_override.MergedAttention``, ``attention_override.MergedKeysValues``). On a host without one,
  ``placement.settle`` has already made the scope "block" (``needs_attention_override``).
- Block identity: each block's patch knows its block (a ``BlockPatch``, or the object-patched forward
  made for it), and passes it to ``MergeRuntime.plan``: per-block plans and shared destinations.

Stacked token merge nodes: the nearer node's patch replaces an earlier node's patch of the same block
(that node's runtime is found through the patch), so the node nearer the sampler merges where both
would, as on UNets; the earlier node's stats name the node that took its blocks (``DiTPatch.taken_from``
-> ``MergeRuntime.leave``). Other nodes' replace patches keep their blocks.
"""
import importlib
import logging
import operator
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .. import placement
from ..host import WRAPPER_KEY, install_run_hooks, original_attr, sparse_attention_min_tokens
from ..runtime import MergeRuntime
from ..runtime.malloc_graph import runs_as_cuda_graph, unless_graphed
from . import declared_attention
from .dit import DiTPatch
from .layout import LayoutStash, merged_blocks

log = logging.getLogger("ComfyUI-ToMA")

REPLACE = "dit replace patch"
# why a family whose blocks that node patches is not served beside it (DiTFamily.sparse_takes_blocks)
SPARSE_BLOCKS = ("that node runs its attention through block patches of its own (a chunked qkv producer), on the "
                 "blocks ToMA would patch: use one node or the other")
OBJECT_PATCH = "forward object patch"


@dataclass(frozen=True)
class BlockGroup:
    """One group of blocks that merge: ``blocks`` is the diffusion model's attribute that holds them,
    ``hook`` the name of a block's patch point ("dit" replace patches: "double_block", "single_block";
    object patches: the name logs use), ``group`` its role (layout.TWO_STREAM, JOINT, VIDEO: the name plans,
    stats and the merge map use, and the fraction of its first blocks that never merge), ``handler`` the
    family's DiTPatch method that serves a block call (object patches: that makes a layer's patched
    forward from its original)."""

    blocks: str
    hook: str
    group: str
    handler: str

    def merged(self, depth: int) -> range:
        return merged_blocks(depth, self.group)


@dataclass(frozen=True, eq=False)
class DiTFamily:
    """One DiT family, as data (see the module docstring).

    name: in messages and logs. names: what users know its models by, in the node description, README,
    help pages and pyproject.toml (tests/test_family_lists.py). video: whether its grid has frames.
    model_class: "module:Class" of the diffusion model. groups: its BlockGroups. blocks: its DiTPatch
    class. stash: its LayoutStash class, wrapping the first of ``wrappers`` ("DIFFUSION_MODEL": the
    diffusion model's ``_forward``; "APPLY_MODEL": ``BaseModel._apply_model``) the model has.
    patch_size: the diffusion model's attribute path to its patch size, or the size (a model without one). intercept: REPLACE or
    OBJECT_PATCH. placements: the placement.SCOPES it honours. never_merged: the tokens that stay whole,
    in words (the patch log line says them). unserved: diffusion model -> why it is not served, or None.
    read_outside: whether the stash also wraps ``BaseModel._apply_model`` (outside the diffusion model;
    the wrapper inside overrides it where it runs), for nodes that replace the diffusion model's
    ``forward`` itself (TeaCache on Lumina 2, HiDream, LTX-Video): a family whose layout the latent and
    the extra conds tell there. feed_forward: the submodules of a block that run on merged tokens with
    scope feed-forward (placement.FEED_FORWARD, among ``placements`` where this is not empty), each called
    with the block's tokens first; their forwards are object-patched. sparse_takes_blocks: core's Model Sparse
    Attention node runs this family's attention through "dit" block patches of its own (MiniMax-H3's chunked
    qkv producer), which take the blocks ToMA patches: beside it the model is not served (``beside_sparse``)."""

    name: str
    names: tuple[str, ...]
    video: bool
    model_class: str
    groups: tuple[BlockGroup, ...]
    blocks: type = DiTPatch
    stash: type = LayoutStash
    wrappers: tuple[str, ...] = ("DIFFUSION_MODEL",)
    patch_size: str | int = "patch_size"
    intercept: str = REPLACE
    placements: tuple[str, ...] = (placement.BLOCK,)
    never_merged: str = "text"
    unserved: Callable | None = None
    read_outside: bool = False
    feed_forward: tuple[str, ...] = ()
    sparse_takes_blocks: bool = False

    # the scopes that run inside ComfyUI's attention call, through its attention override (placement.settle runs
    # whole blocks instead on a host without one)
    needs_attention_override = (placement.ATTENTION, placement.KEYS_VALUES)
    own_sampler = False  # the model samples in ComfyUI's sampler (nodes/patching.py)

    def preset_kind(self, model) -> str:
        """The kind of model whose preset "auto" means (placement.PRESETS): "video" or "dit"."""
        return "video" if self.video else "dit"

    def model_type(self):
        """The diffusion model class, or None where this ComfyUI has none."""
        module, name = self.model_class.split(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None

    def supports(self, model) -> bool:
        cls = self.model_type()
        dm = getattr(model.model, "diffusion_model", None)
        return cls is not None and isinstance(dm, cls) and all(hasattr(dm, g.blocks) for g in self.groups)

    @property
    def fallback(self) -> str:
        """The placement this family uses where a node's scope is "auto" without a preset, or one it does not
        honour (placement.settle)."""
        return placement.DIT_AUTO if placement.DIT_AUTO in self.placements else placement.BLOCK

    def layout_wrapper(self, model, runtime: MergeRuntime):
        """(wrapper type, key, stash) for ModelPatcher.add_wrapper_with_key around the first of
        ``wrappers`` the model has; None in a host without wrappers, or a model without that call."""
        try:
            from comfy.patcher_extension import WrappersMP
        except ImportError:
            return None
        where = self.wrapper_of(model)
        if where is None or not hasattr(model, "add_wrapper_with_key"):
            return None
        dm = model.model.diffusion_model
        stash = self.stash(wrapped(model, where), self.patch_of(dm), runtime)
        return getattr(WrappersMP, where), WRAPPER_KEY, stash

    def patch_of(self, dm):
        """The patch size of the diffusion model ``dm`` (``patch_size``: the size, or where ``dm`` keeps it)."""
        return self.patch_size if isinstance(self.patch_size, int) else operator.attrgetter(self.patch_size)(dm)

    def wrapper_of(self, model) -> str | None:
        """The first of ``wrappers`` whose call ``model`` has."""
        return next((where for where in self.wrappers if wrapped(model, where) is not None), None)

    def patch(self, model, runtime: MergeRuntime, where: placement.Placement):
        """The patched clone, merging with ``where``'s scope, the one that runs on this host (its levels are a
        UNet notion: a DiT has one token grid); ``model`` itself, unpatched with a log message, when the model,
        the strategy or the host cannot be served."""
        dm = model.model.diffusion_model
        why = self.unserved(dm) if self.unserved is not None else None
        if why is not None:
            log.warning("ToMA: %s (%s) is not served: %s; returned unpatched", type(dm).__name__, self.name, why)
            return model
        name = type(model.model).__name__
        if self.sparse_takes_blocks and sparse_attention_min_tokens(model) is not None:
            log.warning("ToMA: %s (%s) beside core's Model Sparse Attention is not served: %s; returned unpatched",
                        type(dm).__name__, self.name, SPARSE_BLOCKS)
            return model
        if not runtime.strategy.patches_dits:
            log.warning("ToMA: %s is a UNet baseline and does not patch DiTs; %s (%s) returned unpatched (use "
                        "the ToMA node on DiTs)", runtime.name, name, self.name)
            return model
        stash = self.layout_wrapper(model, runtime)
        if stash is None:
            log.warning("ToMA: this ComfyUI has no model wrapper to read the token grid from; %s returned "
                        "unpatched", name)
            return model
        scope, declared = declared_attention.settle(where.scope, dm, self, runtime)
        proportional = where.proportional and scope in placement.KEYS_MERGED
        if where.proportional and not proportional:  # the declared attention took the override's scope
            runtime.caveat(placement.proportional_not_honoured(self, scope))
        blocks = self.blocks(runtime, scope, proportional, self.feed_forward)
        blocks.declared_attention = declared
        blocks.read_model(dm)
        if proportional and scope == placement.ATTENTION:
            runtime.caveat(f"proportional attention is honoured only in {self.name}'s double blocks (scope "
                           "attention); its single blocks run whole on merged tokens without it")
        m = model.clone()
        intercept = self.replace_blocks if self.intercept == REPLACE else self.object_patch_blocks
        merged, left, retaken = intercept(m, dm, blocks)
        m.add_wrapper_with_key(*stash)
        if self.read_outside and self.wrapper_of(model) != "APPLY_MODEL":
            from comfy.patcher_extension import WrappersMP

            outside = self.stash(wrapped(model, "APPLY_MODEL"), self.patch_of(dm), runtime)
            m.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, outside)
        install_run_hooks(m, runtime)
        if self.sparse_takes_blocks:
            runtime.run_checks.append(lambda patcher: self.beside_sparse(patcher, blocks))
        if left:
            log.info("ToMA: %s left unmerged (already patched by another node)", ", ".join(left))
        for previous, taken in retaken.items():
            log.info("ToMA: %s, nearer the sampler, merges %s in place of the %s node before it", runtime.name,
                     ", ".join(taken), previous.name)
        log.info("ToMA: %s patched on %s (%s): %d of %d blocks merge (%s never)", runtime.name, name, self.name,
                 len(merged), sum(len(getattr(dm, g.blocks)) for g in self.groups), self.never_merged)
        return m

    def beside_sparse(self, patcher, blocks: DiTPatch) -> str | None:
        """Why the MODEL being sampled, ``patcher``, merges nothing although ``blocks`` were patched: core's
        Model Sparse Attention, applied after ToMA, replaced every block patch of this family's; None if not."""
        if sparse_attention_min_tokens(patcher) is None:
            return None
        patches = patcher.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
        if any(isinstance(p, BlockPatch) and p.blocks is blocks for p in patches.values()):
            return None
        return (f"{self.name} beside core's Model Sparse Attention merges nothing: {SPARSE_BLOCKS}, and that node, "
                "applied after ToMA, replaced all of them")

    def replace_blocks(self, m, dm, blocks: DiTPatch):
        """Set the "dit" replace patches of the merged blocks on ``m``: (merged, left to other nodes,
        {earlier token merge node's runtime: blocks taken from it})."""
        taken = m.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
        merged, left, retaken = [], [], {}
        for g in self.groups:
            for i in g.merged(len(getattr(dm, g.blocks))):
                earlier = taken.get((g.hook, i))
                if earlier is not None:
                    previous = token_merge_node_of(earlier)
                    if previous is None:
                        left.append(f"{g.hook} {i}")
                        continue
                    retaken.setdefault(previous, []).append(f"{g.hook} {i}")
                    blocks.took(g.group, previous)
                patch = BlockPatch(blocks, g.handler, (g.hook, i), getattr(dm, g.blocks)[i])
                m.set_model_patch_replace(patch, "dit", g.hook, i)
                self.patch_companions(m, dm, g, i, blocks)
                merged.append(f"{g.hook} {i}")
        return merged, left, retaken

    def patch_companions(self, m, dm, g: BlockGroup, i: int, blocks: DiTPatch) -> None:
        """Object-patch the ``forward`` of the submodules ``blocks.companions`` names inside block ``i`` of
        ``g`` (LTX-2's video-to-audio attention: its video keys are unmerged there); an earlier token merge
        node's patched forward is replaced by one around the original."""
        for name in blocks.companions + blocks.feed_forward:
            key = f"diffusion_model.{g.blocks}.{i}.{name}.forward"
            current = original_attr(m, key)
            earlier = getattr(getattr(current, "__func__", None), "token_merge", None)
            module = operator.attrgetter(f"{g.blocks}.{i}.{name}")(dm)
            make = blocks.merged_forward if name in blocks.feed_forward else blocks.companion_forward
            m.add_object_patch(key, types.MethodType(make(name, current if earlier is None else earlier[0]), module))

    def object_patch_blocks(self, m, dm, blocks: DiTPatch):
        """Object-patch the ``forward`` of the merged blocks on ``m``; an earlier token merge node's patched
        forward is replaced by one around the original. Same return as ``replace_blocks``."""
        merged, retaken = [], {}
        for g in self.groups:
            layers = getattr(dm, g.blocks)
            for i in g.merged(len(layers)):
                key = f"diffusion_model.{g.blocks}.{i}.forward"
                current = original_attr(m, key)
                earlier = getattr(getattr(current, "__func__", None), "token_merge", None)
                if earlier is not None:
                    current, previous = earlier
                    retaken.setdefault(previous, []).append(f"{g.hook} {i}")
                    blocks.took(g.group, previous)
                forward = unless_graphed(getattr(blocks, g.handler)(current, (g.hook, i)))
                m.add_object_patch(key, types.MethodType(forward, layers[i]))
                merged.append(f"{g.hook} {i}")
        return merged, [], retaken


def wrapped(model, where: str):
    """The function the ``where`` executor of ``model`` runs ("DIFFUSION_MODEL": the diffusion model's
    ``_forward``; "APPLY_MODEL": ``BaseModel._apply_model``), or None where it has none."""
    owner, name = ((model.model.diffusion_model, "_forward") if where == "DIFFUSION_MODEL"
                   else (model.model, "_apply_model"))
    return getattr(owner, name, None)


class BlockPatch:
    """The "dit" replace patch of one block: ``blocks``' handler named ``handler`` (DiTPatch.double_block,
    ...), called with the block's identity ``block`` ((hook, index)), which reaches MergeRuntime.plan; the block
    ``module`` itself runs unmerged where the host replays it from a CUDA graph (malloc_graph.py)."""

    def __init__(self, blocks: DiTPatch, handler: str, block: tuple, module=None):
        self.blocks, self.handler, self.block = blocks, handler, block
        # weakly: a deep copy (every clone's) keeps the reference, never copies the block
        self.module = weakref.ref(module) if module is not None else lambda: None

    def __call__(self, args: dict, extras: dict) -> dict:
        if runs_as_cuda_graph(self.blocks.runtime, self.module()):
            return extras["original_block"](args)
        return getattr(self.blocks, self.handler)(args, extras, block=self.block)


def token_merge_node_of(patch):
    """The runtime of the token merge node whose block patch ``patch`` (a "dit" replace patch) is, or
    None for another node's patch."""
    owner = patch.blocks if isinstance(patch, BlockPatch) else getattr(patch, "__self__", None)
    return owner.runtime if isinstance(owner, DiTPatch) else None
