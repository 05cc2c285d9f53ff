"""ToMA on Lumina 2 and Z-Image (NextDiT): random-weight models built from ComfyUI's own classes (4 main
layers, one refiner layer each) sampled through ComfyUI's sampler.

Lumina 2 exists in current ComfyUI (tests/setup_current.sh) and later; Z-Image from ComfyUI v0.3.75 on
(tests/setup_newest.sh). What is theirs: captions of different lengths, layers of other signatures; the
checks every DiT family passes are in tests/test_family_conformance.py. Latents are Flux latents, an odd
27x39 (14x20 tokens; Z-Image pads them with 8 tokens to a multiple of 32).
"""
import logging

import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models, sampling

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(),
                                                      reason="Lumina 2 and Z-Image exist only in current ComfyUI "
                                                             "(COMFYUI_PATH: tests/setup_current.sh, setup_newest.sh)")]

SIZES = {"odd": (27, 39)}
CONFIGS = {"lumina2": models.LUMINA2_TINY, "z_image": models.Z_IMAGE_TINY}


@pytest.fixture(scope="module")
def built(pack):
    import comfy.supported_models

    out = {"lumina2": models.build_nextdit(models.LUMINA2_TINY, seed=41)}
    if hasattr(comfy.supported_models, "ZImage"):
        out["z_image"] = models.build_nextdit(models.Z_IMAGE_TINY, seed=42)
    return out


@pytest.fixture(params=["lumina2", "z_image"])
def arch(request, built):
    if request.param not in built:
        pytest.skip("Z-Image exists only in ComfyUI v0.3.75 (Nov 2025) and later: bash tests/setup_newest.sh, "
                    "then COMFYUI_PATH=.comfyui-newest")
    return request.param


def sample(model, arch, hw=SIZES["odd"], batch=1, tokens=23, steps=2, cfg=1.0, seed=0):
    """A zero latent of ``batch`` rows sampled with one prompt of random caption features of ``tokens``
    tokens, as a text encoder gives it: one row, with its attention mask (Lumina 2 before Z-Image needs
    one, and counts its tokens over the whole batch)."""
    conditioning = models.text_conditioning(CONFIGS[arch]["cap_feat_dim"], 1, tokens, seed,
                                            attention_mask=torch.ones(1, tokens, dtype=torch.long))
    return sampling.sample(model, conditioning, torch.zeros(batch, 16, *hw), steps=steps, cfg=cfg,
                           scheduler="simple", seed=seed)


def test_captions_of_different_lengths_run_unmerged_and_say_so(pack, built, caplog):
    """Two rows whose captions differ in length (an attention mask with zeros in one row) put the image
    at another place in each row in Lumina 2 before Z-Image: the call gets no layout, so its layers run
    unmerged, with a message. (Sampled, such a batch fails inside ComfyUI's own caption refiner on the
    CPU's attention, patched or not.)"""
    lumina = pack.nodes.adapters.lumina
    dm = built["lumina2"].model.diffusion_model
    _, runtime = dit_checks.toma_patched(pack, built["lumina2"])
    stash = lumina.NextDiTLayoutStash(dm._forward, dm.patch_size, runtime)
    latent, mask = torch.zeros(2, 16, *SIZES["odd"]), torch.ones(2, 23, dtype=torch.long)
    assert stash.layout({"x": latent, "attention_mask": mask}).grid == (14, 20)
    mask[1, 15:] = 0
    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        assert stash.layout({"x": latent, "attention_mask": mask}) is None
    assert "captions differ in length" in caplog.text


def test_layers_of_another_signature_come_back_unpatched(pack, built, monkeypatch, caplog):
    """A NextDiT whose layers must be given something ToMA does not pass on is left alone, with the reason."""
    from comfy.ldm.lumina.model import JointTransformerBlock

    def forward(self, x, x_mask, freqs_cis, adaln_input, timestep_zero_index, transformer_options={}):
        raise AssertionError("never called")

    monkeypatch.setattr(JointTransformerBlock, "forward", forward)
    dit_checks.check_comes_back_unpatched(pack, built["lumina2"], caplog, "timestep_zero_index")


def test_layers_with_a_newer_optional_parameter_merge_and_pass_it_on(pack, built, monkeypatch, caplog):
    """ComfyUI of 2026 gives NextDiT's layers an optional ``timestep_zero_index`` (per-token modulation for
    Z-Image's reference images): ToMA patches them all the same, passes it on, merges the calls that
    leave it None (every token a destination: the unpatched output) and runs a call that sets it
    unmerged, saying so."""
    from comfy.ldm.lumina.model import JointTransformerBlock

    lumina = pack.nodes.adapters.lumina
    layouts = pack.nodes.adapters.layout
    current, passed = JointTransformerBlock.forward, []

    def forward(self, x, x_mask, freqs_cis, adaln_input=None, timestep_zero_index=None, transformer_options=None):
        passed.append(timestep_zero_index)
        return current(self, x, x_mask, freqs_cis, adaln_input, transformer_options=transformer_options)

    monkeypatch.setattr(JointTransformerBlock, "forward", forward)
    model = models.build_nextdit(models.LUMINA2_TINY, seed=41)
    patched, runtime = dit_checks.toma_patched(pack, model, ratio=0.1, window=2)
    dit_checks.check_merging_only_permutes(patched, model, lambda m: sample(m, "lumina2"))
    assert list(runtime.summary()["levels"]) == ["joint 14x20"]

    layer = model.model.diffusion_model.layers[1]
    x = torch.randn(1, 23 + 280, layer.dim, generator=torch.Generator().manual_seed(3))
    options = {"sigmas": torch.tensor([1.0]), layouts.LAYOUT_KEY: layouts.ImageLayout(14, 20)}
    pe = torch.zeros(1, 23 + 280, 1, layer.dim // layer.attention.n_local_heads // 2, 2, 2)
    adaln = torch.zeros(1, min(layer.dim, 1024))
    runtime.begin_run()  # no plans yet
    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        out = patched.object_patches["diffusion_model.layers.1.forward"](
            x, None, pe, adaln, timestep_zero_index=[(0, 23)], transformer_options=options)
    assert out.shape == x.shape and not runtime.report().plans and passed[-1] == [(0, 23)]
    assert "layers given timestep_zero_index, which ToMA does not merge, run unmerged" in caplog.text
    assert lumina.layer_parameters_fit(forward)

