"""Records tiny models with toma_bench.costmodel's own code and prints what tests/test_costmodel.py checks,
as JSON. Run in a subprocess: the cost model needs ComfyUI imported with PyTorch attention (SDPA), which
the in-process test fixture does not choose.

    python tests/costmodel_probe.py      (COMFYUI_PATH names the tree)
"""
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from toma_bench import comfy_host, costmodel, models  # noqa: E402

SDXL_TINY = dict(models.SDXL_SMALL, model_channels=32, num_head_channels=16)
SD15_TINY = dict(models.SD15_FULL, model_channels=32, num_heads=4)
FLUX_TINY = models.FLUX_TINY


def spec(name, model_config, config, latent, conditioning, unet):
    return costmodel.Spec(name, name, model_config, config, latent, conditioning, steps=5, cfg=5.0 if unet else 1.0,
                          unet=unet)


def ops_of(recorded):
    return [[dataclasses.astuple(op) for op in call] for call in recorded.calls]


def main():
    comfy_host.import_core("cpu", require_flux=False)
    pack = comfy_host.load_pack()
    tn = pack.nodes.toma_nodes
    out = {"sampler_reports_steps": comfy_host.sampler_reports_steps()}
    sdxl = spec("sdxl", "SDXL", SDXL_TINY, (1, 4, 16, 16), lambda: models.conditioning("sdxl", 1, 77, 0, 128, 128), True)
    base, tome = costmodel.record_model(sdxl, pack, 5, [
        costmodel.Variant("unpatched", patch=lambda m: m),
        costmodel.Variant("ComfyUI ToMe r=0.5", patch=lambda m: costmodel.comfy_tome(m, 0.5))], progress=lambda _: None)
    out["sdxl_identical"] = ops_of(base) == ops_of(tome)
    out["sdxl_ops"] = sum(map(len, base.calls))

    sd15 = spec("sd15", "SD15", SD15_TINY, (1, 4, 16, 16), lambda: models.conditioning("sd15", 1, 77, 0), True)
    advanced = tn.ToMAPatchModelAdvanced()
    variants = [costmodel.Variant("unpatched", patch=lambda m: m),
                costmodel.Variant("ToMA r=0.5", patch=lambda m: advanced.patch(m, 0.5, 4, 5, scope="attention")[0]),
                costmodel.Variant("CA-ToMe, no fixed count", patch=lambda m: tn.CAToMePatchModel().patch(m, 0.7)[0]),
                costmodel.Variant("CA-ToMe, count fixed", patch=lambda m: tn.CAToMePatchModel().patch(m, 0.7)[0],
                                  meta_scalar=64),
                costmodel.Variant("ToMA default (r=0.5)", patch=lambda m: tn.ToMAPatchModel().patch(m, 0.5, 4, 5)[0])]
    recorded = costmodel.record_model(sd15, pack, 5, variants, progress=lambda _: None)
    # the node's default with the host-pace rule: its run recorded again with the rule stopping merging
    default = recorded[-1]
    out["paced"] = {"rule": default.pace_rule, "others": [r.paced is not None for r in recorded[:-1]],
                    "merged_calls": [any(op.stage for op in call) for call in default.calls],
                    "paced_merged_calls": [any(op.stage for op in call) for call in default.paced.calls]}
    rows = costmodel.price(recorded, costmodel.PROFILES["h200"], "pipelined", sweep=True)
    out["sd15"] = {rec.label: {"attention_keys": sorted({op.key_len for call in rec.calls for op in call
                                                       if op.cls.startswith("attention")}),
                             "stages": sorted({op.stage for call in rec.calls for op in call if op.stage}),
                             "calls": len(rec.calls), "merged": rec.merged, "flag": row.flag,
                             "speed_up": row.speed_up, "range": row.speed_range,
                             "kernels_per_call": [sum(op.kernel for op in call) for call in rec.calls],
                             "stage_kernels_step1": {stage: sum(op.kernel for op in rec.calls[1] if op.stage == stage)
                                                     for stage in ("select", "merge", "unmerge")},
                             "syncs_per_call": row.syncs_per_call}
                   for rec, row in zip(recorded, rows)}
    out["table"] = costmodel.table(rows)

    if hasattr(__import__("comfy.supported_models").supported_models, "Flux"):
        flux = spec("flux", "Flux", FLUX_TINY, (1, 16, 16, 16),
                    lambda: models.dit_conditioning("flux", FLUX_TINY, 1, 16, 0), False)
        recorded = costmodel.record_model(flux, pack, 5, [
            costmodel.Variant("unpatched", patch=lambda m: m),
            costmodel.Variant("ToMA r=0.5", patch=lambda m: tn.ToMAPatchModel().patch(m, 0.5, 4, 5)[0])],
            progress=lambda _: None)
        out["flux"] = {r.label: {"attention_keys": sorted({op.key_len for call in r.calls for op in call
                                                           if op.cls.startswith("attention")}),
                                 "merged": r.merged} for r in recorded}
    # the real rows of the 2026 families that record otherwise than through the host's sampler, at a tiny size
    toma = [costmodel.Variant("unpatched", patch=lambda m: m),
            costmodel.Variant("ToMA r=0.5", patch=lambda m: tn.ToMAPatchModel().patch(m, 0.5, 4, 5)[0])]
    tiny = {"hidream": dict(config=models.HIDREAM_TINY, latent=(1, 16, 16, 16),
                            conditioning=lambda: models.hidream_conditioning(models.HIDREAM_TINY, 1, 16, 0)),
            "ltx2": dict(config=models.LTX2_TINY, latent=((1, 16, 5, 5, 7), (1, 8, 9, 16)),
                         conditioning=lambda: models.text_conditioning(2 * models.LTX2_TINY["caption_channels"], 1, 11, 0))}
    for name, size in tiny.items():
        row = dataclasses.replace(costmodel.SPECS[name], steps=5, **size)
        if not comfy_host.is_current_comfy() or costmodel.missing(row):
            continue
        recorded = costmodel.record_model(row, pack, 5, toma, progress=lambda _: None)
        out[name] = {r.label: {"attention_keys": sorted({op.key_len for call in r.calls for op in call
                                                         if op.cls.startswith("attention")}),
                               "calls": len(r.calls), "merged": r.merged,
                               "syncs_per_call": [sum(op.sync for op in call) for call in r.calls]}
                     for r in recorded}
    print(json.dumps(out))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
