"""Scope "attention" on Flux double blocks (the paper's placement): the block runs on full-length tokens
and only its joint attention sees merged image tokens, through ComfyUI's attention override. Random-weight
FLUX_TINY (2 double blocks, the second merged; 3 single blocks, all merged) sampled through ComfyUI's
own sampler; one test computes a double block by hand.
"""
import logging

import pytest
import torch
import torch.nn.functional as F

import dit_checks
from toma_bench import comfy_host, models, sampling
from dit_checks import toma_patched
from toma_bench.metrics import relative_l2

pytestmark = [pytest.mark.comfy,
              pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

HW = (27, 39)  # 14x20 tokens: no window of 4 divides it
OVERRIDE = "optimized_attention_override"


@pytest.fixture(scope="module")
def flux(pack):
    return models.build_flux(seed=1)


def sample(model, batch=1, cfg=1.0, steps=2):
    conditioning = models.dit_conditioning("flux", models.FLUX_TINY, batch, 77, 0)
    return sampling.sample(model, conditioning, torch.zeros(batch, 16, *HW), steps=steps, cfg=cfg,
                           scheduler="simple", seed=0)


def attention_scope(pack, model, **inputs):
    return toma_patched(pack, model, **{"ratio": 0.5, "window": 4, "scope": "attention", **inputs})


def test_ratio_zero_is_identical_to_unpatched(pack, flux):
    dit_checks.check_ratio_zero_identical(pack, flux, lambda m: sample(m, batch=2), advanced={"scope": "attention"})


def test_merging_into_every_token_reproduces_the_unpatched_model(pack, flux):
    """Window 2 at ratio 0.1 keeps every token a destination: merging q, k, v only permutes the image rows
    (each keeps the RoPE it was given), so attention and the unmerged output match the unpatched model;
    cfg 2 with batch 2 runs cond and uncond rows together."""
    patched, runtime = attention_scope(pack, flux, ratio=0.1, window=2)
    dit_checks.check_merging_only_permutes(patched, flux, lambda m: sample(m, batch=2, cfg=2.0))
    levels = runtime.summary()["levels"]
    assert sorted(levels) == ["joint 14x20", "two-stream 14x20"] and all(v["steps"] == 2 for v in levels.values())


def test_half_ratio_stays_close_and_differs_from_block_scope(pack, flux):
    """Ratio 0.5: changed, but little (measured: 2.0% relative L2, whole blocks 2.5%; the bound leaves a
    margin of five), and not the whole-block result; the override never stays in the model's options."""
    patched, runtime = attention_scope(pack, flux)
    out, _ = dit_checks.check_half_ratio_merges((patched, runtime), flux, sample,
                                                ["two-stream 14x20", "joint 14x20"], 14 * 20, bound=0.1)
    block, _ = toma_patched(pack, flux, scope="block")
    assert relative_l2(out, sample(block)) > 1e-4
    assert OVERRIDE not in patched.model_options.get("transformer_options", {})


def test_auto_scope_is_the_dit_default(pack, flux):
    """Scope "auto" places the merge as the image-DiT preset says (in this 2-step run on its short-run
    schedule where it has one), and the basic node is the Advanced node with scope "auto" and the preset's
    start and step schedule."""
    preset = pack.nodes.placement.PRESETS["dit"]
    auto, runtime = toma_patched(pack, flux, scope="auto")
    timing = runtime.strategy.schedule.timing(2)
    expected = sample(toma_patched(pack, flux, reuse=timing.reuse_interval, scope=preset.scope,
                                   start_percent=timing.start_percent, merge_every=timing.merge_every)[0])
    assert torch.equal(sample(auto), expected)
    (basic,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(flux, 0.5, 4, 5)
    preset_run = toma_patched(pack, flux, scope="auto", levels=preset.levels, start_percent=preset.start_percent,
                              merge_every=preset.merge_every, weights_interval=preset.weights_interval)[0]
    assert torch.equal(sample(basic), sample(preset_run))
    if preset.start_percent:
        assert not torch.equal(sample(basic), expected)


def test_an_override_already_set_is_chained(pack, flux):
    """Another patch's attention override (set in model_options, as nodes set it) still sees every
    attention call, the merged double block's on the merged sequence, and stays the model's override."""
    lengths = []

    def counting(func, q, k, v, heads, *args, **kwargs):
        lengths.append(q.shape[2])
        return func(q, k, v, heads, *args, **kwargs)

    counted = flux.clone()
    counted.model_options.setdefault("transformer_options", {})[OVERRIDE] = counting
    sample(counted, steps=1)
    plain = list(lengths)
    lengths.clear()
    patched, runtime = attention_scope(pack, counted)
    options_before = dict(patched.model_options["transformer_options"])
    sample(patched, steps=1)
    merged = 77 + runtime.summary()["levels"]["two-stream 14x20"]["merged_tokens"]
    assert plain == [77 + 14 * 20] * 5  # 2 double blocks, 3 single blocks
    assert lengths == [77 + 14 * 20] + [merged] * 4  # double 0 unmerged; double 1 and the single blocks merged
    assert patched.model_options["transformer_options"] == options_before
    assert patched.model_options["transformer_options"][OVERRIDE] is counting


def test_host_without_attention_override_merges_whole_blocks(pack, flux, monkeypatch, caplog):
    block, _ = toma_patched(pack, flux, scope="block")
    monkeypatch.setattr(pack.nodes.host, "attention_override_supported", lambda: False)
    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        fallback, _ = attention_scope(pack, flux)
        out = sample(fallback)
    assert torch.equal(out, sample(block))
    assert sum("no attention override" in r.getMessage() for r in caplog.records) == 1


def test_failing_merge_runs_the_attention_unmerged(pack, flux, monkeypatch, caplog):
    """An exception inside the override (here from merging) never stops sampling: that attention call
    runs unmerged, and the log says so once."""
    overrides = pack.nodes.adapters.attention_override

    def broken(self, q, k, v, heads, **kwargs):
        raise RuntimeError("merge broke")

    monkeypatch.setattr(overrides.MergedAttention, "transform", broken)
    patched, _ = attention_scope(pack, flux)
    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        out = sample(patched)
    assert torch.isfinite(out).all()
    assert sum("merge broke" in r.getMessage() for r in caplog.records) == 1


def test_one_double_block_by_hand(pack, flux):
    """Flux double block 1 through the patch, against the block written out: modulation, projections and
    both MLPs on full-length streams; the joint attention on [txt, M q_img] etc. with RoPE applied
    before merging; the image part of its output unmerged (U) before the output projection."""
    from comfy.ldm.flux.layers import apply_mod
    from comfy.ldm.flux.math import apply_rope

    dit, dm = pack.nodes.adapters.dit, flux.model.diffusion_model
    layouts = pack.nodes.adapters.layout
    block, (h, w), txt_len, B = dm.double_blocks[1], (6, 5), 7, 2
    g = torch.Generator().manual_seed(3)
    r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.cat([torch.zeros(txt_len, 3), torch.stack([torch.zeros_like(r), r, c], -1).view(-1, 3).float()])
    pe = dm.pe_embedder(ids[None].expand(B, -1, -1))
    C, H = dm.hidden_size, dm.num_heads
    img, txt = torch.randn(B, h * w, C, generator=g), torch.randn(B, txt_len, C, generator=g)
    vec = torch.randn(B, C, generator=g)

    def original(a):
        out = block(img=a["img"], txt=a["txt"], vec=a["vec"], pe=a["pe"], attn_mask=a["attn_mask"],
                    transformer_options=a["transformer_options"])
        return dict(zip(("img", "txt"), out))

    args = {"img": img.clone(), "txt": txt.clone(), "vec": vec, "pe": pe, "attn_mask": None,
            "transformer_options": {"sigmas": torch.tensor([1.0]), layouts.LAYOUT_KEY: layouts.ImageLayout(h, w)}}
    _, runtime = attention_scope(pack, flux)
    with torch.no_grad():
        got = dit.DiTPatch(runtime, "attention").double_block(args, {"original_block": original})
        unmerged = original({**args, "img": img.clone(), "txt": txt.clone()})
        (plan,) = runtime.report().plans.values()
        assert plan.num_merged < h * w

        img_mod1, img_mod2 = block.img_mod(vec)
        txt_mod1, txt_mod2 = block.txt_mod(vec)

        def qkv(attn, norm, mod, x):
            x = attn.qkv(apply_mod(norm(x), 1 + mod.scale, mod.shift))
            q, k, v = x.view(B, x.shape[1], 3, H, -1).permute(2, 0, 3, 1, 4)
            q, k = attn.norm(q, k, v)
            return q, k, v

        def merged_rows(t):  # (B, H, N, D) image rows -> (B, H, N', D)
            rows = plan.merge(t.transpose(1, 2).reshape(B, h * w, -1))
            return rows.view(B, -1, H, t.shape[-1]).transpose(1, 2)

        (tq, tk, tv), (iq, ik, iv) = qkv(block.txt_attn, block.txt_norm1, txt_mod1, txt), \
            qkv(block.img_attn, block.img_norm1, img_mod1, img)
        q, k = apply_rope(torch.cat([tq, iq], 2), torch.cat([tk, ik], 2), pe)
        q, k, v = (torch.cat([t[:, :, :txt_len], merged_rows(t[:, :, txt_len:])], 2)
                   for t in (q, k, torch.cat([tv, iv], 2)))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, q.shape[2], -1)
        txt_attn, img_attn = attn[:, :txt_len], plan.unmerge(attn[:, txt_len:])
        img_out = img + apply_mod(block.img_attn.proj(img_attn), img_mod1.gate)
        img_out = img_out + apply_mod(block.img_mlp(apply_mod(block.img_norm2(img_out), 1 + img_mod2.scale,
                                                              img_mod2.shift)), img_mod2.gate)
        txt_out = txt + apply_mod(block.txt_attn.proj(txt_attn), txt_mod1.gate)
        txt_out = txt_out + apply_mod(block.txt_mlp(apply_mod(block.txt_norm2(txt_out), 1 + txt_mod2.scale,
                                                              txt_mod2.shift)), txt_mod2.gate)

    assert torch.allclose(got["img"], img_out, atol=1e-5) and torch.allclose(got["txt"], txt_out, atol=1e-5)
    assert not torch.allclose(got["img"], unmerged["img"], atol=1e-3)  # the merge changes the block


# -- scope keys/values and proportional attention, by hand ------------------------------------------------

class Clock:
    """A stand-in runtime for an override called by hand: no stage timing, notices collected."""

    def __init__(self):
        self.notices = []
        self.stages = self  # the runtime's StageClock, whose stage() times nothing here

    def stage(self, kind):
        import contextlib
        return contextlib.nullcontext()

    def notice(self, message, *args):
        self.notices.append(message % args)

    def unmerged(self, reason, message, *args):
        self.notices.append(message % args)


def reference_attention(q, k, v, bias=None, mask=None):
    """softmax(q k^T / sqrt(d) + bias + mask) v on (B, H, L, D) tensors; bias (B, Lk)."""
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if bias is not None:
        logits = logits + bias[:, None, None, :]
    if mask is not None:
        logits = logits + mask
    return logits.softmax(-1) @ v


def merged_rows_by_hand(plan, t, begin, tokens):
    """(B, H, L, D) with rows [begin, begin + tokens) merged by ``plan`` (M on the (B, N, H*D) view)."""
    B, H, _, D = t.shape
    rows = plan.merge(t[:, :, begin:begin + tokens].transpose(1, 2).reshape(B, tokens, H * D))
    return torch.cat([t[:, :, :begin], rows.view(B, -1, H, D).transpose(1, 2), t[:, :, begin + tokens:]], 2)


@pytest.mark.parametrize("layout", ["heads", "flat"])
@pytest.mark.parametrize("proportional", [False, True])
def test_keys_values_override_by_hand(pack, layout, proportional):
    """MergedKeysValues on a [txt, image, extra] sequence, in Flux's (B, H, L, D) layout with skip_reshape and
    Wan's (B, L, H*D): every query stays; the rotated keys and the values are both merged by the plan (M),
    text and extra tokens whole; with proportional each merged key's logits gain log(mass); a key mask is
    cut to the merged keys at the destinations' columns. ComfyUI's attention function runs the call."""
    from comfy.ldm.modules.attention import attention_pytorch
    from toma_core.plan import plan_tiles

    overrides = pack.nodes.adapters.attention_override
    B, H, D, txt, (h, w), extra = 2, 3, 16, 5, (6, 8), 3
    tokens, g = h * w, torch.Generator().manual_seed(0)
    L = txt + tokens + extra
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    plan = plan_tiles(torch.randn(B, tokens, 32, generator=g), (h, w), 4, 0.5, generator=g)
    mask = torch.randn(B, 1, L, L, generator=g)
    override = overrides.MergedKeysValues(Clock(), [(txt, tokens, plan)], L, proportional)
    func = getattr(attention_pytorch, "__wrapped__", attention_pytorch)
    if layout == "heads":
        out = override(func, q, k, v, H, skip_reshape=True, mask=mask)
    else:
        flat = [t.transpose(1, 2).reshape(B, L, H * D) for t in (q, k, v)]
        out = override(func, *flat, H, mask)  # the mask by position, as Qwen-Image and Lumina 2 pass it
    assert override.served and out.shape == (B, L, H * D)

    index = torch.cat([torch.arange(txt).expand(B, -1), plan.destination_tokens() + txt,
                       torch.arange(txt + tokens, L).expand(B, -1)], 1)
    keys, values = (merged_rows_by_hand(plan, t, txt, tokens) for t in (k, v))
    masks = torch.stack([mask[b][..., index[b]] for b in range(B)])
    bias = None
    if proportional:
        bias = torch.cat([torch.zeros(B, txt), plan.log_mass, torch.zeros(B, extra)], 1)
    expected = reference_attention(q, keys, values, bias, masks).transpose(1, 2).reshape(B, L, H * D)
    assert torch.allclose(out, expected, atol=1e-5)
    if proportional:
        plain = reference_attention(q, keys, values, None, masks).transpose(1, 2).reshape(B, L, H * D)
        assert not torch.allclose(out, plain, atol=1e-3)  # the masses change the attention


def keys_values_case(seed, B=2, H=2, D=8, txt=3, hw=(8, 8), extra=2, window=4):
    """Random q, k, v (B, H, L, D) over [txt, an h x w grid, extra] and a ToMA plan of the grid at ratio 0.5."""
    from toma_core.plan import plan_tiles
    g = torch.Generator().manual_seed(seed)
    tokens = hw[0] * hw[1]
    L = txt + tokens + extra
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    plan = plan_tiles(torch.randn(B, tokens, 16, generator=g), hw, window, 0.5, generator=g)
    return q, k, v, plan, L


def test_keys_values_merged_key_is_the_groups_average(pack):
    """Each merged key is M times the group's rotated keys, as each merged value is M times its values (not the
    destination token's own key): with the value rows set to the key rows, the attention call sees equal
    merged keys and values in every head."""
    overrides = pack.nodes.adapters.attention_override
    q, k, v, plan, L = keys_values_case(5)
    B, H, _, D = k.shape
    seen = {}

    def func(q, k, v, heads, **kwargs):
        seen.update(k=k, v=v)
        return q.transpose(1, 2).reshape(B, q.shape[2], heads * D)

    overrides.MergedKeysValues(Clock(), [(3, 64, plan)], L)(func, q, k, k.clone(), H, skip_reshape=True)
    expected = merged_rows_by_hand(plan, k, 3, 64)
    assert seen["k"].shape[2] == L - (64 - plan.num_merged)
    assert torch.allclose(seen["k"], expected, atol=1e-6) and torch.allclose(seen["k"], seen["v"], atol=1e-6)
    destination_keys = torch.stack([k[b][:, plan.destination_tokens()[b] + 3] for b in range(B)])
    assert not torch.allclose(seen["k"][:, :, 3:3 + plan.num_merged], destination_keys, atol=1e-3)


@pytest.mark.parametrize("layout", ["heads", "flat"])
def test_keys_values_with_proportional_attention_reproduce_groups_of_equal_keys(pack, layout):
    """Where every token of a merge window has one key (any values), merged keys and values with proportional
    attention give exactly the unmerged attention: each merged key is the window's key, and weighing it by
    its mass sums exp(q.k) over the tokens it stands for; without proportional attention the output differs."""
    from comfy.ldm.modules.attention import attention_pytorch

    overrides = pack.nodes.adapters.attention_override
    q, k, v, plan, L = keys_values_case(6)
    B, H, _, D = k.shape
    txt, (h, w), window = 3, (8, 8), 4
    # one key per 4x4 window (per batch row and head), the text and extra tokens keys of their own
    tiles = torch.randn(B, H, h // window, w // window, D, generator=torch.Generator().manual_seed(7))
    grid = tiles.repeat_interleave(window, 2).repeat_interleave(window, 3).reshape(B, H, h * w, D)
    k = torch.cat([k[:, :, :txt], grid, k[:, :, txt + h * w:]], 2)
    func = getattr(attention_pytorch, "__wrapped__", attention_pytorch)
    expected = reference_attention(q, k, v).transpose(1, 2).reshape(B, L, H * D)

    def call(proportional):
        override = overrides.MergedKeysValues(Clock(), [(txt, h * w, plan)], L, proportional)
        if layout == "heads":
            return override(func, q, k, v, H, skip_reshape=True)
        return override(func, *(t.transpose(1, 2).reshape(B, L, H * D) for t in (q, k, v)), H)

    assert torch.allclose(call(True), expected, atol=1e-5)
    assert not torch.allclose(call(False), expected, atol=1e-3)


def test_keys_values_override_passes_other_calls(pack):
    """Only the first call over the block's own sequence is its self-attention: a cross-attention call (other
    keys), and any call after the self-attention, pass to the attention function as they came."""
    overrides = pack.nodes.adapters.attention_override
    calls = []

    def func(q, k, v, heads, **kwargs):
        calls.append((q.shape[1], k.shape[1]))
        return q

    from toma_core.plan import plan_tiles
    g = torch.Generator().manual_seed(1)
    plan = plan_tiles(torch.randn(1, 16, 8, generator=g), (4, 4), 4, 0.5, generator=g)
    override = overrides.MergedKeysValues(Clock(), [(0, 16, plan)], 16)
    x, text = torch.randn(1, 16, 8), torch.randn(1, 16 + 1, 8)
    override(func, x, text, text, 2)  # cross-attention first: passes
    override(func, x, x, x, 2)
    override(func, x, x, x, 2)  # a later call over the same tokens: passes
    assert calls == [(16, 17), (16, 8), (16, 16)]


def test_proportional_attention_scope_by_hand(pack):
    """Scope attention with proportional attention: the merged joint attention [txt, merged image] weighs
    each merged key by its mass (extra-channel form), then unmerges the image rows."""
    from comfy.ldm.modules.attention import attention_pytorch
    from toma_core.plan import plan_tiles

    overrides = pack.nodes.adapters.attention_override
    B, H, D, txt, (h, w) = 2, 2, 8, 4, (4, 6)
    tokens, g = h * w, torch.Generator().manual_seed(2)
    L = txt + tokens
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    plan = plan_tiles(torch.randn(B, tokens, 16, generator=g), (h, w), 4, 0.5, generator=g)
    func = getattr(attention_pytorch, "__wrapped__", attention_pytorch)
    override = overrides.MergedAttention(Clock(), plan, txt, tokens, L, proportional=True)
    out = override(func, q, k, v, H, skip_reshape=True)
    mq, mk, mv = (merged_rows_by_hand(plan, t, txt, tokens) for t in (q, k, v))
    bias = torch.cat([torch.zeros(B, txt), plan.log_mass], 1)
    merged = reference_attention(mq, mk, mv, bias).transpose(1, 2).reshape(B, mq.shape[2], H * D)
    expected = torch.cat([merged[:, :txt], plan.unmerge(merged[:, txt:])], 1)
    assert torch.allclose(out, expected, atol=1e-5)


def test_keys_values_on_flux_keeps_every_query_and_stacks_an_override(pack, flux):
    """Scope keys/values on Flux: every block's attention keeps its 77 + 280 queries; merged blocks attend
    to the merged keys; another patch's override still sees every call and stays the model's."""
    lengths = []

    def counting(func, q, k, v, heads, *args, **kwargs):
        lengths.append((q.shape[2], k.shape[2]))
        return func(q, k, v, heads, *args, **kwargs)

    counted = flux.clone()
    counted.model_options.setdefault("transformer_options", {})[OVERRIDE] = counting
    patched, runtime = toma_patched(pack, counted, ratio=0.5, window=4, scope="keys/values")
    sample(patched, steps=1)
    merged = 77 + runtime.summary()["levels"]["two-stream 14x20"]["merged_tokens"]
    assert lengths == [(77 + 280, 77 + 280)] + [(77 + 280, merged)] * 4
    assert patched.model_options["transformer_options"][OVERRIDE] is counting


def test_keys_values_override_merges_each_grid_by_its_own_plan(pack):
    """Two grids in one sequence (Qwen-Image-Edit: the image, then a reference image, each with a plan of its
    own): each grid's keys and values are merged by its own plan; the text before and the tokens between
    and after stay whole."""
    from comfy.ldm.modules.attention import attention_pytorch
    from toma_core.plan import plan_tiles

    overrides = pack.nodes.adapters.attention_override
    B, H, D, txt, gap = 2, 2, 8, 3, 2
    g = torch.Generator().manual_seed(4)
    image = plan_tiles(torch.randn(B, 24, 16, generator=g), (4, 6), 4, 0.5, generator=g)
    reference = plan_tiles(torch.randn(B, 16, 16, generator=g), (4, 4), 4, 0.75, generator=g)
    spans = [(txt, 24, image), (txt + 24 + gap, 16, reference)]
    L = txt + 24 + gap + 16 + 1
    q, k, v = (torch.randn(B, L, H * D, generator=g) for _ in range(3))
    func = getattr(attention_pytorch, "__wrapped__", attention_pytorch)
    out = overrides.MergedKeysValues(Clock(), spans, L, proportional=True)(func, q, k, v, H)

    keys, values, bias, cursor = [], [], [], 0
    for begin, tokens, plan in spans:
        keys += [k[:, cursor:begin], plan.merge(k[:, begin:begin + tokens])]
        values += [v[:, cursor:begin], plan.merge(v[:, begin:begin + tokens])]
        bias += [torch.zeros(B, begin - cursor), plan.log_mass]
        cursor = begin + tokens
    keys += [k[:, cursor:]]
    values += [v[:, cursor:]]
    bias += [torch.zeros(B, L - cursor)]
    keys, values, bias = torch.cat(keys, 1), torch.cat(values, 1), torch.cat(bias, 1)
    heads = [t.view(B, t.shape[1], H, D).transpose(1, 2) for t in (q, keys, values)]
    expected = reference_attention(*heads, bias).transpose(1, 2).reshape(B, L, H * D)
    assert keys.shape[1] == L - (24 - image.num_merged) - (16 - reference.num_merged)
    assert torch.allclose(out, expected, atol=1e-5)
