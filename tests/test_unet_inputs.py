"""The token merge nodes reject bad inputs with an error naming the input and its range, and hand back
models they cannot patch unchanged, saying why in the log. Nothing here samples."""
import logging

import pytest
import torch

from toma_bench import models, sampling

pytestmark = pytest.mark.comfy

TOMA = {"ratio": 0.5, "window_size": 4, "reuse_interval": 5}

# (node, inputs that break it, words the error must contain: the input's name and its allowed range)
BAD_INPUTS = [
    ("ToMAPatchModel", dict(TOMA, ratio=0.95), ["ratio", "-1", "0.9"]),
    ("ToMAPatchModel", dict(TOMA, ratio=-0.1), ["ratio", "-1 (auto", "0.0", "0.9"]),
    ("ToMAPatchModel", dict(TOMA, window_size=-1), ["window_size", "0", "32"]),
    ("ToMAPatchModel", dict(TOMA, reuse_interval=0), ["reuse_interval", "1", "100"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, window_size=33), ["window_size", "0", "32"]),
    ("ToMAPatchModel", dict(TOMA, window_size=4.5), ["window_size", "integer", "0", "32"]),
    ("ToMAPatchModel", dict(TOMA, reuse_interval="5"), ["reuse_interval", "integer", "1", "100"]),
    ("ToMAPatchModel", dict(TOMA, ratio=True), ["ratio", "number", "-1", "0.9"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, weights_interval=0), ["weights_interval", "1", "100"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, start_percent=-0.1), ["start_percent", "0.0", "1.0"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, end_percent=1.5), ["end_percent", "0.0", "1.0"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, temporal_window=0), ["temporal_window", "1", "16"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, merge_every=0), ["merge_every", "1", "100"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, merge_every=101), ["merge_every", "1", "100"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, merge_every=2.5), ["merge_every", "integer", "1", "100"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, start_percent=0.8, end_percent=0.2), ["start_percent", "end_percent"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, tau=0.5), ["tau", "1.0", "10000.0"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, scope="everything"), ["scope", "attention", "block"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, levels="middle"), ["levels", "auto", "all"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, exact_unmerge="false"), ["exact_unmerge", "True", "False"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, exact_unmerge="yes"), ["exact_unmerge", "True", "False"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, exact_unmerge=2), ["exact_unmerge", "True", "False"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, rotation="yes"), ["rotation", "auto", "on", "off"]),
    ("ToMAPatchModelAdvanced", dict(TOMA, rotation=True), ["rotation", "auto", "on", "off"]),
    ("ToMeSDPatchModel", {"ratio": 0.8}, ["ratio", "0.0", "0.75"]),
    ("ToMeSDPatchModel", {"ratio": 0.5, "max_downsample": 3}, ["max_downsample", "1", "8"]),
    ("ToMeSDPatchModel", {"ratio": 0.5, "sx": 0}, ["sx", "1", "8"]),
    ("ToMeSDPatchModel", {"ratio": 0.5, "sy": 2.5}, ["sy", "integer", "1", "8"]),
    ("ToMeSDPatchModel", {"ratio": 0.5, "sy": 9}, ["sy", "1", "8"]),
    ("ToMeSDPatchModel", {"ratio": 0.5, "seed": -1}, ["seed", "0", str(2**31 - 1)]),
    ("CAToMePatchModel", {"threshold": 1.5}, ["threshold", "-1.0", "1.0"]),
    ("CAToMePatchModel", {"threshold": -1.01}, ["threshold", "-1.0", "1.0"]),
    ("CAToMePatchModel", {"threshold": 0.7, "checkpoints": "0,51"}, ["checkpoints", "0", "50"]),
    ("CAToMePatchModel", {"threshold": 0.7, "checkpoints": "zero"}, ["checkpoints", "0", "50"]),
    ("CAToMePatchModel", {"threshold": 0.7, "checkpoints": ""}, ["checkpoints", "0", "50"]),
    ("CAToMePatchModel", {"threshold": 0.7, "max_downsample": 16}, ["max_downsample", "1", "8"]),
    ("CAToMePatchModel", {"threshold": 0.7, "seed": 2**31}, ["seed", "0", str(2**31 - 1)]),
    ("DiToPatchModel", {"ratio": 0.76}, ["ratio", "0.0", "0.75"]),
    ("DiToPatchModel", {"ratio": 0.5, "matching_interval": 51}, ["matching_interval", "2", "50"]),
    ("DiToPatchModel", {"ratio": 0.5, "penalty": 4.5}, ["penalty", "0.0", "4.0"]),
]

NARROW_SD15 = dict(models.SD15_SMALL, model_channels=32, num_heads=4)
# SD1.5's UNet structure without a transformer block anywhere (middle included).
NO_ATTENTION = dict(NARROW_SD15, transformer_depth=[0, 0, 0], transformer_depth_output=[0] * 6,
                    transformer_depth_middle=-1)
NODE_INPUTS = {
    "ToMAPatchModel": TOMA,
    "ToMAPatchModelAdvanced": dict(TOMA, scope="block"),
    "ToMeSDPatchModel": {"ratio": 0.5},
    "CAToMePatchModel": {"threshold": 0.7},
    "DiToPatchModel": {"ratio": 0.5},
}


@pytest.fixture(scope="module")
def sd15(pack):
    """SD1.5's UNet structure, narrow: inputs are checked before anything runs, so width does not matter."""
    return models.build_unet("sd15", seed=0, config=NARROW_SD15)


@pytest.mark.parametrize("node, inputs, words", BAD_INPUTS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in i.items())}" for n, i, _ in BAD_INPUTS])
def test_bad_input_raises_naming_input_and_range(pack, sd15, node, inputs, words):
    with pytest.raises(ValueError) as error:
        pack.nodes.NODE_CLASS_MAPPINGS[node]().patch(sd15, **inputs)

    message = str(error.value)
    missing = [w for w in words if w not in message]
    assert not missing, f"error {message!r} does not mention {missing}"


def test_bad_input_leaves_the_model_alone(pack, sd15):
    before = (dict(sd15.model_options), dict(sd15.object_patches))

    with pytest.raises(ValueError):
        pack.nodes.NODE_CLASS_MAPPINGS["ToMAPatchModelAdvanced"]().patch(sd15, **dict(TOMA, scope="everything"))

    assert (dict(sd15.model_options), dict(sd15.object_patches)) == before


def test_unet_without_middle_block(pack):
    """A UNet whose middle block is None (transformer_depth_middle -2) still gets its levels merged."""
    model = models.build_unet("sd15", seed=0, config=dict(NARROW_SD15, transformer_depth_middle=-2))
    assert model.model.diffusion_model.middle_block is None
    assert pack.nodes.adapters.unet.attention_levels(model.model.diffusion_model) == [1, 2, 4]
    (patched,) = pack.nodes.NODE_CLASS_MAPPINGS["ToMAPatchModel"]().patch(model, **TOMA)
    conditioning = models.conditioning("sd15", 1, height=128, width=128)

    out = sampling.sample(patched, conditioning, torch.zeros(1, 4, 16, 16), steps=1)

    assert torch.isfinite(out).all()
    assert pack.nodes.runtime.runtime_of(patched).summary()["levels"]["16x16 (1/1)"]["merged_tokens"] == 128


def unpatched(model):
    """True when ``model`` carries no transformer patches, wrappers or object patches."""
    options = model.model_options.get("transformer_options", {})
    return not options.get("patches") and not options.get("patches_replace") and not model.object_patches


def plain_patcher(module):
    import comfy.model_patcher

    return comfy.model_patcher.ModelPatcher(module, load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


class NoDiffusionModel(torch.nn.Module):
    """A model that is not a diffusion model at all: no diffusion_model, no model_sampling."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 4))


@pytest.fixture(scope="module")
def unsupported():
    return {"unet-without-attention": models.build_unet("sd15", seed=0, config=NO_ATTENTION),
            "plain-module": plain_patcher(NoDiffusionModel())}


@pytest.mark.parametrize("kind", ["unet-without-attention", "plain-module"])
@pytest.mark.parametrize("node", NODE_INPUTS)
def test_unsupported_model_is_returned_unpatched_with_a_log_message(pack, unsupported, kind, node, caplog):
    model = unsupported[kind]

    with caplog.at_level(logging.INFO, logger="ComfyUI-ToMA"):
        (out,) = pack.nodes.NODE_CLASS_MAPPINGS[node]().patch(model, **NODE_INPUTS[node])

    assert out.model is model.model
    assert unpatched(out)
    messages = [r.getMessage() for r in caplog.records if r.name == "ComfyUI-ToMA" and r.levelno >= logging.WARNING]
    assert any("not supported" in m and "unpatched" in m for m in messages), messages
