"""ToMA on Flux and SD3.5-style MMDiT: what is their own (Kontext reference tokens, the block call row by
row, SD3's last block without text, the real 1024x1024 latent); the checks every DiT family passes are
in tests/test_family_conformance.py. Random-weight models sampled through ComfyUI's own sampler.

Latents: an odd 27x39 whose 14x20 token grid no window of 4 divides; one test runs the real 128x128
latent of a 1024x1024 image with a tiny-width model for one step.
"""
import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models, sampling
from dit_checks import toma_patched

pytestmark = [pytest.mark.comfy,
              pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

CONFIGS = {"flux": models.FLUX_TINY, "sd3": models.SD3_TINY}
SIZES = {"odd": (27, 39)}


@pytest.fixture(scope="module")
def built(pack):
    """{arch: ModelPatcher}, built once; tests only ever patch clones of them."""
    return {"flux": models.build_flux(seed=1), "sd3": models.build_sd3(seed=2)}


def sample(model, arch, hw, batch=1, tokens=77, steps=2, cfg=1.0, seed=0, reference=None, config=None):
    conditioning = models.dit_conditioning(arch, config or CONFIGS[arch], batch, tokens, seed, reference)
    return sampling.sample(model, conditioning, torch.zeros(batch, 16, *hw), steps=steps, cfg=cfg,
                           scheduler="simple", seed=seed)


def test_kontext_reference_tokens_stay_unmerged(pack, built):
    """A Kontext reference image (its tokens follow the image tokens) changes nothing in the D = S case
    above, and at ratio 0.5 only the image grid is counted and merged."""
    model = built["flux"]
    reference = models.structured_latent(1, 20, 14, seed=3, channels=16)
    exact, _ = toma_patched(pack, model, ratio=0.1, window=2)
    dit_checks.check_merging_only_permutes(exact, model, lambda m: sample(m, "flux", SIZES["odd"], reference=reference))
    half_patched, half = toma_patched(pack, model)
    out = sample(half_patched, "flux", SIZES["odd"], reference=reference)
    assert torch.isfinite(out).all()
    assert {k: v["tokens"] for k, v in half.summary()["levels"].items()} == {"two-stream 14x20": 280,
                                                                               "joint 14x20": 280}


def _flux_call(pack, model, h, w, txt_len, extra_hw, batch=2):
    """Inputs of one Flux block call built the way Flux builds them: pe from (index, row, col) ids with
    text first, then the h x w image, then a Kontext reference of extra_hw on index 1."""
    dm = model.model.diffusion_model
    g = torch.Generator().manual_seed(4)

    def grid_ids(index, rows, cols):
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        return torch.stack([torch.full_like(r, index), r, c], -1).view(-1, 3).float()

    ids = torch.cat([torch.zeros(txt_len, 3), grid_ids(0, h, w), grid_ids(1, *extra_hw)])
    pe = dm.pe_embedder(ids[None].expand(batch, -1, -1))
    C, n_img = dm.hidden_size, h * w + extra_hw[0] * extra_hw[1]
    L = txt_len + n_img
    args = {"img": torch.randn(batch, n_img, C, generator=g), "txt": torch.randn(batch, txt_len, C, generator=g),
            "vec": torch.randn(batch, C, generator=g), "pe": pe,
            "attn_mask": torch.arange(L * L, dtype=torch.float32).view(1, L, L),
            "transformer_options": {"sigmas": torch.tensor([1.0]),
                                    pack.nodes.adapters.layout.LAYOUT_KEY: pack.nodes.adapters.layout.ImageLayout(h, w, n_img - h * w)}}
    return args, lambda rows: dm.pe_embedder(ids[rows][None])[0, 0]


@pytest.mark.parametrize("block", ["double", "single"])
def test_merged_block_call_gets_destination_positions(pack, built, block):
    """A spy in place of the Flux block sees: text rows untouched, each merged image token with the RoPE
    of its destination's (row, col), Kontext rows untouched, the mask cut to the same rows; the patch
    returns full-length tokens with the block's update unmerged onto every image token."""
    model, dit = built["flux"], pack.nodes.adapters.dit
    h, w, txt_len = 5, 7, 9
    args, rope_of = _flux_call(pack, model, h, w, txt_len, extra_hw=(2, 3))
    _, runtime = toma_patched(pack, model, ratio=0.5, window=4)
    patch, seen = dit.DiTPatch(runtime), {}
    spy = dit_checks.spy(seen, passes=("txt",) if block == "double" else ())
    if block == "double":
        out = patch.double_block(dict(args), {"original_block": spy})
        image_in = args["img"]
    else:
        joint = torch.cat([args["txt"], args["img"]], 1)
        out = patch.single_block({**args, "img": joint}, {"original_block": spy})
        image_in = joint
    (plan,) = runtime.report().plans.values()
    destinations = plan.destination_tokens()
    n = destinations.shape[1]
    assert n < h * w
    offset = txt_len if block == "single" else 0
    assert seen["img"].shape[1] == image_in.shape[1] - (h * w - n)
    pe = seen["pe"]
    for b in range(2):
        assert torch.equal(pe[b, 0, :txt_len], rope_of(torch.arange(txt_len)))
        image_rows = txt_len + destinations[b]  # ids rows of the destinations' (0, row, col)
        assert torch.allclose(pe[b, 0, txt_len:txt_len + n], rope_of(image_rows))
        assert torch.equal(pe[b, 0, txt_len + n:], rope_of(torch.arange(txt_len + h * w, txt_len + h * w + 6)))
        kept = torch.cat([torch.arange(txt_len), image_rows, torch.arange(txt_len + h * w, txt_len + h * w + 6)])
        assert torch.equal(seen["attn_mask"][b], args["attn_mask"][0][kept][:, kept])
    assert out["img"].shape == image_in.shape
    # a +1 update on merged tokens is +1 on every image token, Kontext gets +1 as is
    dit_checks.check_update_on_every_token(out["img"][:, offset:], image_in[:, offset:])


def test_sd3_last_block_returns_no_text(pack, built):
    """SD3's last joint block has a pre-only context stream and returns txt=None: the patch passes it on."""
    model, dit = built["sd3"], pack.nodes.adapters.dit
    layouts = pack.nodes.adapters.layout
    dm = model.model.diffusion_model
    last = len(dm.joint_blocks) - 1
    assert last in layouts.merged_blocks(len(dm.joint_blocks), layouts.TWO_STREAM)
    g = torch.Generator().manual_seed(5)
    C = dm.hidden_size
    args = {"img": torch.randn(1, 6 * 5, C, generator=g), "txt": torch.randn(1, 11, C, generator=g),
            "vec": torch.randn(1, C, generator=g),
            "transformer_options": {"sigmas": torch.tensor([1.0]), layouts.LAYOUT_KEY: layouts.ImageLayout(6, 5)}}

    def block(a):
        txt, img = dm.joint_blocks[last](a["txt"], a["img"], c=a["vec"],
                                         transformer_options=a["transformer_options"])
        return {"txt": txt, "img": img}

    _, runtime = toma_patched(pack, model)
    with torch.no_grad():
        out = dit.DiTPatch(runtime).double_block(dict(args), {"original_block": block})
    assert out["txt"] is None and out["img"].shape == args["img"].shape
    assert runtime.summary()["levels"]["two-stream 6x5"]["merged_tokens"] < 30


@pytest.mark.parametrize("node", ["ToMeSDPatchModel", "CAToMePatchModel"])
def test_unet_baselines_leave_dits_unpatched(pack, built, node, caplog):
    dit_checks.check_unet_baseline_leaves_unpatched(pack, built["flux"], node, caplog)


@pytest.mark.parametrize("arch", ["flux", "sd3"])
def test_real_1024_latent_with_tiny_width(pack, arch):
    """The real latent of a 1024x1024 image (128x128 -> 64x64 tokens), one step, tiny widths."""
    if arch == "flux":
        config = dict(models.FLUX_TINY, hidden_size=32, num_heads=2, depth=1, depth_single_blocks=1)
        model = models.build_flux(seed=6, config=config)
    else:
        config = dict(models.SD3_TINY, depth=1, x_block_self_attn_layers=[],
                      context_embedder_config={"target": "torch.nn.Linear",
                                               "params": {"in_features": 64, "out_features": 64}})
        model = models.build_sd3(seed=6, config=config)
    patched, runtime = toma_patched(pack, model)
    out = sample(patched, arch, (128, 128), tokens=256, steps=1, config=config)
    assert out.shape == (1, 16, 128, 128) and torch.isfinite(out).all()
    levels = runtime.summary()["levels"]
    assert levels and all(v["tokens"] == 4096 and v["merged_tokens"] == 2048 for v in levels.values())


def test_a_field_the_model_class_requires_is_what_model_detection_reads_from_the_layout(pack, built, monkeypatch):
    """A field this tree's Flux requires and the test config leaves out (as ComfyUI v0.33's FluxParams.txt_ids_dims
    is for configs written before it) gets the value model detection reads from the layout: guidance_embed left
    out gives a model without the guidance embedder, detected as such; the model has the weights of the one
    built with that value. Where detection does not give the field, the error names it."""
    import comfy.model_detection

    config = {k: v for k, v in models.FLUX_TINY.items() if k != "guidance_embed"}
    model = models.build_flux(seed=1, config=config)
    assert model.model.model_config.unet_config["guidance_embed"] is False
    weights = model.model.diffusion_model.state_dict()
    reference = models.build_flux(seed=1, config=dict(models.FLUX_TINY, guidance_embed=False))
    expected = reference.model.diffusion_model.state_dict()
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)
    assert any(k.startswith("guidance_in.") for k in built["flux"].model.diffusion_model.state_dict())

    monkeypatch.setattr(comfy.model_detection, "detect_unet_config", lambda state_dict, prefix, metadata=None: {})
    with pytest.raises(RuntimeError, match="requires guidance_embed"):
        models.build_flux(seed=1, config=config)
