"""How far an output is from its reference (the unpatched model's output), for tests and benchmarks."""
import math
import statistics

import torch


def relative_l2(x: torch.Tensor, reference: torch.Tensor) -> float:
    """||x - reference|| / ||reference||."""
    return float((x - reference).norm() / reference.norm())


def speedups(reference_times, times) -> tuple[float, float, float]:
    """Per repeat, reference time / time of the same repeat (interleaved runs: a slow spell hits both):
    (median, lowest, highest) of those ratios."""
    ratios = [r / t for r, t in zip(reference_times, times)]
    return statistics.median(ratios), min(ratios), max(ratios)


def psnr(x: torch.Tensor, reference: torch.Tensor, peak: float | None = None) -> float:
    """PSNR in dB; ``peak``: the largest possible value (255 for 8-bit pictures), by default the
    reference's value range; inf when identical."""
    mse = float(((reference.double() - x.double()) ** 2).mean())
    peak = float(reference.max() - reference.min()) if peak is None else peak
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def ssim(x: torch.Tensor, reference: torch.Tensor, peak: float = 1.0) -> float:
    """Mean SSIM (Wang et al. 2004: 11x11 Gaussian window of sigma 1.5, K1 0.01, K2 0.03) of ComfyUI IMAGE
    batches (B, H, W, C) with values in [0, peak], over every picture, channel and valid window position."""
    coords = torch.arange(11, dtype=torch.float64) - 5
    g = torch.exp(-coords ** 2 / (2 * 1.5 ** 2))
    window = (g[:, None] * g[None, :] / g.sum() ** 2)[None, None]
    a = x.double().permute(0, 3, 1, 2).reshape(-1, 1, *x.shape[1:3])
    b = reference.double().permute(0, 3, 1, 2).reshape(-1, 1, *reference.shape[1:3])

    def blur(t):
        return torch.nn.functional.conv2d(t, window)

    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b = blur(a * a) - mu_a ** 2, blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return float(s.mean())
