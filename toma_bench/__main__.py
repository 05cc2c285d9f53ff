"""``python -m toma_bench``: the UNet speed benchmark (see toma_bench/unet.py and docs/notebook.md)."""
from .unet import main

main()
