"""How far an output is from its reference (the unpatched model's output), for tests and benchmarks."""
import math

import torch


def relative_l2(x: torch.Tensor, reference: torch.Tensor) -> float:
    """||x - reference|| / ||reference||."""
    return float((x - reference).norm() / reference.norm())


def psnr(x: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR in dB with the reference's value range as peak; inf when identical."""
    mse = float(((reference.double() - x.double()) ** 2).mean())
    peak = float(reference.max() - reference.min())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)
