"""``python -m toma_bench.cache_stack``: what ToMA stacked with TeaCache or MagCache does, per model call.

For each cache whose mirror is here (toma_bench/pack_source.py) and the tiny random-weight Flux and Wan
builds, ToMA (ratio 0.5, a plan every step) is stacked after the cache and sampled ``--steps`` steps at
cfg 1 (one model call a step) in ComfyUI (set COMFYUI_PATH to a current tree). Printed per stack: the
model calls, those the cache skipped (its blocks did not run), and the tokens ToMA merged in each block
group of the calls that ran. The caches' thresholds are those tests/test_cache_stacking.py uses.
"""
import argparse

import torch

from . import comfy_host, models, sampling, step_caches

FAMILIES = {  # name -> (build, conditioning, latent, the caches' model_type)
    "flux": (lambda: models.build_flux(seed=1), lambda: models.dit_conditioning("flux", models.FLUX_TINY, 1, 77, 0),
             (1, 16, 27, 39), "flux"),
    "wan": (lambda: models.build_wan("t2v", seed=1), lambda: models.wan_conditioning(models.WAN_TINY, 1, 77, 0),
            (1, 16, 5, 13, 19), "wan2.1_t2v_1.3B"),
}
# each cache's threshold and other inputs (those tests/test_cache_stacking.py uses)
SETTINGS = {"TeaCache": (0.4, {}), "MagCache": (0.3, {"magcache_K": 6})}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    comfy_host.import_comfy()
    pack = comfy_host.load_pack()
    torch.set_num_threads(1)
    print("| cache | model | model calls | skipped by the cache | ToMA in the calls that ran |")
    print("| --- | --- | --- | --- | --- |")
    for name, (threshold, options) in SETTINGS.items():
        try:
            cache = f"{name} ({step_caches.pack_module(name).origin})"
        except step_caches.CacheMissing as why:
            print(f"| {name} | - | {why} | | |")
            continue
        for family, (build, conditioning, latent, model_type) in FAMILIES.items():
            stacked = step_caches.apply(name, build(), threshold, family, model_type=model_type, **options)
            (patched,) = pack.nodes.toma_nodes.ToMAPatchModelAdvanced().patch(stacked, 0.5, 4, 1)
            with step_caches.counted(patched) as (ran, callback):
                sampling.sample(patched, conditioning(), torch.zeros(latent), steps=args.steps, scheduler="simple",
                                callback=callback)
            summary = pack.nodes.runtime.runtime_of(patched).summary()
            merged = ", ".join(f"{label}: {v['tokens']} -> {v['merged_tokens']} tokens"
                               for label, v in summary["levels"].items()) or f"nothing ({summary['unmerged']})"
            print(f"| {cache} | {family} | {args.steps} | {ran.count(False)} | {merged} |")


if __name__ == "__main__":
    main()
