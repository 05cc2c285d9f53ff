"""The trained proxy models (toma_bench.proxy): the training script stays alive, the shipped weights load in
the ComfyUI under test, denoise held-out pictures far better than their random initialisation, and
ComfyUI's sampler draws pictures from noise with them.

The held-out loss here uses the first HELDOUT_CROPS_IN_TESTS crops of the held-out set (all noise levels)
to keep each test under a minute; ``python -m toma_bench.proxy check`` uses all of them.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from toma_bench import comfy_host, proxy, proxy_training
from toma_bench.comfy_host import has_flux

REPO = comfy_host.REPO
HELDOUT_CROPS_IN_TESTS = 6
# The 32-token Wan proxy's held-out clips are 4 frames of 64x64 latent pixels: 6 of them at every level took
# 134 s of CPU for its two losses; 2 give the same ratio to random init (0.223 against 0.222 on 1, 2026-12-07)
HELDOUT_CLIPS_IN_WAN32_TEST = 2


def host_has_flux() -> bool:
    try:
        return has_flux(comfy_host.comfy_root())
    except RuntimeError:
        return False


needs_flux = pytest.mark.skipif(not host_has_flux(), reason="this ComfyUI has no comfy.ldm.flux (Flux exists only in "
                                "current ComfyUI: set COMFYUI_PATH, e.g. to the .comfyui-current of tests/setup_current.sh)")


def host_has_wan() -> bool:
    try:
        return (comfy_host.comfy_root() / "comfy" / "ldm" / "wan" / "model.py").is_file()
    except RuntimeError:
        return False


needs_wan = pytest.mark.skipif(not host_has_wan(), reason="this ComfyUI has no comfy.ldm.wan (Wan exists only in "
                               "current ComfyUI: set COMFYUI_PATH, e.g. to the .comfyui-current of tests/setup_current.sh)")


def heldout_subset(arch: str, crops: int = HELDOUT_CROPS_IN_TESTS):
    x0, noise, fractions = proxy_training.heldout_set(arch)
    n = crops * len(proxy_training.HELDOUT_LEVELS)
    return x0[:n], noise[:n], fractions[:n]


def total_variation(images: torch.Tensor) -> float:
    """Mean absolute difference of horizontally and vertically adjacent pixels of IMAGE (B, H, W, C)."""
    return float((images[:, 1:] - images[:, :-1]).abs().mean() + (images[:, :, 1:] - images[:, :, :-1]).abs().mean()) / 2


# -- no ComfyUI -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [2, 4])
def test_codec_is_orthogonal_and_invertible(block):
    pixels = torch.rand(3, 1, 8 * block, 8 * block, generator=torch.Generator().manual_seed(block)) * 2 - 1
    latents = proxy.encode(pixels, block)
    assert latents.shape == (3, block * block, 8, 8)
    torch.testing.assert_close(proxy.decode(latents, block), pixels, atol=1e-5, rtol=0)
    # an orthogonal map keeps the energy: the latent's RMS is DATA_SCALE times the pixels'
    assert math.isclose(float(latents.pow(2).mean().sqrt()), proxy.DATA_SCALE * float(pixels.pow(2).mean().sqrt()),
                        rel_tol=1e-5)
    # every channel mixes every pixel of its block (no channel is a plain pixel or a block mean)
    assert (proxy.codec_matrix(block * block).abs() > 1e-3).all()


def test_crops_are_seeded_and_come_from_the_photographs():
    images = proxy_training.source_images(proxy_training.TRAIN_IMAGES)
    a = proxy_training.random_crops(images, 4, 64, torch.Generator().manual_seed(5))
    b = proxy_training.random_crops(images, 4, 64, torch.Generator().manual_seed(5))
    c = proxy_training.random_crops(images, 4, 64, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (4, 1, 64, 64) and a.min() >= -1 and a.max() <= 1
    assert float(a.std(dim=(1, 2, 3)).min()) > 0.01  # pictures, not blank crops
    assert not set(proxy_training.TRAIN_IMAGES) & set(proxy_training.HELDOUT_IMAGES)


def test_clips_are_seeded_and_pan_by_whole_pixels():
    images = proxy_training.source_images(proxy_training.TRAIN_IMAGES)
    a = proxy_training.random_clips(images, 3, 4, 32, torch.Generator().manual_seed(5))
    b = proxy_training.random_clips(images, 3, 4, 32, torch.Generator().manual_seed(5))
    c = proxy_training.random_clips(images, 3, 4, 32, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (3, 1, 4, 32, 32) and a.min() >= -1 and a.max() <= 1
    for clip in a[:, 0]:
        for before, after in zip(clip[:-1], clip[1:]):
            assert not torch.equal(before, after)
            # some shift of at most MAX_PAN pixels, not none, maps one frame onto the next where they overlap
            shifts = [(dy, dx) for dy in range(-proxy_training.MAX_PAN, proxy_training.MAX_PAN + 1)
                      for dx in range(-proxy_training.MAX_PAN, proxy_training.MAX_PAN + 1) if (dy, dx) != (0, 0)
                      and torch.equal(after[max(0, -dy):32 - max(0, dy), max(0, -dx):32 - max(0, dx)],
                                      before[max(0, dy):32 - max(0, -dy), max(0, dx):32 - max(0, -dx)])]
            assert shifts, "consecutive frames are not one shifted picture"


def test_video_codec_encodes_each_frame_alone():
    clips = torch.rand(2, 1, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = proxy.encode(clips, 4)
    assert latents.shape == (2, 16, 3, 4, 4)
    torch.testing.assert_close(latents[:, :, 1], proxy.encode(clips[:, :, 1], 4))
    torch.testing.assert_close(proxy.decode(latents, 4), clips, atol=1e-5, rtol=0)


@pytest.mark.parametrize("argv, bad", [
    (["train", "--arch", "sd15", "--steps", "0"], "--steps"),
    (["train", "--arch", "sd15", "--batch", "two"], "--batch"),
    (["train", "--arch", "sd15", "--lr", "0"], "--lr"),
    (["train", "--arch", "sd3"], "--arch"),
    (["check", "--arch", "sd15,sd3"], "--arch"),
])
def test_cli_errors_name_the_bad_argument(argv, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        proxy_training.main(argv)
    assert exc.value.code == 2
    assert bad in capsys.readouterr().err


# -- ComfyUI ------------------------------------------------------------------------------------------
def train_tiny_command(comfy, arch: str, out, log_every: int) -> dict:
    """3 steps of ``arch``'s tiny config (seed 3, batch 2) through the command line in the ComfyUI under
    test; the metadata of the file it wrote."""
    env = dict(os.environ, COMFYUI_PATH=str(comfy))
    done = subprocess.run([sys.executable, "-m", "toma_bench.proxy", "train", "--arch", arch, "--size", "tiny",
                           "--steps", "3", "--batch", "2", "--log-every", str(log_every), "--seed", "3", "--out",
                           str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return proxy.read_metadata(out)


def test_train_command_runs_and_changes_the_weights(comfy, tmp_path):
    """A few steps of the tiny SD1.x config through the command line, in the ComfyUI under test."""
    out = tmp_path / "tiny.safetensors"
    meta = train_tiny_command(comfy, "sd15", out, log_every=1)
    assert meta["arch"] == "sd15" and meta["unet_config"] == proxy.SD15_TINY
    history = meta["training"]["history"]
    assert [row["step"] for row in history] == [1, 2, 3]
    assert all(math.isfinite(row["train_loss"]) and math.isfinite(row["heldout_loss"]) for row in history)

    trained = proxy.load(out).model.diffusion_model.state_dict()
    start = proxy.build("sd15", proxy.SD15_TINY, seed=3, zero_outputs=True).model.diffusion_model.state_dict()
    assert trained.keys() == start.keys()
    changed = [k for k in start if not torch.equal(trained[k], start[k].half().float())]
    assert len(changed) > len(start) // 2, f"only {len(changed)} of {len(start)} tensors changed"


@needs_flux
def test_flux_trains_through_comfyui_in_place_blocks(comfy):
    """ComfyUI's Flux blocks add residuals in place; trainable() must let autograd through them, and
    leave the model as it was."""
    from comfy.ldm.flux.layers import SingleStreamBlock

    model, history = proxy_training.train("flux", proxy.FLUX_TINY, steps=2, batch=2, lr=1e-3, seed=1, log_every=2,
                                 progress=lambda line: None)
    assert len(history) == 1 and math.isfinite(history[0]["train_loss"])
    start = proxy.build("flux", proxy.FLUX_TINY, seed=1, zero_outputs=True).model.diffusion_model.state_dict()
    trained = model.model.diffusion_model.state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start)
    block = next(m for m in model.model.diffusion_model.modules() if isinstance(m, SingleStreamBlock))
    assert not isinstance(block.pre_norm, proxy_training.CopyInput)


@needs_wan
def test_wan_train_command_runs_and_changes_the_weights(comfy, tmp_path):
    """A few steps of the tiny Wan config through the command line, in current ComfyUI (a video DiT: 5-D
    clips, the flow loss, ComfyUI's WanModel blocks under autograd)."""
    out = tmp_path / "wan_tiny.safetensors"
    meta = train_tiny_command(comfy, "wan", out, log_every=3)
    assert meta["arch"] == "wan" and meta["unet_config"] == json.loads(json.dumps(proxy.WAN_TINY))
    assert all(math.isfinite(row["train_loss"]) and math.isfinite(row["heldout_loss"])
               for row in meta["training"]["history"])

    model = proxy.load(out)
    assert proxy.arch_of(model) == "wan"
    trained = model.model.diffusion_model.state_dict()
    start = proxy.build("wan", proxy.WAN_TINY, seed=3, zero_outputs=True).model.diffusion_model.state_dict()
    changed = [k for k in start if not torch.equal(trained[k], start[k].half().float())]
    assert len(changed) > len(start) // 2, f"only {len(changed)} of {len(start)} tensors changed"


@needs_wan
def test_wan_samples_are_clips_of_pictures(comfy):
    """sample() draws 5-D noise for wan and latent_to_images gives every frame, clip by clip."""
    model = proxy.build("wan", proxy.WAN_TINY)
    samples = proxy.sample(model, batch=2, steps=2, side=8)
    assert samples.shape == (2, 16, proxy.WAN_FRAMES, 8, 8)
    images = proxy.latent_to_images(model, samples)
    assert images.shape == (2 * proxy.WAN_FRAMES, 32, 32, 3)
    torch.testing.assert_close(images[proxy.WAN_FRAMES + 1],
                               proxy.latent_to_images(model, samples[1:2, :, 1:2])[0])


def test_sdxl_layout_trains_and_has_no_attention_at_full_resolution(comfy, tmp_path):
    """The SDXL-layout proxy is a UNet of SD1.x's kind (epsilon, the discrete schedule) with SDXL's levels:
    no transformer at 1/1, one per block at 1/2, a deeper one at 1/4; it trains on 64x64 latents."""
    from comfy.ldm.modules.attention import SpatialTransformer

    out = tmp_path / "sdxl_tiny.safetensors"
    meta = train_tiny_command(comfy, "sdxl", out, log_every=3)
    assert meta["arch"] == "sd15" and meta["unet_config"] == json.loads(json.dumps(proxy.SDXL_TINY))
    assert meta["training"]["latent_side"] == 64 and meta["training"]["init"] is None
    dm = proxy.load(out).model.diffusion_model
    depth = [sum(len(m.transformer_blocks) for m in block.modules() if isinstance(m, SpatialTransformer))
             for block in dm.input_blocks[1:]]
    assert depth == [0, 0, 1, 0, 1]  # levels 1/1, 1/2, 1/4 with a downsample between (tiny: depth 1 at 1/4)
    full = proxy.build("sdxl", proxy.SDXL_PROXY).model.diffusion_model
    depth = [sum(len(m.transformer_blocks) for m in block.modules() if isinstance(m, SpatialTransformer))
             for block in full.input_blocks[1:]]
    assert depth[0] == 0 and 0 < depth[2] < depth[4]


@needs_flux
def test_fine_tuning_starts_from_the_shipped_weights(comfy):
    """flux32 is the shipped Flux proxy trained on: with a vanishing learning rate one step leaves it as it was,
    and its held-out set has 32x32-token pictures."""
    model, history = proxy_training.train("flux32", proxy.FLUX_PROXY, steps=1, batch=1, lr=1e-12, log_every=1,
                                 progress=lambda line: None)
    shipped = proxy.load_flux().model.diffusion_model.state_dict()
    tuned = model.model.diffusion_model.state_dict()
    assert all(torch.allclose(tuned[k], shipped[k]) for k in shipped)
    assert proxy_training.heldout_set("flux32")[0].shape[-2:] == (64, 64) and proxy_training.heldout_set("flux")[0].shape[-2:] == (32, 32)
    assert math.isfinite(history[0]["heldout_loss"])


def check_shipped(model, arch: str, max_ratio: float, crops: int = HELDOUT_CROPS_IN_TESTS):
    heldout = heldout_subset(arch, crops)
    config = proxy.read_metadata(proxy.PROXY_DIR / proxy.SPECS[arch].file)["unet_config"]
    trained = proxy_training.heldout_loss(model, heldout=heldout)
    random_init = proxy_training.heldout_loss(proxy.build(arch, config, seed=0), heldout=heldout)
    assert math.isfinite(trained)
    assert trained < max_ratio * random_init, f"held-out loss {trained:.4f} vs random init {random_init:.4f}"


def check_samples(model, side: int = proxy.LATENT_SIDE, steps: int = 8, max_tv: float = 0.4):
    """Pictures from noise: in range, and as smooth as photographs rather than as noise (the total
    variation of decoded noise is far higher: at most ``max_tv`` of it)."""
    samples = proxy.sample(model, seed=0, batch=2, steps=steps, side=side)
    images = proxy.latent_to_images(model, samples)
    noise = proxy.latent_to_images(model, model.model.process_latent_out(torch.randn(
        samples.shape, generator=torch.Generator().manual_seed(1))))
    assert torch.isfinite(images).all() and images.shape[0] == 2 * (proxy.spec_of(proxy.arch_of(model)).frames or 1)
    assert total_variation(images) < max_tv * total_variation(noise)
    assert float(images.std()) > 0.02  # not a flat grey


def test_shipped_unet_proxy_denoises_and_samples(comfy):
    model = proxy.load_unet()
    assert model.model.model_config.unet_config["channel_mult"] == proxy.SD15_PROXY["channel_mult"]
    check_shipped(model, "sd15", max_ratio=0.5)
    check_samples(model)


@needs_flux
def test_shipped_flux_proxy_denoises_and_samples(comfy):
    model = proxy.load_flux()
    dm = model.model.diffusion_model
    assert (len(dm.double_blocks), len(dm.single_blocks)) == (proxy.FLUX_PROXY["depth"],
                                                                proxy.FLUX_PROXY["depth_single_blocks"])
    check_shipped(model, "flux", max_ratio=0.5)
    check_samples(model)


@needs_wan
def test_shipped_wan_proxy_denoises_and_samples(comfy):
    model = proxy.load_wan()
    assert len(model.model.diffusion_model.blocks) == proxy.WAN_PROXY["num_layers"]
    check_shipped(model, "wan", max_ratio=0.4)
    check_samples(model)


def test_shipped_sdxl_layout_proxy_denoises_and_samples(comfy):
    model = proxy.load(proxy.PROXY_DIR / proxy.SPECS["sdxl"].file)
    assert model.model.model_config.unet_config["transformer_depth"] == proxy.SDXL_PROXY["transformer_depth"]
    check_shipped(model, "sdxl", max_ratio=0.5)
    # at its training size (16x16 latents at 1/4 hold little) and the steps `proxy check` samples with; its
    # samples keep a fine two-pixel grain (docs/notebook.md shows them), about 45% of noise's variation
    check_samples(model, side=proxy.SPECS["sdxl"].side, steps=20, max_tv=0.5)


@needs_flux
def test_shipped_32_token_flux_proxy_denoises_and_samples(comfy):
    model = proxy.load(proxy.PROXY_DIR / proxy.SPECS["flux32"].file)
    check_shipped(model, "flux32", max_ratio=0.5)
    check_samples(model)


@needs_wan
def test_shipped_32_token_wan_proxy_denoises_and_samples(comfy):
    model = proxy.load(proxy.PROXY_DIR / proxy.SPECS["wan32"].file)
    check_shipped(model, "wan32", max_ratio=0.4, crops=HELDOUT_CLIPS_IN_WAN32_TEST)
    check_samples(model)


def test_proxies_fit_their_budget():
    """Every shipped proxy together stays within 32 MB (the repository ships them)."""
    total = sum((proxy.PROXY_DIR / spec.file).stat().st_size for spec in proxy.SPECS.values())
    assert total <= 32e6, f"{total / 1e6:.1f} MB"


def test_latent_round_trip_through_comfyui_latent_format(comfy):
    """images_to_latent then latent_to_images gives the gray picture back (through process_latent_out/in)."""
    model = proxy.build("sd15", proxy.SD15_TINY)
    gray = torch.rand(2, 16, 16, 1, generator=torch.Generator().manual_seed(0))
    samples = proxy.images_to_latent(model, gray.repeat(1, 1, 1, 3))
    assert samples.shape == (2, 4, 8, 8)
    torch.testing.assert_close(proxy.latent_to_images(model, samples), gray.repeat(1, 1, 1, 3), atol=1e-5, rtol=0)


@needs_wan
def test_wan_latent_round_trip_takes_the_pictures_as_frames(comfy):
    """For wan, images_to_latent makes the IMAGE batch one clip (its frames), as ComfyUI's video nodes do."""
    model = proxy.build("wan", proxy.WAN_TINY)
    gray = torch.rand(3, 16, 16, 1, generator=torch.Generator().manual_seed(0))
    samples = proxy.images_to_latent(model, gray)
    assert samples.shape == (1, 16, 3, 4, 4)
    torch.testing.assert_close(proxy.latent_to_images(model, samples), gray.repeat(1, 1, 1, 3), atol=1e-5, rtol=0)
