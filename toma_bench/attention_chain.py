"""A stand-in of the override-chain audit of later ComfyUI trees, our own code following the behaviour of
``_attention_provider_identity`` and ``_callable_identity`` in comfy_extras/sparse_attention_history.py of
Comfy-Org/ComfyUI at commit cf3103c5221f22fd6535b5db2a857d7151e2e2d7 (no tree we can install has it).

There, core's block-sparse attention names the attention that runs under it before it lets a forecast reuse
its results: it walks ``transformer_options["optimized_attention_override"]`` through each override's
``attention_preprocess_v1 = (transform, previous)``, naming every transform by its module, qualified name and
object, until it reaches an override without the attribute (or None, ComfyUI's own attention), the provider
that runs the attention. An attribute that is not a pair makes the chain invalid, an override met twice a
cycle. Third-party video packs do the same to decide whether they may stack sparse attention on an override:
one that is not a preprocessing step is "an unknown optimized-attention override" to them.
"""
from dataclasses import dataclass

CONTRACT = "attention_preprocess_v1"
DEFAULT_PROVIDER = ("comfy.default",)  # no override: ComfyUI's own attention function


def callable_identity(function) -> tuple:
    """(module, qualified name, id) of ``function`` (of the function behind a bound method), or
    DEFAULT_PROVIDER for None."""
    if function is None:
        return DEFAULT_PROVIDER
    function = getattr(function, "__func__", function)
    return (str(getattr(function, "__module__", "<unknown>")),
            str(getattr(function, "__qualname__", type(function).__name__)), id(function))


@dataclass(frozen=True)
class ChainAudit:
    """What the audit makes of an override: ``transforms``, the identities of its preprocessing steps from
    the outermost in; ``provider``, the identity of what runs the attention under them; ``problem``:
    "invalid" (a contract that is not a (transform, previous) pair) or "cyclic", else None."""

    transforms: tuple
    provider: tuple
    problem: str | None = None

    @property
    def preprocessing(self) -> bool:
        """Whether the outermost override declared itself a preprocessing step (what packs that stack on an
        override ask before they do)."""
        return self.problem is None and bool(self.transforms)


def audit(override) -> ChainAudit:
    """The chain below ``override`` as the later trees' audit reads it."""
    transforms, seen = [], set()
    while hasattr(override, CONTRACT):
        if id(override) in seen:
            return ChainAudit(tuple(transforms), callable_identity(override), "cyclic")
        seen.add(id(override))
        contract = getattr(override, CONTRACT)
        if not (isinstance(contract, tuple) and len(contract) == 2):
            return ChainAudit(tuple(transforms), callable_identity(override), "invalid")
        transform, override = contract
        transforms.append(callable_identity(transform))
    return ChainAudit(tuple(transforms), callable_identity(override))
