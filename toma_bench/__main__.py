"""``python -m toma_bench``: the UNet speed benchmark (see toma_bench/unet.py and docs/benchmarks.md)."""
from .unet import main

main()
