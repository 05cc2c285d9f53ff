"""What every DiT adapter shares: ``DiTPatch``, the "dit" block-replace patches around the blocks that see the
image tokens of a model call (current ComfyUI only: the March-2024 tree has no DiT). Token layouts live in
``layout``, the attention overrides in ``attention_override``; docs/architecture.md, "DiT adapters", says what
runs merged, which blocks, how plans are shared and how sequence-parallel slabs merge."""
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...toma_core.tiles import Slab
from ..placement import ATTENTION, BLOCK, FEED_FORWARD, KEYS_VALUES
from ..runtime import Level, MergeRuntime
from .attention_override import ATTENTION_OVERRIDE_KEY, MergedAttention, MergedKeysValues
from .layout import (JOINT, LAYOUT_KEY, SLAB_KEY, TWO_STREAM, VIDEO, ImageLayout, SlabLayout, equal_slabs,
                     merged_positions, positions_fit, sequence_parallel_group, splice)

log = logging.getLogger("ComfyUI-ToMA")

# Why a block call the node would merge runs unmerged (MergeRuntime.unmerged: the run report counts them)
NO_LAYOUT = "no token layout"
TOKEN_COUNT = "token count differs from the layout"
POSITIONS = "positions do not fit"
SLAB = "sequence-parallel slab"
# why Wan's slabs step aside at the scopes that merge inside a block: raylight's attention is xfuser's, which takes
# no attention override (keys/values), and attention over every token exchanges whole slabs (feed-forward); whole
# blocks lose much more of the picture (the Wan proxy at 8 frames, 2 clips: the video default 24.52 dB, whole
# blocks r=0.5 18.99 dB, r=0.75 15.57 dB: docs/notebook.md, "Sequence parallelism"), so they are asked for
SLABS_TAKE_BLOCKS = ("merging slabs takes scope block (whole blocks: xfuser's attention takes no attention override, "
                     "which keys/values needs; whole blocks keep less of the picture, so the Advanced node's scope "
                     "block asks for them)")
SPARSE = "left to core's sparse attention"
FEED_FORWARD_COMPILED = "scope feed-forward under torch.compile"
@dataclass(frozen=True)
class MergedSpan:
    """Scope feed-forward's block call under way: its plan, the grid's tokens [start, start + tokens) of its
    sequence of ``length``."""

    plan: object
    start: int
    tokens: int
    length: int


@dataclass(frozen=True)
class BlockCall:
    """One merged block call, as a family's ``DiTPatch.reduced_inputs`` is given it (one value: a new field
    touches no override). ``args``: the block's arguments (full length); ``txt_len``: the text tokens of
    the joint sequence (0 where the text is elsewhere); ``layout``: the call's ImageLayout; ``plan``: the
    image grid's plan; ``reference_plans``: the plans of the leading reference grids of
    ``layout.references`` (None: kept whole; empty for families without reference grids)."""

    args: dict
    txt_len: int
    layout: ImageLayout
    plan: object
    reference_plans: tuple = ()


class DiTPatch:
    """The block patches of one patched DiT clone (signature of ComfyUI's "dit" replace patches:
    ``fn(args, {"original_block": fn}) -> dict`` with full-length tokens in and out).

    A family whose blocks see another layout or other per-token inputs subclasses it and overrides what
    differs: ``fits`` (whether a call's inputs cover its tokens as the family lays them out) and
    ``reduced_inputs`` (those inputs cut to the merged sequence), or the class attributes below.
    scope (the placement's, the one that runs on this host: placement.settle): "block", the whole block on
    merged tokens; "attention", double blocks run whole on full-length tokens with only their joint attention
    merged (``MergedAttention``); "keys/values", every merged block runs whole with only the keys and values of
    its self-attention merged (``MergedKeysValues``); "feed-forward", the block runs whole on every token, the
    submodules ``feed_forward`` names (the family's) on merged tokens (``merged_forward``). proportional: where
    keys merge inside the attention call (attention, keys/values), each merged key weighs as the tokens it
    stands for.

    Beside core's Model Sparse Attention node (``MergeRuntime.sparse_min_tokens``), a block whose attention
    sequence has at least that node's ``min_tokens`` runs unmerged unless the scope keeps its attention whole
    (feed-forward): merged tokens would hand the node's kernel queries, keys and values it must run dense
    (keys/values: shapes that differ; the other scopes: fewer tokens than its ``min_tokens``, or not its
    routing's picture). Shorter blocks merge: that node runs them dense (``leaves_attention_to_sparse``).

    Block identity: each block's patch is bound to its block (``family.BlockPatch``, or the object-patched
    forward made for it), which reaches ``MergeRuntime.plan`` as ``block``: with per-block plans each block
    plans for itself (and with shared destinations, to the destinations its group's first block chose)."""

    pe_axis = 2  # the token axis of the RoPE table ``pe`` (Flux, Chroma: (B, 1, L, ...))
    merges_slabs = False  # whether ``block`` merges each rank's slab under sequence parallelism (slab_of)
    merge_references = False  # whether the reference grids of ImageLayout.references merge, each by its own plan
    image_first = False  # the joint sequence is [image, txt] (HunyuanVideo's flipped_img_txt), not [txt, image]
    # submodules of each merged block whose forward is object-patched too (companion_forward makes it)
    companions: tuple[str, ...] = ()
    declared_attention = None  # the attention function the blocks declare, for our overrides (declared_attention.py)

    def __init__(self, runtime: MergeRuntime, scope: str = BLOCK, proportional: bool = False,
                 feed_forward: tuple[str, ...] = ()):
        self.runtime = runtime
        self.scope = scope
        self.proportional = proportional
        # scope feed-forward: the block's submodules that run merged (none at the other scopes)
        self.feed_forward = feed_forward if scope == FEED_FORWARD else ()
        self.taken_from: dict[str, list] = {}  # group -> runtimes of earlier token merge nodes whose blocks this took
        self.around: MergedSpan | None = None  # scope feed-forward: the block call under way's merge

    def read_model(self, dm) -> None:
        """Read from the diffusion model being patched what its blocks' layout depends on (a family whose
        token order differs between ComfyUI trees sets it here; by default nothing does)."""

    def took(self, group: str, previous: MergeRuntime) -> None:
        """Note that blocks of ``group`` patched by the earlier token merge node ``previous`` merge here
        instead: each run that merges the group tells ``previous`` (its stats name this node)."""
        if previous not in self.taken_from.setdefault(group, []):
            self.taken_from[group].append(previous)

    def plan_for(self, group: str, tokens: torch.Tensor, grid: tuple[int, ...], options: dict, block=None):
        """The plan of ``group``'s grid (or a toma_core Slab of it) for this call of ``block`` (its identity:
        per-block plans), or None."""
        level = (Level(group, grid.shape, slab=(grid.begin, grid.end, grid.extra)) if isinstance(grid, Slab)
                 else Level(group, tuple(grid)))
        for previous in self.taken_from.get(group, ()):
            previous.leave(level, options, lambda: f"the {self.runtime.name} node nearer the sampler",
                           "took its blocks")
        return self.runtime.plan(level, block, tokens, lambda: F.layer_norm(tokens, tokens.shape[-1:]), options)

    def pe_axis_of(self, args: dict) -> int:
        """The token axis of this call's RoPE table (a family whose tables changed layout reads it here)."""
        return self.pe_axis

    def fits(self, args: dict, group: str, txt_len: int, layout: ImageLayout) -> bool:
        """Whether the call's per-token inputs (pe, attn_mask) cover exactly its ``txt_len`` text and
        ``layout`` tokens (another patch, or another ComfyUI, may have changed them); ``group``: the
        block group of the call (TWO_STREAM, JOINT, VIDEO)."""
        return positions_fit(args, txt_len, layout, self.pe_axis_of(args))

    def call_options(self, args: dict, extras: dict | None = None) -> dict | None:
        """The transformer_options of the model call a block call belongs to, the layout in them: the
        block's own, else those handed beside ``original_block`` (Wan's copy of forward_orig in TeaCache
        and MagCache), else the model call's, stashed on the runtime by the LayoutStash (a cache node's own
        forward_orig calls the blocks without them); None, counted, where none has a layout."""
        for options in (args.get("transformer_options"), (extras or {}).get("transformer_options"),
                        self.runtime.model_call):
            if isinstance(options, dict) and LAYOUT_KEY in options:
                return options
        self.runtime.unmerged(NO_LAYOUT, "%s runs blocks unmerged that find no token layout, neither in their "
                              "transformer_options nor from their model call (a latent ToMA does not read, or a node "
                              "that replaced the diffusion model's forward)", self.runtime.name)
        return None

    def with_options(self, args: dict, options: dict) -> dict:
        """``args`` with the model call's ``options`` (``call_options``) under the block's own, where the
        caller passed none or others without the layout (an empty default): the merging code reads the
        sampling step from them."""
        own = args.get("transformer_options")
        if own is options:
            return args
        return {**args, "transformer_options": {**options, **own} if isinstance(own, dict) else options}

    def tokens_fit(self, tokens: int, expected: int, options: dict,
                   why: str = "ToMA merges the slabs of Wan's blocks only") -> bool:
        """Whether a block call's ``tokens`` are the ``expected`` ones of its layout; where not, why it runs
        unmerged is counted: fewer is a sequence-parallel slab (raylight's USP gives each rank one contiguous
        slab of the sequence, the last one padded) that this family does not merge (``why``; Wan's blocks
        merge theirs: ``slab_of``), for which ToMA steps aside for the whole model call; more is another
        patch's tokens."""
        if options.get(SLAB_KEY) or tokens < expected:
            options[SLAB_KEY] = True
            self.runtime.unmerged(SLAB, "%s steps aside: the blocks see a slab of their model call's tokens (%d of "
                                  "%d: sequence parallelism, e.g. raylight's USP), and %s; this model runs "
                                  "unmerged", self.runtime.name, tokens, expected, why)
            return False
        if tokens != expected:
            self.runtime.unmerged(TOKEN_COUNT, "%s runs a block unmerged: it has %d tokens where its layout has %d "
                                  "(another patch's tokens)", self.runtime.name, tokens, expected)
            return False
        return True

    def slab_of(self, tokens: int, layout: ImageLayout, options: dict) -> SlabLayout | None:
        """This rank's SlabLayout of a block call holding ``tokens`` of its model call's ``layout.total``, where
        xfuser's sequence-parallel group names the rank and the tokens are its slab as raylight cuts them
        (``equal_slabs``: every rank's slab merging to as many tokens); else None, the call counted and the
        model call's blocks stepping aside (``tokens_fit``), with why."""
        group, where = sequence_parallel_group(), self.runtime.placement
        if where.windows is None:
            why = f"{self.runtime.name} does not merge sequence-parallel slabs (ToMA's windows do)"
        elif group is None:
            why = "no sequence-parallel group of xfuser names the rank, so ToMA cannot tell which slab this is"
        elif tokens != -(-layout.total // group[1]):
            why = f"they are not one of {group[1]} equal slabs, as raylight cuts them"
        else:
            try:
                return equal_slabs(layout, group[1], *where.windows, where.ratio)[group[0]]
            except ValueError as e:
                why = f"the slabs cannot merge to equal lengths ({e})"
        self.tokens_fit(tokens, layout.total, options, why)
        return None

    def slab_call(self, args: dict, run, slab: SlabLayout, block=None) -> dict:
        """A block call over one rank's ``slab`` at scope block: its grid tokens merged, the block run whole on
        the merged slab (as long on every rank: Ulysses attention exchanges fewer tokens), its update
        unmerged."""
        return self.whole_block_call(VIDEO, args, run, slab.lead, 0, slab, block)

    def positions_fit_or_count(self, args: dict, group: str, txt_len: int, layout: ImageLayout) -> bool:
        """``fits``, with the call counted as unmerged where it does not."""
        if self.fits(args, group, txt_len, layout):
            return True
        self.runtime.unmerged(POSITIONS, "%s runs %s blocks unmerged whose per-token inputs (positions, masks, "
                              "modulation) do not cover their tokens as ToMA expects (another patch changed them)",
                              self.runtime.name, group)
        return False

    def whole_blocks_unless(self, passed: bool, double: bool = False) -> None:
        """Say once that blocks called without transformer_options (a cache node's own forward_orig) merge whole
        blocks where the node's scope merges inside their attention (``double``: a double block, which scope
        attention merges there): no attention override would reach it."""
        if not passed and ((self.scope == ATTENTION and double) or self.scope == KEYS_VALUES):
            self.runtime.caveat("blocks are called without transformer_options (a cache node's own forward_orig), "
                                "which would drop the attention override; they merge whole blocks (scope block)"
                                + (", without proportional attention" if self.proportional else ""))

    def double_block(self, args: dict, extras: dict, block=None) -> dict:
        """Image stream [lead, image, extra] (B, N + E, C) merged; text stream (B, L, C) or None passes whole."""
        run, img, txt = extras["original_block"], args["img"], args.get("txt")
        options = self.call_options(args, extras)
        if options is None:
            return run(args)
        layout, passed = options[LAYOUT_KEY], isinstance(args.get("transformer_options"), dict)
        txt_len = 0 if txt is None else txt.shape[1]
        if (not self.tokens_fit(img.shape[1], layout.total, options)
                or not self.positions_fit_or_count(args, TWO_STREAM, txt_len, layout)):
            return run(args)
        args = self.with_options(args, options)
        if self.scope == ATTENTION and passed:
            return self.attention_merged_call(args, run, txt_len, layout, block)
        self.whole_blocks_unless(passed, double=True)
        return self.merged_call(TWO_STREAM, args, run, layout.lead, txt_len, layout, block, passed)

    def single_block(self, args: dict, extras: dict, block=None) -> dict:
        """Joint sequence [txt, lead, image, extra] ([lead, image, extra, txt] with ``image_first``): the
        image part merged, the rest whole."""
        run, x = extras["original_block"], args["img"]
        options = self.call_options(args, extras)
        if options is None:
            return run(args)
        layout = options[LAYOUT_KEY]
        txt_len = x.shape[1] - layout.total
        if (not self.tokens_fit(min(x.shape[1], layout.total), layout.total, options)
                or not self.positions_fit_or_count(args, JOINT, txt_len, layout)):
            return run(args)
        start = layout.lead + (0 if self.image_first else txt_len)
        passed = isinstance(args.get("transformer_options"), dict)
        self.whole_blocks_unless(passed)
        return self.merged_call(JOINT, self.with_options(args, options), run, start, txt_len, layout, block, passed)

    def block(self, args: dict, extras: dict, block=None) -> dict:
        """A block over one sequence of video tokens [lead, video, extra] (B, L, C) (LTX-Video, Wan): the
        grid merged; the text reaches it through cross-attention and passes whole, and a call the layout
        does not account for runs unmerged, counted."""
        run, img = extras["original_block"], args["img"]
        options = self.call_options(args, extras)
        if options is None:
            return run(args)
        layout = options[LAYOUT_KEY]
        if not torch.is_tensor(img):
            self.runtime.unmerged(TOKEN_COUNT, "%s runs a block unmerged whose tokens are not one tensor",
                                  self.runtime.name)
            return run(args)
        if self.merges_slabs and img.shape[1] < layout.total and not options.get(SLAB_KEY):
            if self.scope == KEYS_VALUES or self.feed_forward:
                self.tokens_fit(img.shape[1], layout.total, options, SLABS_TAKE_BLOCKS)
                return run(args)
            slab = self.slab_of(img.shape[1], layout, options)
            if slab is None or not self.positions_fit_or_count(args, VIDEO, 0, slab):
                return run(args)
            return self.slab_call(self.with_options(args, options), run, slab, block)
        if (not self.tokens_fit(img.shape[1], layout.total, options)
                or not self.positions_fit_or_count(args, VIDEO, 0, layout)):
            return run(args)
        passed = isinstance(args.get("transformer_options"), dict)
        self.whole_blocks_unless(passed)
        return self.merged_call(VIDEO, self.with_options(args, options), run, layout.lead, 0, layout, block, passed)

    def reduced_inputs(self, call: BlockCall) -> dict:
        """The block's per-token inputs besides the tokens (``pe``, ``attn_mask``), cut to the merged
        sequence, once per plan and model call (TokenPlan.derived). A family whose blocks take other per-token
        inputs overrides this."""
        args, pe_axis = call.args, self.pe_axis_of(call.args)
        return call.plan.derived("positions", (call.txt_len, call.layout, pe_axis),
                                 (args.get("pe"), args.get("attn_mask"), *call.reference_plans),
                                 lambda: merged_positions(args, call.txt_len, call.layout, call.plan, pe_axis,
                                                          call.reference_plans))

    def reference_plans(self, group: str, seq: torch.Tensor, begin: int, layout: ImageLayout, options: dict,
                        block=None):
        """[((begin, end), plan or None)] for the reference grids of ``layout`` from ``begin`` in ``seq``."""
        out = []
        for k, (h, w) in enumerate(layout.references if self.merge_references else ()):
            end = begin + h * w
            out.append(((begin, end), self.plan_for(f"{group} reference {k + 1}", seq[:, begin:end], (h, w), options,
                                                    block)))
            begin = end
        return out

    def attention_merged_call(self, args: dict, run, txt_len: int, layout: ImageLayout, block=None) -> dict:
        """Run the double block on its full-length streams with its joint attention on merged image
        tokens: the plan of the grid [lead, lead + tokens) of ``args["img"]`` goes to a MergedAttention
        in the block's own copy of transformer_options, chained to any override already there."""
        img, options = args["img"], args["transformer_options"]
        if self.leaves_attention_to_sparse(txt_len + layout.total):
            return run(args)
        plan = self.plan_for(TWO_STREAM, img[:, layout.lead:layout.lead + layout.tokens], layout.grid, options, block)
        if plan is None:
            return run(args)
        start = layout.lead + (0 if self.image_first else txt_len)
        override = MergedAttention(self.runtime, plan, start, layout.tokens, txt_len + layout.total,
                                   options.get(ATTENTION_OVERRIDE_KEY), self.proportional, self.declared_attention)
        return run({**args, "transformer_options": {**options, ATTENTION_OVERRIDE_KEY: override}})

    def keys_values_call(self, group: str, args: dict, run, start: int, txt_len: int, layout: ImageLayout,
                         block=None) -> dict:
        """Run the block whole on ``args["img"]`` with the keys and values of its self-attention merged: the
        grid tokens [start, start + layout.tokens) of ``args["img"]`` (and the reference grids after them,
        with ``merge_references``) plan the merge, and a MergedKeysValues in the block's own copy of
        transformer_options (chained to any override already there) applies it inside the attention call,
        whose sequence is the block's text and image tokens ([txt, image] unless ``image_first``)."""
        seq, options, end = args["img"], args["transformer_options"], start + layout.tokens
        plan = self.plan_for(group, seq[:, start:end], layout.grid, options, block)
        if plan is None:
            return run(args)
        references = self.reference_plans(group, seq, end, layout, options, block)
        shift = txt_len if group == TWO_STREAM and not self.image_first else 0  # where the image stream sits
        spans = [(start + shift, layout.tokens, plan)] + [(b + shift, e - b, p) for (b, e), p in references
                                                          if p is not None]
        override = MergedKeysValues(self.runtime, spans, txt_len + layout.total, self.proportional,
                                    options.get(ATTENTION_OVERRIDE_KEY), self.declared_attention)
        out = run({**args, "transformer_options": {**options, ATTENTION_OVERRIDE_KEY: override}})
        if not override.served:
            self.runtime.unmerged("no self-attention call", "%s blocks called no self-attention over their %d tokens "
                                  "through ComfyUI's attention functions; their keys and values ran unmerged", group,
                                  txt_len + layout.total)
        return out

    def leaves_attention_to_sparse(self, length: int) -> bool:
        """Whether this block call, whose attention runs over ``length`` tokens, runs unmerged because core's
        Model Sparse Attention node takes that attention (see the class docstring); said once in the log and
        the stats, with the calls ToMA merges, and counted."""
        floor = self.runtime.sparse_min_tokens
        if floor is None:
            return False
        if self.feed_forward:
            self.runtime.caveat("core's Model Sparse Attention is on this model: its kernel takes the "
                                "self-attention over every token (scope feed-forward keeps it whole); ToMA merges "
                                f"only the {' and '.join(self.feed_forward)} of each block")
            return False
        self.runtime.caveat(f"core's Model Sparse Attention is on this model: its kernel takes the attention of "
                            f"blocks of at least {floor:,} tokens, which ToMA leaves whole (merged, they would "
                            f"reach it in shapes it runs dense); ToMA merges the blocks of fewer tokens, whose "
                            f"attention that node runs dense")
        if length < floor:
            return False
        self.runtime.unmerged(SPARSE, "%s leaves blocks of %d tokens unmerged to core's sparse attention",
                              self.runtime.name, length)
        return True

    def feed_forward_call(self, group: str, args: dict, run, start: int, layout: ImageLayout, block=None) -> dict:
        """Run the block whole on ``args["img"]``, the submodules ``feed_forward`` names on its grid tokens
        [start, start + layout.tokens) merged (``merged_forward`` reads the plan from ``around``)."""
        if self.runtime.compiled_call:
            self.runtime.unmerged(FEED_FORWARD_COMPILED, "%s: scope feed-forward does not merge under torch.compile "
                                  "(compiled, ComfyUI v0.3.64 traced Wan's feed-forward without its patched forward and "
                                  "ran it unmerged without a word, unlike eager); those blocks run unmerged. Use scope "
                                  "keys/values or block to merge compiled", self.runtime.name)
            return run(args)
        seq, options = args["img"], args["transformer_options"]
        plan = self.plan_for(group, seq[:, start:start + layout.tokens], layout.grid, options, block)
        if plan is None:
            return run(args)
        self.around = MergedSpan(plan, start, layout.tokens, seq.shape[1])
        try:
            return run(args)
        finally:
            self.around = None

    def merged_forward(self, name: str, original):
        """The forward of the block's submodule ``name`` around its unpatched ``original`` (bound), for
        scope feed-forward: in a block call that merges (``around``), its tokens (the first argument, the
        block's sequence) merged, its output unmerged onto every token."""
        patch = self

        def forward(module, x, *args, **kwargs):
            around = patch.around
            if around is None or not torch.is_tensor(x) or x.dim() != 3 or x.shape[1] != around.length:
                return original(x, *args, **kwargs)
            begin, end = around.start, around.start + around.tokens
            with patch.runtime.stages.stage("merge"):
                merged = splice(x, [(begin, end)], [around.plan.merge(x[:, begin:end])])
            y = original(merged, *args, **kwargs)
            stop = begin + around.plan.num_merged
            with patch.runtime.stages.stage("unmerge"):
                return splice(y, [(begin, stop)], [around.plan.unmerge(y[:, begin:stop])])

        forward.token_merge = (original, self.runtime)  # for a token merge node stacked after this one
        return forward

    def merged_call(self, group: str, args: dict, run, start: int, txt_len: int, layout: ImageLayout,
                    block=None, inside_attention: bool = True) -> dict:
        """Run the block on ``args["img"]`` with its grid tokens [start, start + layout.tokens) merged (and
        the reference grids after them, with ``merge_references``); return the full-length result with
        the block's update of the merged tokens unmerged onto them. Scope keys/values: the block runs whole,
        only its self-attention's keys and values merged (``keys_values_call``), unless ``inside_attention`` is
        false (the block's caller passes no transformer_options, so no override would reach its attention)."""
        attended = args["img"].shape[1] + (txt_len if group == TWO_STREAM else 0)  # the attention's sequence
        if self.leaves_attention_to_sparse(attended):
            return run(args)
        if self.feed_forward:
            return self.feed_forward_call(group, args, run, start, layout, block)
        if self.scope == KEYS_VALUES and inside_attention:
            return self.keys_values_call(group, args, run, start, txt_len, layout, block)
        return self.whole_block_call(group, args, run, start, txt_len, layout, block)

    def whole_block_call(self, group: str, args: dict, run, start: int, txt_len: int, layout: ImageLayout,
                         block=None) -> dict:
        """``merged_call`` at scope block: the whole block on merged tokens, its update unmerged."""
        seq, options, end = args["img"], args["transformer_options"], start + layout.tokens
        plan = self.plan_for(group, seq[:, start:end], layout.grid, options, block)
        if plan is None:
            return run(args)
        references = self.reference_plans(group, seq, end, layout, options, block)
        spans = [((start, end), plan)] + [(r, p) for r, p in references if p is not None]
        call = BlockCall(args, txt_len, layout, plan, tuple(p for _, p in references))

        with self.runtime.stages.stage("merge"):
            merged = [p.merge(seq[:, b:e]) for (b, e), p in spans]
            inputs = {"img": splice(seq, [r for r, _ in spans], merged), **self.reduced_inputs(call)}
        out = run({**args, **inputs})
        with self.runtime.stages.stage("unmerge"):
            y, ranges, shift = out["img"], [], 0  # where each merged span sits in the shorter output
            for ((b, e), _), m in zip(spans, merged):
                ranges.append((b - shift, b - shift + m.shape[1]))
                shift += e - b - m.shape[1]
            img = splice(y, ranges, [p.unmerge_update(seq[:, b:e], m, y[:, ob:oe])
                                     for ((b, e), p), m, (ob, oe) in zip(spans, merged, ranges)])
        return {**out, "img": img}


OPTIONS_PARAMETER = "transformer_options"


def forward_mismatch(forward, leading: tuple[str, ...]) -> str | None:
    """None where a block ``forward`` (unbound) takes ``leading`` first, ``transformer_options`` by name
    and nothing else it must be given (what an object-patched forward passes on), else why not, in words."""
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    rest = parameters[len(leading):]
    if (tuple(p.name for p in parameters[:len(leading)]) == leading
            and any(p.name == OPTIONS_PARAMETER for p in rest)
            and all(p.kind is inspect.Parameter.VAR_KEYWORD
                    or (p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_POSITIONAL)
                    for p in rest)):
        return None
    return (f"its blocks take ({', '.join(p.name for p in parameters)}), not ({', '.join(leading)}, then "
            f"{OPTIONS_PARAMETER} and optional ones) as ToMA passes them on")
