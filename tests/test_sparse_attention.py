"""ToMA beside ComfyUI core's "Model Sparse Attention" node, whose protocol toma_bench.sparse_attention stands
in for (the node itself is newer than every tree here): on a tiny Wan 2.1, in both orders, no attention call
reaches the sparse kernel in a shape it must run dense because of ToMA, and the log and the stats say what
each runs.

The tiny Wan's sizes are the real ones scaled down, so the stand-in's size rules are too: min_tokens 512 (the
real node's default 12,288 is above any test clip), head size 32 (the tiny Wan's; the real kernel takes 128).
Its kernel is SDPA (the protocol does not depend on the kernel's numbers), except in the test of
comfy-kitchen's eager Sol-Attn reference, which runs where that reference is found.
"""
import logging

import pytest
import torch

from toma_bench import comfy_host, models, sampling
from toma_bench import sparse_attention as sa

LOGGER = "ComfyUI-ToMA"
FRAMES, HW = 5, (24, 32)  # latent; 5 frames of 12x16 tokens
TOKENS = FRAMES * (HW[0] // 2) * (HW[1] // 2)  # 960
TEXT = 77
MIN_TOKENS = 512  # below the clip's tokens: the stand-in takes its self-attention
HEAD = models.WAN_TINY["dim"] // models.WAN_TINY["num_heads"]
STEPS = 4


def protocol_missing() -> str | None:
    """Why this tree cannot host the sparse node's protocol, or None (feature-detected)."""
    if not comfy_host.has_current_comfy():
        return comfy_host.CURRENT_ONLY
    comfy_host.import_comfy()
    return sa.protocol_missing()


pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module", autouse=True)
def host():
    why = protocol_missing()
    if why:
        pytest.skip(why)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def wan(pack):
    return models.build_wan("t2v", seed=3)


def sdpa_kernel(q, k, v, tau, scale=None):
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           scale=scale)
    return out.transpose(1, 2), None


def stand_in(**options) -> sa.SparseAttention:
    return sa.SparseAttention(**{"kernel": sdpa_kernel, "min_tokens": MIN_TOKENS, "head_dim": HEAD, **options})


def sample(model):
    conditioning = models.wan_conditioning(models.WAN_TINY, 1, TEXT, 0)
    return sampling.sample(model, conditioning, torch.zeros(1, 16, FRAMES, *HW), steps=STEPS, scheduler="simple")


def toma_default(pack, model):
    nodes = pack.nodes.toma_nodes
    (patched,) = nodes.ToMAPatchModel().patch(model, nodes.DEFAULT_RATIO, nodes.DEFAULT_WINDOW, nodes.DEFAULT_REUSE)
    return patched, pack.nodes.runtime.runtime_of(patched)


def feed_forward(pack, model, ratio=0.5):
    (patched,) = pack.nodes.toma_nodes.ToMAPatchModelAdvanced().patch(model, ratio, 4, 5, scope="feed-forward")
    return patched, pack.nodes.runtime.runtime_of(patched)


def stacked(pack, wan, order, toma=toma_default, sparse=None):
    """(the model with ToMA and the stand-in in ``order``, ToMA's runtime, the stand-in)."""
    sparse = sparse or stand_in()
    if order == "toma first":
        patched, runtime = toma(pack, wan)
        return sparse.apply(patched), runtime, sparse
    patched, runtime = toma(pack, sparse.apply(wan))
    return patched, runtime, sparse


def self_attention_calls(sparse) -> list:
    """The calls over the video's queries whose keys are not the text (Wan's layout: (B, L, H*D))."""
    return [c for c in sparse.calls if c.tokens == TOKENS and c.k[1] != TEXT]


@pytest.fixture(scope="module")
def alone(wan):
    """The stand-in alone: its latent and what it ran."""
    sparse = stand_in()
    latent = sample(sparse.apply(wan))
    return latent, sparse


def test_the_stand_in_takes_self_attention_and_declines_what_the_node_declines(alone):
    """What the protocol gives without ToMA: the video's self-attention is the kernel's after the first 20% of
    the schedule; cross-attention to the text is dense (q, k of other shapes), so is everything before."""
    _, sparse = alone
    by_reason = {}
    for c in sparse.calls:
        by_reason.setdefault(c.dense, set()).add(c.tokens)
    assert by_reason[None] == {TOKENS}
    assert by_reason[sa.SHAPES] == {TOKENS}  # cross-attention: 960 queries over 77 text keys
    assert "sigma outside the start/end window" in by_reason
    layers = models.WAN_TINY["num_layers"]
    assert len(sparse.sparse_calls()) == layers * (STEPS - 1)  # the first step is before 20%


@pytest.mark.parametrize("order", ["toma first", "sparse first"])
def test_toma_default_hands_the_sparse_kernel_every_call_it_would_take_alone(pack, wan, alone, order, caplog):
    """ToMA's video default merges keys and values (queries whole): beside the sparse node its blocks of
    at least min_tokens run unmerged, so every self-attention call the kernel takes alone it takes stacked
    (none is declined for its shapes), the picture is the sparse node's alone, and the log and the stats say
    what each ran."""
    model, runtime, sparse = stacked(pack, wan, order)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        latent = sample(model)
    assert not [c for c in self_attention_calls(sparse) if c.dense == sa.SHAPES]
    assert [c.dense for c in sparse.calls] == [c.dense for c in alone[1].calls]
    assert torch.equal(latent, alone[0])
    summary = runtime.summary()
    merged_blocks = models.WAN_TINY["num_layers"] - 1  # the first of 4 never merges
    assert summary["unmerged"] == {pack.nodes.adapters.dit.SPARSE: merged_blocks * STEPS}
    assert not summary["levels"]
    assert any("Model Sparse Attention" in c and f"{MIN_TOKENS:,} tokens" in c for c in summary["caveats"])
    assert caplog.text.count("leaves blocks of 960 tokens unmerged to core's sparse attention") == 1
    # the pack's prefix once: the caveat's method is ToMA itself (it read "ToMA: ToMA: core's ...")
    assert "ToMA: core's Model Sparse Attention is on this model" in caplog.text and "ToMA: ToMA:" not in caplog.text


def test_below_min_tokens_toma_merges_and_the_node_runs_dense_by_its_own_rule(pack, wan):
    """Where the clip is shorter than the node's min_tokens its kernel takes nothing, so ToMA merges: every
    call is declined for its size (or its step), none for the shapes ToMA gives it."""
    model, runtime, sparse = stacked(pack, wan, "sparse first", sparse=stand_in(min_tokens=TOKENS + 1))
    sample(model)
    assert runtime.summary()["levels"]  # merged
    assert not runtime.summary()["unmerged"]
    reasons = {c.dense for c in sparse.calls}
    assert None not in reasons and sa.SHAPES not in reasons


@pytest.mark.parametrize("order", ["toma first", "sparse first"])
def test_scope_feed_forward_merges_around_the_self_attention_the_kernel_takes(pack, wan, alone, order):
    """Scope feed-forward keeps the self-attention over every token: the kernel takes every call it takes
    alone, and ToMA merges the cross-attention and feed-forward of each block, saying so."""
    model, runtime, sparse = stacked(pack, wan, order, toma=feed_forward)
    latent = sample(model)
    assert [c.dense for c in self_attention_calls(sparse)] == [c.dense for c in self_attention_calls(alone[1])]
    summary = runtime.summary()
    assert summary["levels"] and not summary["unmerged"]
    assert any("scope feed-forward" in c for c in summary["caveats"])
    assert not torch.equal(latent, alone[0])
    cross = [c for c in sparse.calls if c.k[1] == TEXT]  # dense by the node's rules, merged or not
    merged_blocks = models.WAN_TINY["num_layers"] - 1  # the first of 4 never merges
    assert sum(c.tokens < TOKENS for c in cross) == merged_blocks * STEPS  # their cross-attention's queries merged


def test_scope_feed_forward_alone_is_close_to_unpatched(pack, wan):
    """Alone, scope feed-forward merges the tokens of the cross-attention and feed-forward only: the latent
    stays near the unpatched one, nearer than whole blocks at the same ratio."""
    reference = sample(wan)
    ffn = sample(feed_forward(pack, wan)[0])
    (block,) = pack.nodes.toma_nodes.ToMAPatchModelAdvanced().patch(wan, 0.5, 4, 5, scope="block")
    whole = sample(block)
    error = lambda x: float((x - reference).norm() / reference.norm())  # noqa: E731
    assert 0 < error(ffn) < error(whole)


def test_the_node_is_found_on_the_model_with_its_min_tokens(pack, wan):
    """The pack finds the node by its ON_PREPARE_STATE callback key and reads its min_tokens from the
    options the callback holds (0 where a callback of that key holds none); None without it."""
    from comfy.patcher_extension import CallbacksMP

    host = pack.nodes.host
    assert host.sparse_attention_min_tokens(wan) is None
    assert host.sparse_attention_min_tokens(stand_in(min_tokens=777).apply(wan)) == 777
    other = wan.clone()
    other.add_callback_with_key(CallbacksMP.ON_PREPARE_STATE, host.SPARSE_ATTENTION_KEY, lambda *args: None)
    assert host.sparse_attention_min_tokens(other) == 0


def test_comfy_kitchens_eager_sol_attn_runs_behind_the_protocol(pack, wan):
    """comfy-kitchen's eager Sol-Attn reference behind the stand-in, stacked with scope feed-forward: the
    kernel runs every self-attention call after 20% and reports the share of key blocks it routed exact."""
    reference = sa.sol_attn_reference()
    if isinstance(reference, str):
        pytest.skip(reference)
    model, _, sparse = stacked(pack, wan, "sparse first", toma=feed_forward,
                               sparse=stand_in(kernel=sa.eager_sol_attn))
    latent = sample(model)
    assert torch.isfinite(latent).all()
    shares = [c.routed for c in sparse.sparse_calls()]
    assert len(shares) == models.WAN_TINY["num_layers"] * (STEPS - 1)
    assert all(0 < s <= 1 for s in shares)


def test_the_priced_kernel_costs_its_routed_share_plus_the_overhead_of_a_dense_one():
    """On the meta device (the cost model) the stand-in's kernel is one fused attention whose FLOPs and bytes
    are the routed share plus ROUTING_OVERHEAD of a dense kernel's, capped at a dense kernel's."""
    from toma_bench import oprecord

    q, k, v = (torch.empty(1, 4096, 2, 64, device="meta") for _ in range(3))

    def recorded(kernel):
        with oprecord.recording() as rec, rec.model_call():
            kernel(q, k, v, sa.TAU)
        (op,) = [op for op in rec.calls[0] if op.cls == oprecord.ATTENTION]
        return op

    dense = recorded(sdpa_kernel)
    for share, factor in ((0.2, 0.2 + sa.ROUTING_OVERHEAD), (0.95, 1.0)):
        op = recorded(sa.priced_kernel(share))
        assert op.flops == pytest.approx(dense.flops * factor, rel=1e-6)
        assert op.bytes == pytest.approx(dense.bytes * factor, rel=1e-6)


@pytest.mark.parametrize("order", ["toma first", "sparse first"])
def test_minimax_h3_beside_the_sparse_node_is_refused_with_a_message(pack, order, caplog):
    """On MiniMax-H3 the node takes every block with a block patch of its own: with it applied first ToMA
    returns the model unpatched, saying why; applied after ToMA it replaces ToMA's block patches, and the
    run's stats and the log say that ToMA merged nothing, and why."""
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "MiniMaxH3"):
        pytest.skip("this ComfyUI has no MiniMax-H3")
    h3 = models.build_minimax_h3(seed=61)
    sparse = stand_in()
    conditioning = models.text_conditioning(models.MINIMAX_H3_TINY["text_dim"], 1, 11, 0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        if order == "sparse first":
            first = sparse.apply(h3)
            (patched,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(first, -1.0, 0, 5)
            assert patched is first
            assert "beside core's Model Sparse Attention is not served" in caplog.text
            return
        toma, runtime = toma_default(pack, h3)
        model = sparse.apply(toma)
        sampling.sample(model, conditioning, models.minimax_h3_latent(1, 5, (12, 12)), steps=2, scheduler="simple")
    summary = runtime.summary()
    assert not summary["levels"]
    assert any("merges nothing" in c and "block patches of its own" in c for c in summary["caveats"])
    assert len([c for c in sparse.calls if c.dense.startswith("MiniMax-H3 block")]) == \
        2 * models.MINIMAX_H3_TINY["num_layers"]
