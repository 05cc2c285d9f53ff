"""What the benchmarks' command lines share."""
import torch


def resolve_device(ap, device: str) -> str:
    """``--device``: "auto" becomes "cuda" where CUDA is available, else "cpu"; "cuda" without CUDA is an
    argparse error (through ``ap``)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    return device
