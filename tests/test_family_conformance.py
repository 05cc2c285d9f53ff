"""Every DiT family passes the same checks: one table, one row per model (a family declaration in
nodes/adapters/families.py, a tiny random-weight model built from ComfyUI's own classes, how to sample
it), each check run for every row through ComfyUI's sampler. A row whose model class the ComfyUI tree
lacks is skipped, saying which tree has it. The family test files keep only what is a family's own.

The checks: ratio 0 is bit-identical to the unpatched model; merging into every token (every token a
destination) reproduces it; ratio 0.5 merges half of each block group's grid on odd, non-square and
square sizes, batch 1 and 2, short and long text, 1, 5 and 9 latent frames for video, and the stats name
exactly those grids; a LoRA applies on either side of the node; the input model is untouched; no state
leaks from one run into the next; of two stacked token merge nodes the nearer one merges, and the
stats of the other say which node took its blocks; the basic node and every scope compile clean under
ComfyUI's TorchCompileModel.
"""
import contextlib
import importlib
import math
import types
from dataclasses import dataclass

import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models, sampling
from toma_bench.metrics import relative_l2

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]


@dataclass(frozen=True, eq=False)
class Row:
    """A model of one DiT family: ``family`` names its declaration in families.py; ``host`` the
    comfy.supported_models class a ComfyUI tree must have (``tree``: the setup script of the first test
    tree that has it); ``build()`` its ModelPatcher; ``text(batch, tokens, seed)`` its conditioning;
    latents are (B, ``channels``, [frames,] H, W), with a frames axis for ``video`` and ``frame_axis``
    (Qwen-Image, Krea 2: one Wan-VAE frame), or what ``latent`` makes (a nested latent, compared flattened), ``patch`` latent pixels a token per side; ``sizes`` {"odd": odd and
    non-square, "square": ...} in latent pixels; ``texts`` (short, long) text lengths; ``lora_key`` a
    weight inside a merged block; ``bound`` the relative L2 ratio 0.5 stays under (2 steps of the random
    model: a few times what was measured)."""

    family: str
    host: str
    tree: str
    build: object
    text: object
    channels: int
    patch: int
    sizes: dict
    texts: tuple
    lora_key: str
    bound: float = 0.25
    video: bool = False
    frame_axis: bool = False
    latent: object = None  # (batch, frames, (h, w)) -> the model's empty latent, where not one tensor (MiniMax-H3)
    max_batch: int | None = None  # the largest batch the model takes (MiniMax-H3: 1); the checks' batches are capped
    # the module of a stand-in for trees that lack the model (its installed() and missing(): Qwen-Image 2.1)
    stand_in: str | None = None
    # the least relative change ratio 0.5 must make (dit_checks.check_half_ratio_merges); 0 where the model's
    # weights make the default merge exact (then the keys reaching the attention show that it merged)
    floor: float = dit_checks.MERGED_FLOOR


def text(context_dim, **options):
    return lambda batch, tokens, seed: models.text_conditioning(context_dim, batch, tokens, seed, **options)


def nextdit_text(config):
    """Lumina 2 / Z-Image: one caption row with its attention mask, as the text encoder gives it."""
    return lambda batch, tokens, seed: models.text_conditioning(
        config["cap_feat_dim"], 1, tokens, seed, attention_mask=torch.ones(1, tokens, dtype=torch.long))


def qwen_image21():
    """The Qwen-Image 2.1 stand-in's module (imported once ComfyUI is)."""
    return importlib.import_module("toma_bench.qwen_image21")


QWEN_IMAGE21_TEXT = 32  # the stand-in's TINY context_in_dim
def hunyuan15_text(config, glyphs=8, vision=9):
    """HunyuanVideo 1.5: Qwen text, ``glyphs`` byT5 tokens and ``vision`` SigLIP tokens (the model puts them before
    the text, in the order [vision, glyphs, text]), each batch row its own."""
    def conditioning(batch, tokens, seed):
        g = torch.Generator().manual_seed(1000 + seed)
        glyph = torch.randn(batch, glyphs, models.BYT5_WIDTH, generator=g)
        siglip = types.SimpleNamespace(
            last_hidden_state=torch.randn(batch, vision, config["vision_in_dim"], generator=g))
        return models.text_conditioning(config["context_in_dim"], batch, tokens, seed, pooled_output=None,
                                        conditioning_byt5small=glyph, clip_vision_output=siglip)
    return conditioning


CURRENT, NEWEST, TREE_2026 = "tests/setup_current.sh", "tests/setup_newest.sh", "tests/setup_2026.sh"
TREES = {CURRENT: ".comfyui-current", NEWEST: ".comfyui-newest", TREE_2026: ".comfyui-2026"}  # what each script makes
IMAGE = {"odd": (27, 39), "square": (16, 16)}  # patch 2: 14x20 tokens (no window of 4 divides it), 8x8
ROWS = {
    "flux": Row("FLUX", "Flux", CURRENT, lambda: models.build_flux(seed=1),
                lambda b, t, s: models.dit_conditioning("flux", models.FLUX_TINY, b, t, s), 16, 2, IMAGE, (77, 256),
                "diffusion_model.single_blocks.2.linear2.weight"),
    "sd3": Row("SD3", "SD3", CURRENT, lambda: models.build_sd3(seed=2),
               lambda b, t, s: models.dit_conditioning("sd3", models.SD3_TINY, b, t, s), 16, 2, IMAGE, (77, 256),
               "diffusion_model.joint_blocks.1.x_block.mlp.fc2.weight"),
    "chroma": Row("CHROMA", "Chroma", CURRENT, lambda: models.build_chroma(seed=21),
                  text(models.CHROMA_TINY["context_in_dim"], pooled_output=None), 16, 2, IMAGE, (77, 512),
                  "diffusion_model.single_blocks.2.linear2.weight", bound=0.15),
    "qwen_image": Row("QWEN_IMAGE", "QwenImage", CURRENT, lambda: models.build_qwen_image(seed=11),
                      text(models.QWEN_IMAGE_TINY["joint_attention_dim"]), 16, 2, IMAGE, (77, 512),
                      "diffusion_model.transformer_blocks.2.img_mlp.net.2.weight", bound=0.05, frame_axis=True),
    "lumina2": Row("LUMINA", "Lumina2", CURRENT, lambda: models.build_nextdit(models.LUMINA2_TINY, seed=41),
                   nextdit_text(models.LUMINA2_TINY), 16, 2, IMAGE, (23, 40),
                   "diffusion_model.layers.2.attention.qkv.weight"),
    "hunyuan_video": Row("HUNYUAN_VIDEO", "HunyuanVideo", CURRENT, lambda: models.build_hunyuan_video(seed=1),
                         lambda b, t, s: models.video_conditioning("hunyuan_video", models.HUNYUAN_VIDEO_TINY, b, t, s),
                         16, 2, {"odd": (14, 22), "square": (12, 12)}, (77, 512),
                         "diffusion_model.single_blocks.1.linear1.weight", bound=0.1, video=True),
    "ltxv": Row("LTXV", "LTXV", CURRENT, lambda: models.build_ltxv(seed=1),
                lambda b, t, s: models.video_conditioning("ltxv", models.LTXV_TINY, b, t, s),
                models.LTXV_TINY["in_channels"], 1, {"odd": (7, 11), "square": (8, 8)}, (128, 512),
                "diffusion_model.transformer_blocks.2.attn1.to_v.weight", bound=0.1, video=True),
    "wan": Row("WAN", "WAN21_T2V", CURRENT, lambda: models.build_wan("t2v", seed=1),
               lambda b, t, s: models.wan_conditioning(models.WAN_TINY, b, t, s), 16, 2,
               {"odd": (13, 19), "square": (12, 16)}, (77, 512), "diffusion_model.blocks.2.self_attn.v.weight",
               bound=0.1, video=True),
    "hidream": Row("HIDREAM", "HiDream", CURRENT, lambda: models.build_hidream(seed=43),
                   lambda b, t, s: models.hidream_conditioning(models.HIDREAM_TINY, b, t, s), 16, 2, IMAGE, (23, 77),
                   "diffusion_model.single_stream_blocks.1.block.ff_i.shared_experts.w2.weight"),
    "z_image": Row("LUMINA", "ZImage", NEWEST, lambda: models.build_nextdit(models.Z_IMAGE_TINY, seed=42),
                   nextdit_text(models.Z_IMAGE_TINY), 16, 2, IMAGE, (23, 40),
                   "diffusion_model.layers.2.attention.qkv.weight"),
    "flux2": Row("FLUX", "Flux2", NEWEST, lambda: models.build_flux2(seed=51),
                 text(models.FLUX2_TINY["context_in_dim"], guidance=4.0, pooled_output=None), 128, 1,
                 {"odd": (13, 19), "square": (16, 16)}, (40, 77), "diffusion_model.single_blocks.2.linear2.weight"),
    "hunyuan_video15": Row("HUNYUAN_VIDEO", "HunyuanVideo15", NEWEST,
                           lambda: models.build_hunyuan_video15(seed=52, config=models.HUNYUAN_VIDEO15_BYT5_TINY),
                           hunyuan15_text(models.HUNYUAN_VIDEO15_BYT5_TINY), 32, 1,
                           {"odd": (13, 19), "square": (6, 6)}, (16, 77),
                           "diffusion_model.double_blocks.2.img_mlp.0.weight", video=True),
    # issue 46's model (part 6): the row above with its weights drawn as the issue drew them (models.normal_init_),
    # QK-norm scales near 0.01, so every attention map is near uniform and the default's proportional attention
    # reproduces the unmerged output (2.5e-6); the check that it merged is the keys its attention sees
    "hunyuan_video15_uniform": Row("HUNYUAN_VIDEO", "HunyuanVideo15", NEWEST,
                                   lambda: models.build_hunyuan_video15(seed=52, config=models.HUNYUAN_VIDEO15_BYT5_TINY,
                                                                        init=models.normal_init_),
                                   hunyuan15_text(models.HUNYUAN_VIDEO15_BYT5_TINY), 32, 1,
                                   {"odd": (13, 19), "square": (6, 6)}, (16, 77),
                                   "diffusion_model.double_blocks.2.img_mlp.0.weight", video=True, floor=0.0),
    "krea2": Row("KREA2", "Krea2", TREE_2026, lambda: models.build_krea2(seed=71),
                 text(models.KREA2_TINY["txtlayers"] * models.KREA2_TINY["txtdim"]), 16, 2, IMAGE, (23, 40),
                 "diffusion_model.blocks.2.attn.wv.weight", frame_axis=True),
    # Qwen-Image 2.1 as its model file is now (prefix pass, in-place residual, malloc-graph bracketing, FunControl)
    # and as it first was (b806797): the stand-in builds either (qwen_image21.build's follows); the prefix cache is on
    # in every run (the model's default), so every step after the first runs the target's rows alone
    "qwen_image21": Row("QWEN_IMAGE21", "QwenImage21", TREE_2026, lambda: qwen_image21().build(seed=81),
                        text(QWEN_IMAGE21_TEXT), 64, 1, {"odd": (13, 19), "square": (8, 8)}, (11, 40),
                        "diffusion_model.transformer_blocks.2.img_mlp.out.weight", stand_in="toma_bench.qwen_image21"),
    "qwen_image21_first": Row("QWEN_IMAGE21", "QwenImage21", TREE_2026,
                              lambda: qwen_image21().build(seed=81, follows=qwen_image21().FOLLOWS),
                              text(QWEN_IMAGE21_TEXT), 64, 1, {"odd": (13, 19), "square": (8, 8)}, (11, 40),
                              "diffusion_model.transformer_blocks.2.img_mlp.out.weight",
                              stand_in="toma_bench.qwen_image21"),
    "minimax_h3": Row("MINIMAX_H3", "MiniMaxH3", TREE_2026, lambda: models.build_minimax_h3(seed=61),
                      text(models.MINIMAX_H3_TINY["text_dim"]), models.MINIMAX_H3_TINY["latents_dim"], 2,
                      {"odd": (13, 19), "square": (12, 12)}, (11, 40), "diffusion_model.blocks.2.attn.qkv_proj.weight",
                      bound=0.1, video=True, latent=lambda batch, frames, size: models.minimax_h3_latent(batch, frames, size),
                      max_batch=1),
}
NAMES = sorted(ROWS)
# Half ratio: every size, batch and text length once, and 1, 5 and 9 latent frames on video:
# (size, batch, text (0 short, 1 long), latent frames)
IMAGE_CASES = [("odd", 1, 0, 5), ("square", 2, 1, 5)]
VIDEO_CASES = [("odd", 2, 1, 1), ("square", 1, 0, 5), ("odd", 1, 0, 9)]


def capped(row, batch: int) -> int:
    """``batch``, or the row's largest batch where that is smaller."""
    return batch if row.max_batch is None else min(batch, row.max_batch)


HALF_RATIO = [pytest.param(name, case, id=f"{name}-{case[0]}-batch{case[1]}-text{case[2]}-frames{case[3]}")
              for name in NAMES for case in [(size, capped(ROWS[name], batch), text, frames) for size, batch, text, frames
                                             in (VIDEO_CASES if ROWS[name].video else IMAGE_CASES)]]
# Every token a destination: windows of 2 x 2 tokens over one frame, and fewer merged than a window holds
EXACT = {"ratio": 0.1, "window": 2, "temporal_window": 1}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread while this module runs: on tensors this small OpenMP's fork and join cost
    more than they save, and on a shared CPU many times more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stand_ins(pack):
    """{row name: why its stand-in cannot run in this ComfyUI}; the other rows' stand-ins installed while this
    module runs (each leaves a tree with the model of its own alone)."""
    reasons = {}
    with contextlib.ExitStack() as stack:
        for name, row in ROWS.items():
            if row.stand_in is None:
                continue
            try:
                module = importlib.import_module(row.stand_in)
            except ImportError as e:
                reasons[name] = f"{row.stand_in} does not import in this ComfyUI ({e})"
                continue
            reasons[name] = module.missing()
            if reasons[name] is None:
                stack.enter_context(module.installed())
        yield reasons


@pytest.fixture
def row(request, pack, stand_ins):
    """The table's row ``request.param``, skipped where this ComfyUI lacks its model class (and its stand-in cannot
    run)."""
    import comfy.supported_models

    row = ROWS[request.param]
    if stand_ins.get(request.param):
        pytest.skip(stand_ins[request.param])
    if not hasattr(comfy.supported_models, row.host):
        pytest.skip(f"{row.host} is not in this ComfyUI: bash {row.tree}, then COMFYUI_PATH={TREES[row.tree]}")
    return row


@pytest.fixture(scope="module")
def built():
    """{Row: ModelPatcher} built so far, released with the module (ComfyUI's patchers must not outlive
    the interpreter's teardown of comfy's modules)."""
    patchers = {}
    yield patchers
    patchers.clear()


@pytest.fixture
def model(row, built):
    """The row's ModelPatcher, built once; tests only ever patch clones of it."""
    if row not in built:
        built[row] = row.build()
    return built[row]


every_family = pytest.mark.parametrize("row", NAMES, indirect=True)


def family_of(pack, row):
    return getattr(pack.nodes.adapters.families, row.family)


def sample(row, model, size="odd", batch=1, text=0, frames=5, cfg=1.0, seed=0, steps=2):
    """The sampled latent (a nested one flattened: (B, every stream's values)), the batch capped to the row's."""
    batch = capped(row, batch)
    if row.latent is not None:
        latent = row.latent(batch, frames, row.sizes[size])
    else:
        frame_axis = [frames] if row.video else [1] if row.frame_axis else []
        latent = torch.zeros(batch, row.channels, *frame_axis, *row.sizes[size])
    out = sampling.sample(model, row.text(batch, row.texts[text], seed), latent, steps=steps, cfg=cfg,
                          scheduler="simple", seed=seed)
    if getattr(out, "is_nested", False):
        return torch.cat([t.flatten(1) for t in out.unbind()], dim=1)
    return out


def grid(row, size="odd", frames=5) -> tuple[int, ...]:
    """The token grid of a latent of ``size`` (and ``frames``, on video)."""
    h, w = (-(-side // row.patch) for side in row.sizes[size])
    return (frames, h, w) if row.video else (h, w)


def levels(pack, row, model, size="odd", frames=5) -> list[str]:
    """The levels the stats name, in block order: each block group with merged blocks, on the call's grid."""
    dm = model.model.diffusion_model
    name = "x".join(map(str, grid(row, size, frames)))
    return [f"{g.group} {name}" for g in family_of(pack, row).groups
            if hasattr(dm, g.blocks) and g.merged(len(getattr(dm, g.blocks)))]


def expected_patch_points(pack, row, model) -> set:
    """The patch points (dit_checks.patch_points) the declaration says the node sets: every block of each
    group but the first ones."""
    family, dm = family_of(pack, row), model.model.diffusion_model
    merged = [(g, i) for g in family.groups if hasattr(dm, g.blocks) for i in g.merged(len(getattr(dm, g.blocks)))]
    if family.intercept == pack.nodes.adapters.family.REPLACE:
        return {(g.hook, i) for g, i in merged}
    return {f"diffusion_model.{g.blocks}.{i}.forward" for g, i in merged}


@every_family
def test_the_adapter_of_the_model_is_its_declaration(pack, row, model):
    assert pack.nodes.adapters.adapter_for(model) is family_of(pack, row)


@every_family
def test_ratio_zero_is_identical_to_unpatched(pack, row, model):
    dit_checks.check_ratio_zero_identical(pack, model, lambda m: sample(row, m, batch=2))


@every_family
def test_merging_into_every_token_reproduces_the_unpatched_model(pack, row, model):
    """Every token of a window a destination: merging only permutes the grid's tokens, and with each
    token's own position rows the output is the unpatched model's (batch rows and CFG batches too)."""
    patched, runtime = dit_checks.toma_patched(pack, model, **EXACT)
    dit_checks.check_merging_only_permutes(patched, model, lambda m: sample(row, m, batch=2, cfg=2.0))
    assert list(runtime.summary()["levels"]) == levels(pack, row, model)


@pytest.mark.parametrize("row, case", HALF_RATIO, indirect=["row"])
def test_half_ratio_merges_every_group_on_every_shape(pack, row, model, case):
    """Ratio 0.5 at the node's defaults (dit_checks.check_half_ratio_merges, the row's floor) and, wherever an
    attention override reaches the model, its attention sees half the grid's keys fewer in each merged block: a merge
    that does not reach the attention fails even where the output cannot show it (a floor of 0)."""
    size, batch, text_length, frames = case
    tokens = math.prod(grid(row, size, frames))
    counted, seen = dit_checks.attention_lengths(model)
    calls = {}

    def run(m):
        seen.clear()
        out = sample(row, m, size, batch, text_length, frames)
        calls["patched" if m is not counted else "unpatched"] = list(seen)
        return out

    dit_checks.check_half_ratio_merges(dit_checks.toma_patched(pack, counted), counted, run,
                                       levels(pack, row, model, size, frames), tokens, bound=row.bound,
                                       floor=row.floor)
    if row_name(row) not in NO_ATTENTION_OVERRIDE:
        dit_checks.assert_keys_merged(calls["unpatched"], calls["patched"], tokens)


@every_family
def test_lora_applies_on_either_side_of_the_node(pack, row, model):
    """With every token a destination, a LoRA'd model gives the unpatched LoRA'd output whether the LoRA
    comes before or after the node, and the node's own model stays as it was."""
    def run(m):
        return sample(row, m)

    with_lora = run(dit_checks.lora_clone(model, row.lora_key))
    assert relative_l2(with_lora, run(model)) > 1e-3
    before, runtime = dit_checks.toma_patched(pack, dit_checks.lora_clone(model, row.lora_key), **EXACT)
    toma, _ = dit_checks.toma_patched(pack, model, **EXACT)
    plain = run(toma)
    after = dit_checks.lora_clone(toma, row.lora_key)
    assert relative_l2(run(before), with_lora) < 1e-5 and relative_l2(run(after), with_lora) < 1e-5
    assert torch.equal(run(toma), plain)
    assert runtime.summary()["levels"]


@every_family
def test_the_input_model_is_untouched(pack, row, model):
    """The node patches a clone: exactly the declared blocks of each group but its first, the layout
    wrapper on the clone only; the input stays as it was."""
    dit_checks.check_input_model_unchanged(pack, model, lambda m: sample(row, m),
                                           expected_patch_points(pack, row, model),
                                           family_of(pack, row).wrapper_of(model).lower())


@every_family
def test_no_state_leaks_between_runs(pack, row, model):
    patched, runtime = dit_checks.toma_patched(pack, model)
    dit_checks.check_no_state_leak(pack, patched, runtime, lambda m: sample(row, m),
                                   lambda m: sample(row, m, "square", batch=2, text=1, seed=7), grid(row))


@every_family
def test_two_stacked_nodes_the_nearer_merges_and_each_says_what_it_merged(pack, row, model, sent):
    """Two ToMA nodes on one model: the one nearer the sampler merges every block both would (the stack
    samples as that node alone), its stats name the grids it merged, and the other node's stats name the
    node that took its blocks. The other node's own model still merges by itself."""
    node = pack.nodes.toma_nodes.ToMAPatchModel()
    (inner,) = node.patch(model, 0.75, 4, 5, unique_id="inner")
    (outer,) = node.patch(inner, 0.25, 4, 5, unique_id="outer")
    (alone,) = node.patch(model, 0.25, 4, 5)

    out = sample(row, outer)

    assert torch.equal(out, sample(row, alone))
    assert dit_checks.patch_points(outer) == dit_checks.patch_points(inner)
    lines = {data["node"]: data["lines"] for _, data, _ in sent}
    expected = levels(pack, row, model)
    merged = [line for line in lines["outer"][:-1] if not line.startswith("rotation on")]  # the kind's rotation
    assert [line.split(":")[0] for line in merged] == expected
    assert lines["inner"][:-1] == [f"{level}: left to the ToMA node nearer the sampler, which took its blocks"
                                   for level in expected]
    sent.clear()
    sample(row, inner)
    (inner_lines,) = [data["lines"] for _, data, _ in sent if data["node"] == "inner"]
    assert [line.split(":")[0] for line in inner_lines[:-1] if not line.startswith("rotation on")] == expected
    assert not any("left to" in line for line in inner_lines)


# Scope keys/values: every family but SD3 (whose attention takes no override) merges only the keys and
# values of its blocks' self-attention; SD3 merges whole blocks instead, logged.
KEYS_VALUES = {"scope": "keys/values"}
NO_ATTENTION_OVERRIDE = {"sd3"}
# keys/values without proportional attention: Qwen-Image 2.1's extra key channels would reach its cached prefix keys
NO_PROPORTIONAL = {"qwen_image21", "qwen_image21_first"}


def fell_back(caplog) -> bool:
    return any("cannot merge with scope keys/values" in r.getMessage() for r in caplog.records)


@every_family
def test_keys_values_ratio_zero_is_identical_and_every_token_reproduces_the_unpatched_model(pack, row, model, caplog):
    """Ratio 0 is the unpatched model bit for bit; with every token a destination the keys are a permutation
    of the model's own (each with its RoPE) and the values too, so the output is the unpatched model's
    (batch rows and CFG batches too); each family that has an attention override keeps scope keys/values."""
    dit_checks.check_ratio_zero_identical(pack, model, lambda m: sample(row, m, batch=2), advanced=KEYS_VALUES)
    with caplog.at_level("WARNING", logger=dit_checks.LOGGER):
        patched, runtime = dit_checks.toma_patched(pack, model, **EXACT, **KEYS_VALUES)
    assert fell_back(caplog) == (row_name(row) in NO_ATTENTION_OVERRIDE)
    dit_checks.check_merging_only_permutes(patched, model, lambda m: sample(row, m, batch=2, cfg=2.0))
    assert list(runtime.summary()["levels"]) == levels(pack, row, model)


@pytest.mark.parametrize("row, case", HALF_RATIO, indirect=["row"])
def test_keys_values_merges_only_keys_and_values(pack, row, model, case, caplog):
    """Ratio 0.5 with scope keys/values: every attention call keeps the queries it has unpatched, the
    self-attention of each merged block sees the merged keys (half the grid's fewer), the stats name exactly
    the merged grids, and the output changes, a little, and not as whole blocks change it. SD3 merges whole
    blocks, logged."""
    size, batch, text_length, frames = case
    run = lambda m: sample(row, m, size, batch, text_length, frames)  # noqa: E731
    tokens = math.prod(grid(row, size, frames))
    counted, seen = dit_checks.attention_lengths(model)
    with caplog.at_level("WARNING", logger=dit_checks.LOGGER):
        patched = dit_checks.toma_patched(pack, counted, **KEYS_VALUES)
    out, _ = dit_checks.check_half_ratio_merges(patched, model, run, levels(pack, row, model, size, frames), tokens,
                                                bound=row.bound)
    block = run(dit_checks.toma_patched(pack, model, scope="block")[0])
    if row_name(row) in NO_ATTENTION_OVERRIDE:
        assert fell_back(caplog) and torch.equal(out, block)
        return
    assert not fell_back(caplog) and not torch.equal(out, block)
    seen.clear()
    run(counted)
    unpatched = list(seen)
    seen.clear()
    run(patched[0])
    assert [q for q, _ in seen] == [q for q, _ in unpatched]
    dit_checks.assert_keys_merged(unpatched, seen, tokens)


@every_family
def test_per_block_plans_plan_each_block_and_shared_destinations_share_the_first_blocks(pack, row, model):
    """plan_per_block: each merged block plans for itself (one plan per block, keyed by the block), so the
    output differs from one plan per group; with shared_destinations every block of a group weighs its own
    tokens to the destinations its group's first block chose. (The kind's scope is named: under "auto" the
    video preset plans per block already.)"""
    scope = pack.nodes.toma_nodes.preset_of(model).scope
    shared = sample(row, dit_checks.toma_patched(pack, model, scope=scope)[0])
    patched, runtime = dit_checks.toma_patched(pack, model, scope=scope, plan_per_block=True)
    own = sample(row, patched)
    plans = runtime.report().plans
    dm, family = model.model.diffusion_model, family_of(pack, row)
    blocks = {(g.group, (g.hook, i)) for g in family.groups if hasattr(dm, g.blocks)
              for i in g.merged(len(getattr(dm, g.blocks)))}
    assert {(key.level.group, key.block) for key in plans} == blocks
    several = len(blocks) > len({group for group, _ in blocks})  # a group of one merged block plans as before
    assert torch.equal(own, shared) != several
    patched, runtime = dit_checks.toma_patched(pack, model, scope=scope, plan_per_block=True,
                                               shared_destinations=True)
    together = sample(row, patched)
    report = runtime.report()
    assert {(key.level.group, key.block) for key in report.plans} == blocks
    for key, plan in report.plans.items():
        first = report.shared_destinations[(key.level, key.rows)]
        assert torch.equal(plan.destinations, first)
    assert not several or (not torch.equal(together, own) and not torch.equal(together, shared))


@every_family
def test_proportional_attention_weighs_merged_keys_or_says_it_does_not(pack, row, model, sent):
    """Scope keys/values with proportional attention: each merged key weighs as the tokens it stands for,
    which changes the output. With scope block (and SD3, which falls back to it) it is not honoured: the
    output is the block scope's, and the log and the stats say so; nor on Qwen-Image 2.1 at keys/values
    (NO_PROPORTIONAL): there the output is keys/values' without it."""
    node = pack.nodes.toma_nodes.ToMAPatchModelAdvanced()
    without = sample(row, dit_checks.toma_patched(pack, model, **KEYS_VALUES)[0])
    (weighted,) = node.patch(model, 0.5, 4, 5, proportional_attention=True, unique_id="kv", **KEYS_VALUES)
    (block,) = node.patch(model, 0.5, 4, 5, scope="block", proportional_attention=True, unique_id="block")
    out = sample(row, weighted)
    block_out = sample(row, block)
    lines = {data["node"]: data["lines"] for _, data, _ in sent}
    assert torch.equal(block_out, sample(row, dit_checks.toma_patched(pack, model, scope="block")[0]))
    assert any("proportional attention is not honoured" in line for line in lines["block"])
    if row_name(row) in NO_ATTENTION_OVERRIDE | NO_PROPORTIONAL:
        assert torch.equal(out, without if row_name(row) in NO_PROPORTIONAL else block_out)
        assert any("proportional attention is not honoured" in line for line in lines["kv"])
        return
    assert not torch.equal(out, without) and relative_l2(out, without) < row.bound
    assert not any("proportional" in line for line in lines["kv"])


def row_name(row) -> str:
    return next(name for name, r in ROWS.items() if r is row)


# Families whose own model breaks the graph under torch.compile, patched or not
MODEL_BREAKS_GRAPH = {"hidream": "HiDream's MoE routes tokens with boolean masks (sizes that depend on the data): "
                                 "the unpatched model breaks the graph too"}
# ... and whose breaks sit outside the blocks: there the patched model must compile as the unpatched one does
# (dit_checks.check_compiles_clean with the unpatched model's count)
BREAKS_OUTSIDE_BLOCKS = {"minimax_h3": "MiniMax-H3's forward reads its timestep on the host (float(), Tensor.item())"}
# ... and whose breaks an option of its own turns off: compiled with those transformer_options. Qwen-Image 2.1's
# forward compares its prefix cache key on the host (torch.equal) to pick the cache's slot, a break per traced call
# patched or not (their count follows the recompiles); with the cache off (the QwenImage21Cache node's device "off")
# it compiles in one graph, so ToMA's blocks are checked to compile clean there
COMPILED_WITH = {name: {"qwen_image21_cache": {"device": "off"}} for name in ("qwen_image21", "qwen_image21_first")}


def check_feed_forward_steps_aside_under_compile(pack, row, model):
    """Scope feed-forward does not merge under torch.compile (compiled, its submodules did not see the block
    call's merge in ComfyUI v0.3.64): compiled it runs every block unmerged, as the unpatched model compiles,
    in one graph, counted under its reason; eager it merges."""
    from toma_bench import compiling
    patched, runtime = dit_checks.toma_patched(pack, model, scope="feed-forward")
    run = lambda m: sample(row, m, steps=2)
    with compiling.constant_free_memory():
        assert relative_l2(run(patched), run(model)) > 1e-4  # eager: merged
        assert not runtime.report().unmerged
        with compiling.counting() as count:
            out = run(compiling.compiled(patched, backend="eager"))
        reference = run(compiling.compiled(model, backend="eager"))
    reason = pack.nodes.adapters.dit.FEED_FORWARD_COMPILED
    assert runtime.report().unmerged.get(reason, 0) > 0, runtime.report().unmerged
    assert count.clean() and count.graphs == 1, str(count)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@every_family
def test_compiles_clean(pack, row, model):
    """Under ComfyUI's TorchCompileModel (dynamo backend "eager", toma_bench.compiling): the basic node
    at its defaults and the Advanced node at every scope the family honours compile without a graph
    break or a frame left to eager, one graph per merge path, none new in a second run, with the eager
    output and the same plans (dit_checks.check_compiles_clean); a model that breaks the graph outside its
    blocks (BREAKS_OUTSIDE_BLOCKS) breaks it patched only as it does unpatched; one whose breaks an option turns
    off compiles with it (COMPILED_WITH)."""
    if row_name(row) in MODEL_BREAKS_GRAPH:
        pytest.skip(MODEL_BREAKS_GRAPH[row_name(row)])
    if row_name(row) in COMPILED_WITH:
        model = model.clone()
        model.model_options.setdefault("transformer_options", {}).update(COMPILED_WITH[row_name(row)])
    placement = pack.nodes.placement
    (basic,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(model, 0.5, 4, 5)
    scopes = [scope for scope in family_of(pack, row).placements if scope != placement.FEED_FORWARD]
    cases = [basic] + [dit_checks.toma_patched(pack, model, scope=scope)[0] for scope in scopes]
    if placement.FEED_FORWARD in family_of(pack, row).placements:
        check_feed_forward_steps_aside_under_compile(pack, row, model)
    unpatched = None
    if row_name(row) in BREAKS_OUTSIDE_BLOCKS:
        unpatched = dit_checks.compile_count(model, lambda m: sample(row, m, steps=3))
        assert unpatched.breaks, f"{BREAKS_OUTSIDE_BLOCKS[row_name(row)]} no longer: it belongs in the plain check"
    for patched in cases:
        dit_checks.check_compiles_clean(pack, patched, lambda m: sample(row, m, steps=3), unpatched=unpatched)
