"""MODEL -> runtime: the runtime of a token merge node lives in the options of the MODEL it patched.

``model_options`` is deep-copied whenever ComfyUI clones a patcher (docs/architecture.md, "patches are
deep-copied"); a runtime returns itself from ``__deepcopy__``, so every clone of a patched MODEL carries
the same runtime, and the runtime lives exactly as long as some MODEL that carries it. Object patches
stay applied to the shared BaseModel after sampling, so they reach their state only weakly (``hold``).
"""
OPTIONS_KEY = "comfyui_toma"  # the runtime of the token merge node nearest the sampler
STACK_KEY = "comfyui_toma_stack"  # the runtimes of every token merge node on this MODEL, in patch order
OWNERS_KEY = "comfyui_toma_owners"  # what the MODEL's object patches reach only weakly, held by the MODEL

NOT_PATCHED = ("model: this MODEL was not patched by a ToMA, ToMeSD or CA-ToMe node of this pack (or it was "
               "patched with ratio 0, or the model family is not supported), so there are no merge plans to "
               "show; connect the MODEL output of the token merge node")


def hold(model, owner) -> None:
    """Keep ``owner`` (an adapter's patch state, and through it the runtime) alive exactly as long as
    ``model`` or a clone of it. Object patches stay applied to the shared BaseModel after sampling (even
    after the patched MODEL is gone, until another clone loads), so they reach their owner through a weak
    reference, and the MODEL's ``model_options`` hold it instead (clones share it: owners return
    themselves from ``__deepcopy__``)."""
    options = model.model_options.setdefault("transformer_options", {})
    options[OWNERS_KEY] = list(options.get(OWNERS_KEY, ())) + [owner]


def holds(model, owner) -> bool:
    """Whether ``owner`` is held by ``model`` (``hold`` on it or on a patcher it was cloned from)."""
    options = (getattr(model, "model_options", None) or {}).get("transformer_options", {})
    return any(held is owner for held in options.get(OWNERS_KEY, ()))


def attach_runtime(model, runtime) -> None:
    """Put ``runtime`` into the patched ``model``'s transformer_options, nearest the sampler."""
    options = model.model_options.setdefault("transformer_options", {})
    options[OPTIONS_KEY] = runtime
    options[STACK_KEY] = list(options.get(STACK_KEY, ())) + [runtime]


def runtime_of(model):
    """The runtime of the token merge node nearest the sampler on ``model`` (or on a model it was cloned
    from)."""
    options = (getattr(model, "model_options", None) or {}).get("transformer_options", {})
    runtime = options.get(OPTIONS_KEY)
    if runtime is None:
        raise ValueError(NOT_PATCHED)
    return runtime


def runtimes_of(model) -> list:
    """The runtimes of every token merge node on ``model``, the one nearest the sampler first."""
    options = (getattr(model, "model_options", None) or {}).get("transformer_options", {})
    runtimes = list(reversed(options.get(STACK_KEY, ())))
    if not runtimes:
        raise ValueError(NOT_PATCHED)
    return runtimes
