"""The attention a model file declares (ComfyUI v0.38's ``ComfyAttention`` with a ``config``: an int8 repack's) is
kept: merged calls of scopes attention and keys/values run it, never the global function core hands our override
(nodes/adapters/declared_attention.py); blocks that declare several run whole-block merging, said once.

No tree here has ComfyAttention (v0.38 on). The stand-in is our own, after comfy/ldm/modules/attention.py of
Comfy-Org/ComfyUI at 05080f6022b2572df36a0aa6bcba413209c3d265: ``ComfyAttention`` (an nn.Module holding ``config``
and ``function``) installed in ComfyUI's attention module, and an ``optimized_attention`` with that file's
``wrap_attn`` order (``preferred_attention`` popped; an ``optimized_attention_override`` in transformer_options
called with the global function; else the preferred function; else the global one) in FLUX_TINY's attention,
each block passing its own ComfyAttention as the later model files pass theirs.
"""
import contextvars
import logging

import pytest
import torch
from torch import nn

from dit_checks import toma_patched
from toma_bench import comfy_host, models, sampling

pytestmark = [pytest.mark.comfy,
              pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

HW = (16, 24)  # 8 x 12 tokens
INT8 = {"attention": "comfy_kitchen_int8"}  # the one config v0.38 accepts
OVERRIDE = "optimized_attention_override"


class ComfyAttention(nn.Module):
    """The stand-in: what the checkpoint declares (``config``) and the function it asks for."""

    def __init__(self, config=None, function=None):
        super().__init__()
        self.config, self.function = config, function


class DeclaringHost:
    """FLUX_TINY's blocks declaring their attention as v0.38's model files do (see the module docstring)."""

    def __init__(self, monkeypatch, dm):
        import comfy.ldm.flux.math as flux_math
        import comfy.ldm.modules.attention as attention

        self.global_attention = flux_math.optimized_attention
        self.current = contextvars.ContextVar("preferred_attention", default=None)
        self.calls = []  # (the block's declared function's name or "global", key length) of each attention call
        monkeypatch.setattr(attention, "ComfyAttention", ComfyAttention, raising=False)
        monkeypatch.setattr(flux_math, "optimized_attention", self.optimized_attention)
        self.handles = []
        for block in [*dm.double_blocks, *dm.single_blocks]:
            monkeypatch.setattr(block, "comfy_attention", ComfyAttention(), raising=False)
            self.handles += [block.register_forward_pre_hook(self.enter), block.register_forward_hook(self.leave)]
        self.tokens = []

    def enter(self, block, args):
        self.tokens.append(self.current.set(block.comfy_attention))

    def leave(self, block, args, out):
        self.current.reset(self.tokens.pop())

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def optimized_attention(self, q, k, v, heads, **kwargs):
        preferred = self.current.get()  # what the model passes as preferred_attention, popped first
        options = kwargs.get("transformer_options") or {}
        kwargs["_inside_attn_wrapper"] = True
        if OVERRIDE in options:
            return options[OVERRIDE](self.global_function, q, k, v, heads, **kwargs)
        if preferred is not None and preferred.function is not None:
            return preferred.function(q, k, v, heads, **kwargs)
        return self.global_function(q, k, v, heads, **kwargs)

    def global_function(self, q, k, v, heads, **kwargs):
        self.calls.append(("global", k.shape[2]))
        return self.global_attention(q, k, v, heads, **kwargs)

    def declaring(self, name):
        """An attention function named ``name`` that records its calls and computes as the global one."""
        def declared(q, k, v, heads, **kwargs):
            self.calls.append((name, k.shape[2]))
            return self.global_attention(q, k, v, heads, **kwargs)
        declared.__name__ = name
        return declared


@pytest.fixture
def host(pack, monkeypatch):
    flux = models.build_flux(seed=5)
    host = DeclaringHost(monkeypatch, flux.model.diffusion_model)
    host.flux = flux
    yield host
    host.remove()


def declare(host, function, blocks=None):
    dm = host.flux.model.diffusion_model
    for block in blocks or [*dm.double_blocks, *dm.single_blocks]:
        block.comfy_attention.config, block.comfy_attention.function = INT8, function


def prompt(model):
    conditioning = models.dit_conditioning("flux", models.FLUX_TINY, 1, 16, 0)
    return sampling.sample(model, conditioning, torch.zeros(1, 16, *HW), steps=2, scheduler="simple", seed=0)


@pytest.mark.parametrize("scope", ["keys/values", "attention"])
def test_unpatched_and_merged_calls_reach_the_declared_attention(pack, host, scope):
    declare(host, host.declaring("int8"))
    prompt(host.flux)
    unpatched, host.calls = host.calls, []
    patched, runtime = toma_patched(pack, host.flux, scope=scope, proportional_attention=scope == "keys/values")
    prompt(patched)

    full = 16 + HW[0] * HW[1] // 4  # text and image tokens of a block's attention
    assert unpatched and {name for name, _ in unpatched} == {"int8"}
    assert {name for name, _ in host.calls} == {"int8"} and len(host.calls) == len(unpatched)
    assert any(length < full for _, length in host.calls), "the merged calls merged their keys"
    assert runtime.summary()["levels"] and not runtime.summary()["unmerged"]


def test_a_user_chosen_backend_still_wins_as_in_core(pack, host):
    """An override set before ToMA (the Model Attention Backend node) runs in place of the declared attention, as
    core runs it: ToMA hands its merged calls on to it."""
    declare(host, host.declaring("int8"))
    chosen = host.flux.clone()

    def backend(func, q, k, v, heads, **kwargs):
        host.calls.append(("chosen", k.shape[2]))
        return func(q, k, v, heads, **kwargs)

    chosen.model_options.setdefault("transformer_options", {})[OVERRIDE] = backend
    patched, _ = toma_patched(pack, chosen, scope="keys/values")
    prompt(patched)
    assert {name for name, _ in host.calls} == {"chosen", "global"}


def test_blocks_declaring_several_attentions_merge_whole_blocks_said_once(pack, host, caplog):
    dm = host.flux.model.diffusion_model
    declare(host, host.declaring("int8"))
    declare(host, host.declaring("other"), [dm.single_blocks[0]])
    prompt(host.flux)
    unpatched, host.calls = host.calls, []
    with caplog.at_level(logging.WARNING, logger="ComfyUI-ToMA"):
        patched, runtime = toma_patched(pack, host.flux, scope="keys/values")
        prompt(patched)
        prompt(patched)
    said = [r.getMessage() for r in caplog.records if "declare different attention" in r.getMessage()]
    assert len(said) == 1 and "int8, other" in said[0] and "whole blocks (scope block)" in said[0]
    assert said[0] in [f"ToMA: {caveat}" for caveat in runtime.summary()["caveats"]]
    assert sorted({name for name, _ in host.calls}) == ["int8", "other"]
    assert len(host.calls) == 2 * len(unpatched) and runtime.summary()["levels"]


def test_a_model_declaring_nothing_is_served_as_before(pack, host):
    patched, runtime = toma_patched(pack, host.flux, scope="keys/values")
    prompt(patched)
    assert {name for name, _ in host.calls} == {"global"} and runtime.summary()["levels"]
