"""Where the host wraps ``Sampler.sample`` (current ComfyUI's SAMPLER_SAMPLE), the sampler reports each
step it finishes to the pack, which then locates model calls without reading their sigmas: the steps must
be the ones the sigmas give, for one- and two-stage solvers, and a sampler that never reports must fall
back to the sigmas, saying so."""
import pytest
import torch

from toma_bench import comfy_host, models, sampling

pytestmark = pytest.mark.comfy

UNET_TINY = dict(models.SD15_SMALL, model_channels=32, num_heads=2)
TOMA = {"ratio": 0.5, "window_size": 4, "reuse_interval": 2}


@pytest.fixture
def reporting_host(pack):
    """Skips where the ComfyUI tree (imported by ``pack``) has no SAMPLER_SAMPLE wrapper."""
    if not comfy_host.sampler_reports_steps():
        pytest.skip("this ComfyUI tree has no SAMPLER_SAMPLE wrapper: every model call reads its step from its sigma")


def located_steps(pack, monkeypatch, *, follow: bool, sampler=None, sampler_name="euler", steps=5, cfg=2.0):
    """(step of every model call, the patched model's runtime) for one run of a tiny SD1.5 patched by ToMA;
    ``follow``: whether the runtime may follow the sampler's step reports (else it reads each sigma)."""
    import comfy.sample

    (patched,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(models.build_unet("sd15", 0, config=UNET_TINY), **TOMA)
    runtime = pack.nodes.runtime.runtime_of(patched)
    if not follow:
        monkeypatch.setattr(runtime.steps, "follow_reports", lambda: None)
    seen = []
    begin_call = runtime.begin_call

    def recording_begin_call(options, batch):
        call = begin_call(options, batch)
        seen.append(call.where.step)
        return call

    monkeypatch.setattr(runtime, "begin_call", recording_begin_call)
    conditioning = models.conditioning("sd15", 1, height=128, width=128)
    latent = torch.zeros(1, 4, 16, 16)
    noise = sampling.seeded_noise(latent.shape, 0)
    if sampler is None:
        sampling.sample(patched, conditioning, latent, steps=steps, cfg=cfg, sampler=sampler_name, noise=noise)
    else:
        import comfy.samplers

        sigmas = comfy.samplers.calculate_sigmas(patched.get_model_object("model_sampling"), "normal", steps)
        comfy.sample.sample_custom(patched, noise, cfg, sampler, sigmas, *conditioning, latent, disable_pbar=True,
                                   seed=0)
    return seen, runtime


@pytest.mark.parametrize("sampler_name", ["euler", "heun", "dpmpp_2m"])
def test_reported_steps_are_the_steps_the_sigmas_give(pack, reporting_host, monkeypatch, sampler_name):
    reported, runtime = located_steps(pack, monkeypatch, follow=True, sampler_name=sampler_name)
    assert runtime.steps.reported is not None, "the sampler's reports were not followed: the test would prove nothing"
    read, _ = located_steps(pack, monkeypatch, follow=False, sampler_name=sampler_name)
    assert reported == read
    assert len(set(reported)) == 5  # every step located (heun: its second stage at the next step's sigma)


def test_a_sampler_that_never_reports_falls_back_to_the_sigmas_and_says_so(pack, reporting_host, monkeypatch, caplog):
    """A sampler function that ignores its callback: after SILENT_CALLS model calls at step 0 the runtime
    reads each call's sigma again, with a caveat in the log and the stats."""
    import comfy.samplers

    def silent_euler(model, x, sigmas, extra_args=None, callback=None, disable=None):
        s_in = x.new_ones([x.shape[0]])
        for i in range(len(sigmas) - 1):
            denoised = model(x, sigmas[i] * s_in, **(extra_args or {}))
            x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
        return x

    steps = 40
    limit = pack.nodes.runtime.steps.StepLocator.SILENT_CALLS
    seen, runtime = located_steps(pack, monkeypatch, follow=True, sampler=comfy.samplers.KSAMPLER(silent_euler),
                                  steps=steps, cfg=1.0)
    assert seen[:limit] == [0] * limit
    assert seen[limit:] == list(range(limit, steps))
    caveats = runtime.summary()["caveats"]
    assert any("reported no step" in c for c in caveats), caveats
    assert "reported no step" in caplog.text
