"""ToMA on HiDream-I1: what is HiDream's own (the checks every DiT family passes are in
tests/test_family_conformance.py). A tiny random-weight model of ComfyUI's own class (one double-stream and
two single-stream blocks, a mixture-of-experts feed-forward in each), in current ComfyUI and later
(tests/setup_current.sh). HiDream-E1's edit image, concatenated beside the latent, is not merged: those
model calls run unmerged, saying so; a HiDream whose blocks take other inputs comes back unpatched.
"""
import logging

import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models, sampling

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]


@pytest.fixture(scope="module")
def model(pack):
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "HiDream"):
        pytest.skip("HiDream is not in this ComfyUI: bash tests/setup_current.sh, then COMFYUI_PATH=.comfyui-current")
    return models.build_hidream(seed=43)


def sample(model, **options):
    positive, negative = models.hidream_conditioning(models.HIDREAM_TINY, 1, 23, seed=0)
    for cond in (positive, negative):
        cond[0][1].update(options)
    return sampling.sample(model, (positive, negative), torch.zeros(1, 16, 27, 39), steps=2, cfg=1.0,
                           scheduler="simple", seed=0)


def test_an_edit_image_beside_the_latent_runs_unmerged_and_says_so(pack, model, caplog):
    edit = torch.randn(1, 16, 27, 39, generator=torch.Generator().manual_seed(5))
    patched, runtime = dit_checks.toma_patched(pack, model)
    assert 0.0 < float((sample(patched) - sample(model)).norm()) and runtime.summary()["levels"]
    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        assert torch.equal(sample(patched, concat_latent_image=edit), sample(model, concat_latent_image=edit))
    assert "HiDream: an edit image concatenated beside the latent (HiDream-E1) is not merged" in caplog.text


def test_blocks_that_take_other_inputs_come_back_unpatched(pack, model, caplog, monkeypatch):
    block_class = type(model.model.diffusion_model.double_stream_blocks[0])

    def forward(self, image_tokens, text_tokens=None, rope=None, transformer_options={}):
        raise AssertionError("never called: the model comes back unpatched")

    monkeypatch.setattr(block_class, "forward", forward)
    dit_checks.check_comes_back_unpatched(pack, model, caplog, "its blocks take (image_tokens, text_tokens, rope, "
                                                               "transformer_options)")
