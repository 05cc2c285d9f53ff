"""Records a tiny Flux with toma_bench.costmodel's own code as a step cache ran it (some calls skipped) and
prints what tests/test_step_caches.py checks, as JSON. Run in a subprocess: the cost model needs ComfyUI
imported with PyTorch attention (SDPA), which the in-process test fixture does not choose.

    python tests/cache_pricing_probe.py      (COMFYUI_PATH names the tree)
"""
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from toma_bench import comfy_host, costmodel, models, step_caches  # noqa: E402
from toma_bench.gpuclock import call_cost  # noqa: E402
from toma_bench.oprecord import recording  # noqa: E402

STEPS = 6
RAN = (True, True, False, True, False, True)  # 2 of 6 calls skipped; none of the plan-building steps (0, 5)
LATENT = (1, 16, 16, 16)


def ops_of(calls):
    return [[dataclasses.astuple(op) for op in call] for call in calls]


def alone(work) -> list:
    """The ops ``work(read)`` records in one call of its own."""
    with recording() as rec:
        with rec.model_call():
            work(lambda _: rec.add("_local_scalar_dense", "elementwise", 0, 8, True, True))
    return rec.calls[0]


def main():
    comfy_host.import_core("cpu", require_flux=True)
    pack = comfy_host.load_pack()
    tn = pack.nodes.toma_nodes
    hw = costmodel.PROFILES["h200"]
    flux = costmodel.Spec("flux", "flux", "Flux", models.FLUX_TINY, LATENT,
                          lambda: models.dit_conditioning("flux", models.FLUX_TINY, 1, 16, 0), steps=STEPS, cfg=1.0)
    toma = lambda m: tn.ToMAPatchModelAdvanced().patch(m, 0.5, 4, 5, scope="block")[0]  # noqa: E731
    variants = [costmodel.Variant("unpatched", patch=lambda m: m), costmodel.Variant("ToMA", patch=toma)]
    for cache in step_caches.NAMES:
        variants += [costmodel.Variant(cache, patch=lambda m: m, cache=cache, calls_ran=RAN),
                     costmodel.Variant(f"{cache} + ToMA", patch=toma, cache=cache, calls_ran=RAN)]
    recorded = costmodel.record_model(flux, pack, STEPS, variants, progress=lambda _: None)
    rows = costmodel.price(recorded, hw, "pipelined", sweep=False)
    width = models.FLUX_TINY["hidden_size"]
    x = torch.empty(LATENT, device="meta", dtype=costmodel.DTYPE)
    out = {"ran": RAN, "variants": {}}
    for rec, row in zip(recorded, rows):
        out["variants"][rec.label] = {"ops": ops_of(rec.calls), "speed_up": row.speed_up,
                                      "call_seconds": [call_cost(ops, hw, "pipelined", "eager", fuse=False).seconds
                                                       for ops in rec.calls]}
    x32, out32 = x.float(), x.float()  # a call's input and denoised output, as the model-call wrapper has them
    for cache in step_caches.NAMES:
        latent = x32 if cache == "LazyCache" else x
        out[cache] = {
            "skipped": ops_of([alone(lambda read: step_caches.skipped_call(cache, latent, width, read))])[0],
            "ran": ops_of([alone(lambda read: step_caches.ran_call(cache, x32, out32, width, read))])[0]}
    try:
        costmodel.record_model(flux, pack, STEPS, [variants[0], dataclasses.replace(variants[2], calls_ran=RAN[:4])],
                               progress=lambda _: None)
        out["short_mask"] = "accepted"
    except ValueError as e:
        out["short_mask"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
