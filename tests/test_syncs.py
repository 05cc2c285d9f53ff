"""No host-device syncs in the hot path: none in a model call where the host lets the sampler report its
steps (current ComfyUI's SAMPLER_SAMPLE wrapper), at most one where it does not (the March-2024 tree: the
step is read from the call's sigma); none per block call; a copy from the host inside a model call counts
as one.

Each method samples a small random-weight model twice through ComfyUI's own sampler; the second run
(plan caches cleared, per-grid geometry already on the device) is watched by toma_bench.syncs.SyncCounter,
which records every call that would make the host wait for a GPU and the file:line it came from. The one
exception is CA-ToMe's merged length, which depends on the data and is read once per plan it builds (at
its checkpoint steps only). On failure the message lists every site.
"""
import pytest
import torch

from toma_bench import comfy_host, models, sampling
from toma_bench.syncs import SyncCounter

pytestmark = pytest.mark.comfy

# SD1.5 layout (attention at 1/1, 1/2, 1/4) at a small width: a step takes milliseconds.
UNET_TINY = dict(models.SD15_SMALL, model_channels=32, num_heads=2)
STEPS = 6  # ToMA's default reuse interval is 5: steps 0 and 5 build plans, the others reuse them
UNET_METHODS = {
    "ToMA": ("ToMAPatchModel", {"ratio": 0.5, "window_size": 4, "reuse_interval": 5}),
    # one 256-token window on the 16x16 level: stochastic greedy, from a seed drawn before each model call
    "ToMA stochastic": ("ToMAPatchModel", {"ratio": 0.5, "window_size": 16, "reuse_interval": 5}),
    "ToMeSD": ("ToMeSDPatchModel", {"ratio": 0.5, "max_downsample": 2}),
    "CA-ToMe": ("CAToMePatchModel", {"threshold": 0.5, "max_downsample": 2}),
}


def watched_run(model, run) -> SyncCounter:
    """Run ``run(model)`` once to warm up, then again under a SyncCounter; return the counter."""
    counter = SyncCounter("cpu")
    m = model.clone()
    m.set_model_unet_function_wrapper(counter.model_wrapper)
    run(m)
    counter.events.clear()
    counter.model_calls = 0
    with counter:
        run(m)
    return counter


def check_bound(counter: SyncCounter, allowed_sites=()) -> None:
    """No pack call per model call that makes the host wait (a read of a device value, or a copy from the
    host, which waits for the work queued before it) where the sampler reports its steps, at most one
    elsewhere; apart from the events at ``allowed_sites`` (file:line prefixes) that the caller checks itself."""
    bound = 0 if comfy_host.sampler_reports_steps() else 1
    inside = [e for e in counter.pack_events() if e.model_call is not None and not e.site.startswith(tuple(allowed_sites))]
    worst = max(counter.per_model_call(inside).values(), default=0)
    assert counter.model_calls >= STEPS
    assert worst <= bound, f"up to {worst} host waits of the pack in one model call (bound: {bound}):\n{counter.report()}"


@pytest.mark.parametrize("method", list(UNET_METHODS))
def test_unet_sampling_host_waits_per_model_call_within_bound(pack, method, monkeypatch):
    node, inputs = UNET_METHODS[method]
    (patched,) = pack.nodes.NODE_CLASS_MAPPINGS[node]().patch(models.build_unet("sd15", 0, config=UNET_TINY), **inputs)
    builds = []
    build = pack.toma_core.CAToMe.build
    monkeypatch.setattr(pack.toma_core.CAToMe, "build", lambda *a, **k: builds.append(1) or build(*a, **k))
    conditioning = models.conditioning("sd15", 1, height=128, width=128)
    noise = sampling.seeded_noise((1, 4, 16, 16), 0)

    def run(m):
        builds.clear()
        sampling.sample(m, conditioning, torch.zeros(1, 4, 16, 16), steps=STEPS, cfg=2.0, noise=noise)

    counter = watched_run(patched, run)

    summary = pack.nodes.runtime.runtime_of(patched).summary()
    assert summary["levels"], f"{method} merged nothing: the count would prove nothing"
    catome_site = "toma_core/baselines.py"
    check_bound(counter, allowed_sites=(catome_site,) if method == "CA-ToMe" else ())
    at_catome = [e for e in counter.pack_events() if e.site.startswith(catome_site)]
    assert len(at_catome) == len(builds if method == "CA-ToMe" else []), counter.report()


@pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)
def test_flux_sampling_host_waits_per_model_call_within_bound(pack):
    (patched,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(models.build_flux(seed=0), 0.5, 4, 5)
    runtime = pack.nodes.runtime.runtime_of(patched)
    conditioning = models.dit_conditioning("flux", models.FLUX_TINY, 1, 32, seed=0)
    noise = sampling.seeded_noise((1, 16, 32, 32), 0)

    def run(m):
        sampling.sample(m, conditioning, torch.zeros(1, 16, 32, 32), steps=STEPS, scheduler="simple", noise=noise)

    counter = watched_run(patched, run)

    assert runtime.summary()["levels"], "Flux merged nothing: the count would prove nothing"
    check_bound(counter)


VIDEO_CALLS = {
    # family -> (builder, conditioning arch, config, latent channels, extra conditioning): image-to-video
    # runs, so the first-frame modulation ranges (HunyuanVideo) and per-token timesteps (LTX-Video) are
    # in the hot path too
    "HunyuanVideo": (models.build_hunyuan_video, "hunyuan_video", models.HUNYUAN_VIDEO_TINY, 16,
                     {"guiding_frame_index": 0}),
    "LTX-Video": (models.build_ltxv, "ltxv", models.LTXV_TINY, 128, {}),
}


@pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)
@pytest.mark.parametrize("family", list(VIDEO_CALLS))
def test_video_dit_sampling_host_waits_per_model_call_within_bound(pack, family):
    import comfy.sample

    build, arch, config, channels, extra = VIDEO_CALLS[family]
    (patched,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(build(seed=0), 0.5, 4, 5)
    runtime = pack.nodes.runtime.runtime_of(patched)
    positive, negative = models.video_conditioning(arch, config, 1, 32, seed=0, **extra)
    shape = (1, channels, 5, 8, 12)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 1, *shape[2:])
    mask[:, :, 0] = 0.0  # the first latent frame is the input image

    def run(m):
        comfy.sample.sample(m, noise, STEPS, 1.0, "euler", "simple", positive, negative, torch.zeros(shape),
                            seed=0, disable_pbar=True, noise_mask=mask)

    counter = watched_run(patched, run)

    assert runtime.summary()["levels"], f"{family} merged nothing: the count would prove nothing"
    check_bound(counter)


@pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)
def test_wan_sampling_host_waits_per_model_call_within_bound(pack):
    """Wan 2.2 5B TI2V image-to-video (a noise mask of 0 over the first frame: a timestep per frame), so the
    per-frame modulation rows are gathered too, with windows over 2 frames."""
    (patched,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(models.build_wan("ti2v", seed=0), 0.5, 4, 5)
    runtime = pack.nodes.runtime.runtime_of(patched)
    conditioning = models.wan_conditioning(models.WAN_TINY, 1, 32, seed=0)
    shape = (1, 48, 5, 8, 12)
    noise = sampling.seeded_noise(shape, 0)
    mask = torch.ones(1, 1, *shape[2:])
    mask[:, :, 0] = 0.0  # the first latent frame is the input image

    def run(m):
        sampling.sample(m, conditioning, torch.zeros(shape), steps=STEPS, scheduler="simple", noise=noise,
                        noise_mask=mask)

    counter = watched_run(patched, run)

    assert runtime.summary()["levels"], "Wan merged nothing: the count would prove nothing"
    check_bound(counter)
