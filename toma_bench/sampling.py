"""Sampling through ComfyUI's own sampler (``comfy.sample.sample``) with the harness's seeding: the noise
ComfyUI's KSampler draws for a seed, optionally the global RNGs seeded too. Every benchmark, the proxies
and most tests sample through ``sample``; a few tests call ``comfy.sample.sample`` themselves where they
hand it arguments of their own (noise drawn in their own layout, a sampler under test). ComfyUI must
already be imported (comfy_host.import_comfy)."""
import contextlib
import random

import torch


def seeded_noise(shape, seed: int) -> torch.Tensor:
    """The initial noise for ``seed``: the numbers ComfyUI's KSampler node draws for that seed."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def noise_for(latent, seed: int):
    """The initial noise of ``latent`` for ``seed``, as ComfyUI's KSampler node draws it: a nested latent
    ([video, audio] of MiniMax-H3) gets a NestedTensor of draws from one generator, stream after stream."""
    if not getattr(latent, "is_nested", False):
        return seeded_noise(latent.shape, seed)
    import comfy.nested_tensor

    g = torch.Generator().manual_seed(seed)
    return comfy.nested_tensor.NestedTensor([torch.randn(t.shape, generator=g) for t in latent.unbind()])


@contextlib.contextmanager
def seeded_global_rngs(seed: int):
    """Python's and torch's global RNGs seeded with ``seed`` inside the block and restored after it:
    ComfyUI's TomePatchModel and HyperTile draw from them, so two runs draw alike."""
    python_state = random.getstate()
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            random.seed(seed)
            torch.manual_seed(seed)
            yield
    finally:
        random.setstate(python_state)


def sample(model, conditioning, latent: torch.Tensor, *, steps: int, cfg: float = 1.0, sampler: str = "euler",
           scheduler: str = "normal", denoise: float = 1.0, seed: int = 0, noise: torch.Tensor | None = None,
           global_rngs: bool = False, **options) -> torch.Tensor:
    """``latent`` sampled by ``model`` without a progress bar; the sampled latent.

    ``conditioning``: (positive, negative), as models.conditioning returns them. ``noise``: noise_for
    ``seed`` unless given. ``global_rngs``: sample inside seeded_global_rngs(seed). ``options`` go on to
    comfy.sample.sample (``callback``, ...).
    """
    import comfy.sample

    positive, negative = conditioning
    noise = noise_for(latent, seed) if noise is None else noise
    with seeded_global_rngs(seed) if global_rngs else contextlib.nullcontext():
        return comfy.sample.sample(model, noise, steps, cfg, sampler, scheduler, positive, negative, latent,
                                   denoise=denoise, seed=seed, disable_pbar=True, **options)
