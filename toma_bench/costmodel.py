"""Speed where users run it: every aten op of real-size models, patched by the pack's nodes, priced on a GPU.

    python -m toma_bench.costmodel [--models sdxl,flux,...] [--hardware h200,h100,a100,l40s,rtx4090,rtx3090,FILE.json]
                                   [--regimes eager,graphs,compiled,compiled+graphs] [--variants 'default;r=0.5;...']
                                   [--steps N] [--how pipelined|additive] [--sweep] [--json FILE]
                                   [--ranks 2,4,8 [--link nvlink,pcie4]]

CPU only, no weights, about a minute per model. For each model (ComfyUI's own classes at real widths,
depths and sizes, built on the meta device in bf16) and each variant (the pack's nodes with a setting a
node can express, ToMeSD, CA-ToMe, ComfyUI's ToMe; DiTo on Flux and SD3.5), one sampling run goes through ComfyUI's sampler with
CFG batched as ComfyUI batches it; every aten op of every model call is recorded (toma_bench.oprecord),
so steps that select destinations and steps that reuse them are weighed as the node's schedule has them;
the ops are then priced by a hardware profile (toma_bench.gpuclock) in each regime (eager; graph replay;
torch.compile's inductor as ComfyUI's TorchCompileModel node compiles, the host launching every fused kernel;
inductor with graph replay, mode reduce-overhead: gpuclock.REGIMES). The node's default is also priced with the
host-pace rule (a second run, recorded with the rule judging every call host-bound: ``with_rule``, COLUMNS). For
the node's default, the kernel budget
says how many kernels it adds a step and where (selection, merge, unmerge), and what a host that issues
them one by one pays for them. A run of one step first fills the
pack's per-process host caches (plan geometry), which a real run pays once. LTX-2, whose classes come from
another tree (toma_bench.ltx2_source) and whose [video, audio] latent the host's sampler cannot carry, has
its model called as that tree's sampler calls it (drive_ltx2).

With ``--ranks``, each model runs under raylight's sequence parallelism (USP: each GPU holds one slab of the
tokens, Ulysses attention exchanges them) on that many GPUs: raylight's own injection (from a mirror of its
repository), rank 0 recorded with xfuser's collectives stood in for (``UlyssesMeta``: the attention as Ulysses
runs it, the bytes each all-to-all sends), the collectives priced on a link (``LINKS``) and added to the
step.

This is a model until a GPU run checks it: the GPU kit (toma_bench/gpu_kit, toma_bench.gpu) measures the
same variants and prints predicted against measured.
"""
import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.utils._pytree import tree_map

from . import comfy_host, ltx2_source, models, pack_source, run, step_caches
from .run import comfy_tome
from .gpuclock import PROFILES, REGIMES, Hardware, call_cost, fused, profile, swept
from .oprecord import recording, to_meta
from .tables import format_cell, format_table

SEED = 0
DTYPE = torch.bfloat16


# -- the models ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OtherTree:
    """A model whose classes come from another ComfyUI tree, loaded in place of the host's, and whose latent
    the host's sampler cannot carry (LTX-2: toma_bench.ltx2_source). missing: () -> why its classes cannot
    be loaded here, or None; classes: () -> a context in which they are loaded, yielding the module of
    unet_model, the diffusion model's class (in a plain flow-matching BaseModel); drive: (model, spec,
    sigmas, recording, runtimes) -> None, the model calls of one sampling run, made as that tree's sampler
    makes them."""

    missing: Callable
    classes: Callable
    unet_model: str
    drive: Callable


@dataclass(frozen=True)
class Spec:
    """One real-size model as users run it. model_config: the name of ComfyUI's supported_models class
    (its absence means the tree has no such model); config: its unet_config; latent: the empty latent's
    shape (LTX-2, MiniMax-H3: the video's and the audio's, a nested latent where the host's sampler carries it);
    conditioning: () -> (positive, negative); cfg above 1 batches cond and uncond; tree: where the model is not the
    host's (OtherTree). The fields a tree's model class requires beyond the config come from its model detection
    (models.build_base)."""

    name: str
    title: str
    model_config: str
    config: dict
    latent: tuple
    conditioning: Callable
    steps: int = 15  # a whole period of both reuse 5 and merge_every 3: the same per-step mix as 30 or 45
    cfg: float = 5.0
    unet: bool = False
    mask_share: float | None = None  # a model that indexes by data-dependent masks: the share each selects
    tree: OtherTree | None = None
    host_timestep: bool = False  # the model reads its timestep's value (MiniMax-H3): it stays on the CPU, a sync
    # the module of a stand-in (its installed() and missing()) for a tree without the model (Qwen-Image 2.1)
    stand_in: str | None = None
    transformer_options: dict | None = None  # set on the model before each variant patches it


SD35_LARGE = {
    "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 38, "input_size": None,
    "adm_in_channels": 2048, "context_embedder_config": {"target": "torch.nn.Linear",
                                                         "params": {"in_features": 4096, "out_features": 2432}},
    "num_patches": 36864, "pos_embed_max_size": 192, "qk_norm": "rms", "pos_embed_scaling_factor": None,
    "x_block_self_attn_layers": [],
}
WAN_14B = dict(models.WAN_1_3B, dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
# Wan 2.2 TI2V 5B: 48-channel latents of its 16x16x4 VAE, patch (1, 2, 2)
WAN22_5B = dict(models.WAN_1_3B, dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_dim=48, out_dim=48)


QWEN_IMAGE21_STAND_IN = "toma_bench.qwen_image21"
# Qwen-Image 2.1 as ComfyUI's model detection builds it (the model's defaults: 32 blocks of 32 heads x 128, text 4096)
QWEN_IMAGE21 = {"image_model": "qwen_image21"}
QWEN_IMAGE21_NO_CACHE = {"qwen_image21_cache": {"device": "off"}}  # the QwenImage21Cache node's "off"


def _sd3_conditioning():
    g = torch.Generator().manual_seed(SEED)
    cond = lambda: [[torch.randn(1, 154, 4096, generator=g), {"pooled_output": torch.randn(1, 2048, generator=g)}]]
    return cond(), cond()


def _text(dim: int, tokens: int, **options):
    """Seeded text features of ``dim`` x ``tokens`` with ``options`` (and an all-ones attention mask)."""
    return lambda: models.text_conditioning(dim, 1, tokens, SEED,
                                            attention_mask=torch.ones(1, tokens, dtype=torch.long), **options)


LTX2_FRAME_RATE = 24  # LTX-2's templates: 121 frames at 24 fps, 127 audio latents (25 a second)


def drive_ltx2(model, spec: Spec, sigmas: torch.Tensor, rec, runtimes: list) -> None:
    """LTX-2's model calls of one run, as the February-2026 tree's sampler makes them (the host's sampler
    cannot carry its [video, audio] latent): the patched clone loaded, each runtime told the run's sigmas
    and each step the sampler finishes (as the pack's OUTER_SAMPLE and SAMPLER_SAMPLE wrappers are), the
    clone's wrappers and the step's sigma in transformer_options, cond and uncond batched above CFG 1, each
    call recorded by ``rec``. The model's inputs are on meta; the sigmas stay on the CPU."""
    import comfy.model_management
    import comfy.patcher_extension

    positive, negative = spec.conditioning()
    context = positive[0][0] if spec.cfg == 1 else torch.cat([positive[0][0], negative[0][0]])
    batch = context.shape[0]
    video, audio = (torch.empty(batch, *shape[1:], device="meta", dtype=DTYPE) for shape in spec.latent)
    context = to_meta(context).to(DTYPE)
    comfy.model_management.load_models_gpu([model])
    for runtime in runtimes:
        runtime.begin_run([float(s) for s in sigmas], model.get_model_object("model_sampling"))
        runtime.steps.follow_reports()
    options = dict(model.model_options.get("transformer_options", {}))
    options["wrappers"] = comfy.patcher_extension.merge_nested_dicts({}, model.wrappers)
    options["sample_sigmas"] = sigmas
    with torch.no_grad():
        for step, sigma in enumerate(sigmas[:-1]):
            options["sigmas"] = sigma.expand(batch)
            with rec.model_call():
                model.model.diffusion_model([video, audio], to_meta(sigma.expand(batch)), context, None,
                                            frame_rate=LTX2_FRAME_RATE, transformer_options=dict(options))
            for runtime in runtimes:
                runtime.steps.report(step)
    for runtime in runtimes:
        runtime.end_run()


LTX2_TREE = OtherTree(ltx2_source.missing, ltx2_source.lightricks_modules, "LTXAVModel", drive_ltx2)


# MiniMax-H3 at its templates' 1344x768: 48 x 84 latent pixels (VAE 16x), 24 x 42 tokens a latent frame. 124 frames
# at 24 fps are 37 latent frames (2 + 5 per 17 frames) and 207 audio latent frames at 40 a second (414 rows, stereo)
def _minimax_h3_latent(frames: int, latent_frames: int):
    audio = round(frames / 24 * 40)
    return ((1, 24, latent_frames, 48, 84), (1, 32, 2, audio))


def _ltx2_text():
    """LTX-2's text: Gemma-3-12B tokens padded by its connectors' registers to 1024, video and audio
    contexts side by side (2 x 3840)."""
    return models.text_conditioning(2 * models.LTX2_FULL["caption_channels"], 1, 1024, SEED)


SPECS = {s.name: s for s in (
    Spec("sd15", "SD1.5 512x512, CFG batch 2, 77 text tokens", "SD15", models.SD15_FULL, (1, 4, 64, 64),
         lambda: models.conditioning("sd15", 1, 77, SEED), cfg=7.0, unet=True),
    Spec("sdxl", "SDXL 1024x1024, CFG batch 2, 77 text tokens", "SDXL", models.SDXL_FULL, (1, 4, 128, 128),
         lambda: models.conditioning("sdxl", 1, 77, SEED, 1024, 1024), unet=True),
    Spec("flux", "FLUX.1-dev 1024x1024 (4096 image + 512 text tokens), CFG 1", "Flux", models.FLUX_FULL,
         (1, 16, 128, 128), lambda: models.dit_conditioning("flux", models.FLUX_FULL, 1, 512, SEED), cfg=1.0),
    # FLUX.1-dev at 2048x2048: where keys/values merging pays on an image DiT (attention is most of the FLOPs)
    Spec("flux_2048", "FLUX.1-dev 2048x2048 (16,384 image + 512 text tokens), CFG 1", "Flux", models.FLUX_FULL,
         (1, 16, 256, 256), lambda: models.dit_conditioning("flux", models.FLUX_FULL, 1, 512, SEED), cfg=1.0),
    Spec("sd35", "SD3.5 Large 1024x1024 (4096 image + 154 text tokens), CFG batch 2", "SD3", SD35_LARGE,
         (1, 16, 128, 128), _sd3_conditioning),
    Spec("qwen_image", "Qwen-Image 1328x1328 (6889 image + 128 text tokens), CFG batch 2", "QwenImage",
         models.QWEN_IMAGE_FULL, (1, 16, 1, 166, 166), lambda: models.text_conditioning(3584, 1, 128, SEED),
         cfg=2.5),
    Spec("hunyuan_video", "HunyuanVideo 720p x 129 frames (118,800 video + 256 text tokens), CFG 1",
         "HunyuanVideo", models.HUNYUAN_VIDEO_FULL, (1, 16, 33, 90, 160),
         lambda: models.video_conditioning("hunyuan_video", models.HUNYUAN_VIDEO_FULL, 1, 256, SEED), cfg=1.0),
    Spec("wan_480p", "Wan 2.1 14B 832x480 x 81 frames (32,760 video + 512 text tokens), CFG 5", "WAN21_T2V",
         WAN_14B, (1, 16, 21, 60, 104), lambda: models.wan_conditioning(WAN_14B, 1, 512, SEED)),
    Spec("wan_720p", "Wan 2.1 14B 1280x720 x 81 frames (75,600 video + 512 text tokens), CFG 5",
         "WAN21_T2V", WAN_14B, (1, 16, 21, 90, 160), lambda: models.wan_conditioning(WAN_14B, 1, 512, SEED)),
    Spec("wan22_5b", "Wan 2.2 TI2V 5B 1280x704 x 121 frames (27,280 video + 512 text tokens), CFG 5", "WAN22_T2V",
         WAN22_5B, (1, 48, 31, 44, 80), lambda: models.wan_conditioning(WAN22_5B, 1, 512, SEED)),
    Spec("ltxv", "LTX-Video 2B 768x512 x 97 frames (4,992 video + 128 text tokens), CFG 3", "LTXV", models.LTXV_FULL,
         (1, 128, 13, 16, 24), lambda: models.video_conditioning("ltxv", models.LTXV_FULL, 1, 128, SEED), cfg=3.0),
    # the 2026 families (ComfyUI v0.3.75 and later); Z-Image-Turbo samples in 8 steps without CFG
    Spec("z_image_turbo", "Z-Image-Turbo 1024x1024 (4096 image + 128 text tokens), CFG 1", "ZImage",
         models.Z_IMAGE_FULL, (1, 16, 128, 128), _text(2560, 128), steps=8, cfg=1.0),
    Spec("flux2", "FLUX.2 [dev] 1024x1024 (4096 image + 512 text tokens), CFG 1 (guidance 4)", "Flux2",
         models.FLUX2_FULL, (1, 128, 64, 64), _text(15360, 512, guidance=4.0, pooled_output=None), cfg=1.0),
    Spec("hunyuan_video15", "HunyuanVideo 1.5 720p x 121 frames (111,600 video + 256 text tokens), CFG 6",
         "HunyuanVideo15", models.HUNYUAN_VIDEO15_FULL, (1, 32, 31, 45, 80), _text(3584, 256, pooled_output=None),
         cfg=6.0),
    # HiDream-I1 Full: CFG 5 (Dev and Fast, distilled from it, run CFG 1); 128 T5 and 128 Llama tokens, with
    # the Llama-3.1 text before each block's own Llama layer: 384 text tokens per block
    Spec("hidream", "HiDream-I1 Full 1024x1024 (4096 image + 384 text tokens), CFG batch 2", "HiDream",
         models.HIDREAM_FULL, (1, 16, 128, 128),
         lambda: models.hidream_conditioning(models.HIDREAM_FULL, 1, 128, SEED, llama_layers=32),
         mask_share=1 / models.HIDREAM_FULL["num_routed_experts"]),
    # LTX-2's text-to-video template (1280x720, 121 frames at 24 fps) samples twice: 20 steps at half size
    # with CFG 4, then, upscaled, 3 steps with CFG 1 (the distilled LoRA). Its blocks are called as the
    # tree that has it calls them (drive_ltx2), past the host's sampler
    # MiniMax-H3 (ComfyUI v0.33.0 on): 30 steps with CFG (15 recorded: the same per-step mix), and the 8-step
    # distilled variant (the turbo LoRA on the same model) at CFG 1; Qwen3-VL text, 256 tokens. Batch 1 only:
    # cond and uncond are separate calls
    Spec("minimax_h3", "MiniMax-H3 1344x768 x 124 frames (37,296 video + 414 audio + 256 text tokens), CFG 5 "
         "(cond and uncond one call each)", "MiniMaxH3", models.MINIMAX_H3_FULL, _minimax_h3_latent(124, 37),
         _text(5120, 256), host_timestep=True),
    Spec("minimax_h3_8step", "MiniMax-H3 8-step distilled 1344x768 x 124 frames (37,296 video + 414 audio + 256 "
         "text tokens), CFG 1", "MiniMaxH3", models.MINIMAX_H3_FULL, _minimax_h3_latent(124, 37), _text(5120, 256),
         steps=8, cfg=1.0, host_timestep=True),
    # v0.33.0's own templates (video_minimax_h3_t2v, _i2v): 73 frames (22 latent frames), the 8-step LoRA run 4 steps
    Spec("minimax_h3_template", "MiniMax-H3 as v0.33.0's templates run it: 1344x768 x 73 frames (22,176 video + 244 "
         "audio + 256 text tokens), the distilled LoRA at 4 steps, CFG 1", "MiniMaxH3", models.MINIMAX_H3_FULL,
         _minimax_h3_latent(73, 22), _text(5120, 256), steps=4, cfg=1.0, host_timestep=True),
    # Qwen-Image 2.1 (ComfyUI v0.37.0 on; toma_bench.qwen_image21's stand-in in older trees): 40 steps, no CFG, its
    # text (Qwen3-VL-8B, 128 tokens here) a causal prefix whose keys and values the model caches from the second step.
    # The cache picks its slot by comparing key tensors, which meta tensors cannot: it is off here, every step
    # computing the prefix's 128 rows too (3% of the rows at 1024, under 1% at 2048; the same in every variant, so the
    # speed-ups are a little low)
    Spec("qwen_image21", "Qwen-Image 2.1 1024x1024 (4,096 image + 128 text tokens), CFG 1", "QwenImage21",
         QWEN_IMAGE21, (1, 64, 64, 64), lambda: models.text_conditioning(4096, 1, 128, SEED), steps=40, cfg=1.0,
         stand_in=QWEN_IMAGE21_STAND_IN, transformer_options=QWEN_IMAGE21_NO_CACHE),
    Spec("qwen_image21_2048", "Qwen-Image 2.1 2048x2048 (16,384 image + 128 text tokens), CFG 1", "QwenImage21",
         QWEN_IMAGE21, (1, 64, 128, 128), lambda: models.text_conditioning(4096, 1, 128, SEED), steps=40, cfg=1.0,
         stand_in=QWEN_IMAGE21_STAND_IN, transformer_options=QWEN_IMAGE21_NO_CACHE),
    Spec("ltx2", "LTX-2 19B, the template's first pass: 640x360 x 121 frames (3,520 video + 127 audio + 1,024 "
         "text tokens), CFG batch 2 (CFG 4); model called directly, as tests/test_ltx2.py does", "LTXV",
         models.LTX2_FULL, ((1, 128, 16, 11, 20), (1, 8, 127, 16)), _ltx2_text, cfg=4.0, tree=LTX2_TREE),
    Spec("ltx2_hires", "LTX-2 19B, the template's second pass: 1280x720 x 121 frames (14,080 video + 127 audio "
         "+ 1,024 text tokens), CFG 1; model called directly, as tests/test_ltx2.py does", "LTXV",
         models.LTX2_FULL, ((1, 128, 16, 22, 40), (1, 8, 127, 16)), _ltx2_text, steps=3, cfg=1.0, tree=LTX2_TREE),
)}
UNET_MODELS = ("sd15", "sdxl")
NO_KEYS_VALUES = UNET_MODELS + ("sd35",)  # SD3's attention takes no override: keys/values would be whole blocks
UNET_LEVEL_TOKENS = 64 * 64  # of the level the baselines merge: 1/1 of SD1.5 at 512, 1/2 of SDXL at 1024


def build_meta(spec: Spec, unet_model=None):
    """A ModelPatcher around ``spec``'s model with its weights on the meta device (shapes, no data);
    sampler-side tensors stay on the CPU, so the pack reads its step as it does on a GPU. unet_model: the
    diffusion model's class of a model from another tree (in a plain flow-matching BaseModel)."""
    import comfy.model_patcher
    import comfy.supported_models

    model_config = getattr(comfy.supported_models, spec.model_config)(dict(spec.config))
    model_config.set_inference_dtype(DTYPE, None)
    base = models.build_base(model_config, "meta", unet_model)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)


def missing(spec: Spec) -> str | None:
    """Why this ComfyUI tree cannot build ``spec``'s model, or None."""
    import comfy.supported_models

    if spec.stand_in is not None and not hasattr(comfy.supported_models, spec.model_config):
        try:
            return importlib.import_module(spec.stand_in).missing()
        except ImportError as e:
            return f"this ComfyUI tree has no {spec.model_config}, and its stand-in does not import here ({e})"
    if not hasattr(comfy.supported_models, spec.model_config):
        return f"this ComfyUI tree has no {spec.model_config}"
    return spec.tree.missing() if spec.tree else None


def model_classes(spec: Spec):
    """A context in which ``spec``'s model classes are where ComfyUI keeps them: another tree's (spec.tree; it yields
    their module), a stand-in's for a tree that lacks them (spec.stand_in), or the host's."""
    if spec.tree is not None:
        return spec.tree.classes()
    if spec.stand_in is not None:
        return importlib.import_module(spec.stand_in).installed()
    return contextlib.nullcontext()


# -- the variants ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant(run.Variant):
    """A variant as the cost model records it; meta_scalar: the answer to a data-dependent read on the
    meta device (CA-ToMe's merge count), fixed and said so in the label. ``cache``: a step cache
    (toma_bench.step_caches) ran in the proxy run, which ran the model at the steps ``calls_ran`` marks: the
    real-size model is called at those steps only, each other step priced at what the cache computes in
    place of the call (step_caches.skipped_call), each call that runs with the cache's bookkeeping added
    (step_caches.ran_call); ``patch`` is then what runs inside the calls (ToMA, or nothing)."""

    meta_scalar: int | None = None
    cache: str | None = None
    calls_ran: tuple | None = None


def variants_for(name: str, pack) -> list[Variant]:
    """The variants of model ``name``: unpatched, the node's default, the main alternatives a node can
    express, and the other methods where they apply (ToMeSD, CA-ToMe on UNets; DiTo on Flux and SD3.5)."""
    tn = pack.nodes.toma_nodes
    basic, advanced = tn.ToMAPatchModel(), tn.ToMAPatchModelAdvanced()
    w, reuse = 4, tn.DEFAULT_REUSE  # every row but the node default's names window 4
    out = [Variant("unpatched", patch=lambda m: m),
           Variant("ToMA default (r=auto)",
                   patch=lambda m: basic.patch(m, tn.DEFAULT_RATIO, tn.DEFAULT_WINDOW, reuse)[0])]
    if name in UNET_MODELS:
        for scope, levels, r in (("attention", "auto", 0.75), ("block", "auto", 0.5), ("block", "auto+next", 0.5),
                                 ("block", "auto+next", 0.75)):
            out.append(Variant(f"ToMA {scope} {levels} r={r:g}",
                               patch=lambda m, s=scope, lv=levels, r=r: advanced.patch(m, r, w, reuse, scope=s, levels=lv)[0]))
        # the baselines on the level ToMA's "auto" merges: 1/1 on SD1.5, 1/2 on SDXL (max_downsample 2)
        down = 1 if name == "sd15" else 2
        out.append(Variant(f"ToMeSD r=0.5 (max_downsample {down})",
                           patch=lambda m: tn.ToMeSDPatchModel().patch(m, 0.5, down)[0]))
        tokens = UNET_LEVEL_TOKENS
        count = tokens // 2
        out.append(Variant(f"CA-ToMe t=0.7 (count fixed at {count} of {tokens} tokens)",
                           patch=lambda m: tn.CAToMePatchModel().patch(m, 0.7, max_downsample=down)[0], meta_scalar=count))
        for r in (0.5, 0.75):
            out.append(Variant(f"ComfyUI ToMe r={r:g}", patch=lambda m, r=r: comfy_tome(m, r)))
        return out + rotations(tn)
    for r in (0.5, 0.9):  # around the default ratio: the earlier default, and the node's highest
        out.append(Variant(f"ToMA r={r:g}", patch=lambda m, r=r: basic.patch(m, r, w, reuse)[0]))
    if name in ("flux", "hunyuan_video"):
        out.append(Variant("ToMA scope attention r=0.5", patch=lambda m: advanced.patch(m, 0.5, w, reuse, scope="attention")[0]))
    if name not in NO_KEYS_VALUES:
        # keys/values with per-block plans to shared destinations and proportional attention (issue 28's setting)
        for r in (0.75, 0.9):
            out.append(Variant(f"ToMA keys/values r={r:g} (per-block plans, shared destinations, proportional)",
                               patch=lambda m, r=r: advanced.patch(m, r, w, reuse, scope="keys/values",
                                                                   plan_per_block=True, shared_destinations=True,
                                                                   proportional_attention=True)[0]))
    out.append(Variant("ToMA r=0.5 merge_every 3", patch=lambda m: advanced.patch(m, 0.5, w, reuse, merge_every=3)[0]))
    if name in ("flux", "sd35"):  # the paper's models: DiTo (after arXiv 2605.22011) at its node's defaults
        out.append(Variant("DiTo r=0.5 (interval 5)", patch=lambda m: tn.DiToPatchModel().patch(m, 0.5)[0]))
    return out + rotations(tn)


def default_with_rotation(tn, rotation: str, ratio: float | None = None):
    """A patch: the basic node's default (``ratio``, None: the kind's) with its settings of the model's kind
    through the Advanced node, with ``rotation`` ("on", "off") in place of the kind's choice."""

    def patch(m):
        kind = tn.preset_of(m)
        return tn.ToMAPatchModelAdvanced().patch(m, tn.DEFAULT_RATIO if ratio is None else ratio, tn.DEFAULT_WINDOW,
                                                 tn.DEFAULT_REUSE, levels=kind.levels,
                                                 weights_interval=kind.weights_interval,
                                                 start_percent=kind.start_percent, merge_every=kind.merge_every,
                                                 rotation=rotation)[0]

    return patch


def rotations(tn) -> list[Variant]:
    """The node's default with destinations that rotate and without: what rotating costs, its bias and counts
    priced as every other op."""
    return [Variant(f"ToMA default, rotation {rotation}", patch=default_with_rotation(tn, rotation))
            for rotation in ("off", "on")]


# -- recording a sampling run on the meta device --------------------------------------------------------
def probe_sampler(model, x, sigmas, extra_args=None, callback=None, disable=None, ran=None, skip=None):
    """A sampler that calls the model once at every sigma and keeps ``x``: the outputs live on the meta
    device, and what the model costs does not depend on their values. It reports each step it finishes
    to ``callback``, as ComfyUI's k-diffusion samplers do (the pack locates model calls by those reports).
    ``ran``: for a run of as many steps, the steps whose model call runs; ``skip(x)`` stands in for the others."""
    s_in = x.new_ones([x.shape[0]])
    ran = ran if ran is not None and len(ran) == len(sigmas) - 1 else None
    for i in range(len(sigmas) - 1):
        if ran is None or ran[i]:
            denoised = model(x, sigmas[i] * s_in, **(extra_args or {}))
        else:
            denoised = skip(x)
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
    return x


class MetaLoader:
    """Stands in for ``comfy.model_management.load_models_gpu`` while recording: applies the object
    patches of the MODEL being sampled without loading weights (there are none), after taking off those
    of the MODEL sampled before it, as loading another clone does in ComfyUI."""

    def __init__(self):
        self.current = None

    def __call__(self, patchers, *args, **kwargs):
        for m in patchers[:1]:
            if self.current is not None and self.current is not m:
                self.current.unpatch_model(unpatch_weights=False)
            if self.current is not m:
                try:
                    m.patch_model(load_weights=False)  # current ComfyUI
                except TypeError:
                    m.patch_model(device_to=None, patch_weights=False)  # March 2024
            self.current = m

    def release(self):
        if self.current is not None:
            self.current.unpatch_model(unpatch_weights=False)
            self.current = None


@contextlib.contextmanager
def meta_sampling():
    """ComfyUI's loader replaced by a MetaLoader, and free memory reported as a large GPU's (128 GiB),
    so ComfyUI batches cond and uncond as it does on one."""
    import comfy.model_management as mm

    loader = MetaLoader()
    saved = mm.load_models_gpu, mm.get_free_memory
    mm.load_models_gpu = loader
    mm.get_free_memory = lambda *a, **k: (128 * 2**30, 128 * 2**30) if k.get("torch_free_too") else 128 * 2**30
    try:
        yield loader
    finally:
        mm.load_models_gpu, mm.get_free_memory = saved
        loader.release()


class FailedPlans(logging.Handler):
    """Collects the runtime's "could not build a merge plan" warnings (a block whose plan failed runs
    unmerged; the runtime says so once per level)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        message = record.getMessage()
        if "could not build a merge plan" in message:
            self.messages.append(message)


@dataclass
class Recorded:
    """What one variant's sampling run did: the ops of each model call, the pack's summaries of what
    merged, and the warnings of plans that failed."""

    label: str
    calls: list
    steps: int
    merged: list  # (level, tokens, merged tokens) of every merged level, over the pack's nodes
    patched_by_pack: bool
    failed: list
    traced: "Recorded | None" = None  # the same run with the pack's engine as torch.compile traces it
    # the same run where the host-pace rule (nodes/runtime/pace.py) judges every call host-bound: merging stops
    # after the deciding calls; and the rule's (deciding calls, slack), read from the runtime that recorded it
    paced: "Recorded | None" = None
    pace_rule: tuple | None = None
    _fused: list | None = dataclasses.field(default=None, repr=False)

    def calls_in(self, regime: str) -> list:
        """The ops of each call as ``regime`` launches them: from the traced recording where the model is
        compiled or replayed from a graph and there is one, fused once where inductor fuses them."""
        source = self.traced if REGIMES[regime].traced and self.traced is not None else self
        if not REGIMES[regime].fuse:
            return source.calls
        if source._fused is None:
            source._fused = [fused(ops) for ops in source.calls]
        return source._fused


@contextlib.contextmanager
def traced_form(pack):
    """The pack's engine as torch.compile traces it: toma_core.plan's is_compiling answers True (merges in
    the windowed form, nothing kept between block calls), for the recordings the compiled and graph-replay
    regimes price."""
    plan = pack.toma_core.plan
    saved = plan.is_compiling
    plan.is_compiling = lambda: True
    try:
        yield
    finally:
        plan.is_compiling = saved


def run_sigmas(model, steps: int) -> torch.Tensor:
    """The "simple" scheduler's sigmas for ``model``: calculate_sigmas(model_sampling, ...) in current ComfyUI; in
    March 2024, before it, the schedulers took the model and read its model_sampling (simple_scheduler, which every
    tree defines, rather than March 2024's calculate_sigmas_scheduler, which later trees removed: a checker that
    resolves each ``comfy.*`` reference against a current tree, comfy-import-guard, would call that name a break)."""
    import comfy.samplers

    if hasattr(comfy.samplers, "calculate_sigmas"):
        return comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "simple", steps)
    return comfy.samplers.simple_scheduler(model.model, steps)


def empty_latent(shape: tuple):
    """Zeros of ``shape``; a NestedTensor of zeros where it is several streams' shapes (MiniMax-H3)."""
    if isinstance(shape[0], int):
        return torch.zeros(shape)
    import comfy.nested_tensor

    return comfy.nested_tensor.NestedTensor([torch.zeros(s) for s in shape])


class HostBoundEvent:
    """A device event as the host-pace rule sees one where the host sets the pace: reached at once, the GPU's
    span nothing (the recording on the meta device has no device events of its own)."""

    def record(self):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return 0.0


def record_variant(base, spec: Spec, variant: Variant, pack, steps: int, host_bound: bool = False) -> Recorded:
    """One sampling run of ``variant`` recorded; ``host_bound``: with the host-pace rule of its runtimes judging
    every call host-bound (``HostBoundEvent``), so it stops merging after its deciding calls."""
    import comfy.sample
    import comfy.samplers

    if spec.transformer_options:
        base = base.clone()
        base.model_options.setdefault("transformer_options", {}).update(spec.transformer_options)
    model = variant.patch(base)
    runtimes = []
    try:
        runtimes = pack.nodes.runtime.runtimes_of(model)
    except ValueError:
        pass
    paces = [runtime.pace for runtime in runtimes if runtime.pace is not None]
    for pace in paces if host_bound else ():
        pace.events = lambda device: HostBoundEvent()
    holder = {}
    if variant.calls_ran is not None and (len(variant.calls_ran) != steps or spec.tree is not None):
        raise ValueError(f"{variant.label}: {len(variant.calls_ran)} calls ran in the proxy run, for a run of "
                         f"{steps} steps{' on the host sampler' if spec.tree is not None else ''}")
    width = step_caches.hidden_width(base.model.diffusion_model)
    conds = 1 if spec.cfg == 1 else 2  # CFG batched: the model's calls carry cond and uncond

    def read(_):  # a value the cache reads back to decide: the host waits for the device
        holder["rec"].add("_local_scalar_dense", "elementwise", 0, 8, True, True)

    def wrapper(apply_model, args):
        rec = holder.get("rec")
        # the call's inputs on meta, as they are on the GPU in a real run; the sigmas in
        # transformer_options stay on the CPU for the pack's read of the step
        c = {k: v if k == "transformer_options" else tree_map(to_meta, v) for k, v in args["c"].items()}
        timestep = args["timestep"] if spec.host_timestep else to_meta(args["timestep"])
        with rec.model_call() if rec is not None else contextlib.nullcontext():
            x = to_meta(args["input"])
            out = apply_model(x, timestep, **c)
            if variant.cache is not None and rec is not None:
                step_caches.ran_call(variant.cache, x, out, width, read)
            return out

    def skip(x):
        latent = torch.empty(x.shape[0] * (1 if variant.cache == "LazyCache" else conds), *x.shape[1:],
                             device="meta", dtype=torch.float32 if variant.cache == "LazyCache" else DTYPE)
        with holder["rec"].model_call():
            step_caches.skipped_call(variant.cache, latent, width, read)
        return x

    model = model.clone()
    model.set_model_unet_function_wrapper(wrapper)
    sampler = comfy.samplers.KSAMPLER(probe_sampler, extra_options={"ran": variant.calls_ran, "skip": skip})
    failed = FailedPlans()
    logger = logging.getLogger("ComfyUI-ToMA")
    logger.addHandler(failed)
    try:
        for n, keep in ((1, False), (steps, True)):  # the first run fills the per-process host caches
            sigmas = run_sigmas(model, n)
            with recording() as rec:
                rec.meta_scalar = variant.meta_scalar
                rec.meta_mask_share = spec.mask_share
                holder["rec"] = rec
                for runtime in runtimes:
                    runtime.stages.listeners[:] = [rec.stage_listener]
                if spec.tree is None:
                    positive, negative = spec.conditioning()
                    latent = empty_latent(spec.latent)
                    comfy.sample.sample_custom(model, latent, spec.cfg, sampler, sigmas, positive, negative, latent,
                                               disable_pbar=True, seed=SEED)
                else:
                    spec.tree.drive(model, spec, sigmas, rec, runtimes)
            holder.clear()
    finally:
        logger.removeHandler(failed)
        for runtime in runtimes:
            runtime.stages.listeners.clear()
    merged = []
    for runtime in runtimes:
        for v in runtime.summary()["levels"].values():
            merged.append((run.level_text(v), v["tokens"], v["merged_tokens"]))
    rule = (paces[0].deciding_calls, paces[0].slack) if paces else None
    return Recorded(variant.label, rec.calls, steps, merged, bool(runtimes), failed.messages, pace_rule=rule)


# -- pricing and tables ------------------------------------------------------------------------------------
@dataclass
class Priced:
    label: str
    regime: str
    ms_per_step: float
    speed_up: float | None
    speed_range: tuple | None
    gflop_per_step: float
    flops_saved: float | None
    stage_percent: dict
    kernels_per_step: float
    syncs_per_call: float
    gpu_ms_per_step: float
    host_ms_per_step: float
    class_ms: dict
    merged: str
    flag: str


def per_step(recorded: Recorded, hw: Hardware, how: str, regime: str = "eager"):
    costs = [call_cost(ops, hw, how, regime, fuse=False)  # calls_in has fused them where the regime fuses
             for ops in recorded.calls_in(regime)]
    n = recorded.steps
    return costs, sum(c.seconds for c in costs) / n


def merged_text(recorded: Recorded) -> tuple[str, str]:
    """(what merged, a flag when a variant patched by the pack merged nothing or lost plans)."""
    if not recorded.patched_by_pack:
        return "-", ""
    text = "; ".join(f"{level} {tokens}->{merged}" for level, tokens, merged in recorded.merged)
    flag = ""
    if not any(merged < tokens for _, tokens, merged in recorded.merged):
        flag = "MERGED NOTHING"
    elif recorded.failed:
        flag = f"plans failed at {len(recorded.failed)} levels"
    return text or "nothing", flag


RULE_SUFFIX = " + host-pace rule"


def with_rule(recorded: Recorded, hw: Hardware, how: str, regime: str = "eager") -> tuple[Recorded, bool]:
    """What runs where the host-pace rule (nodes/runtime/pace.py) runs beside ``recorded``'s variant on ``hw`` in
    ``regime``, and whether the rule stops merging: the recording in which merging stops after the deciding calls
    (``Recorded.paced``) where the clock judges each of the first merged calls host-bound (``CallCost.host_bound``),
    the variant's own recording elsewhere. Under torch.compile (every regime but eager) the rule stays out."""
    if recorded.paced is None or REGIMES[regime].traced:
        return recorded, False
    deciding, slack = recorded.pace_rule
    costs = per_step(recorded, hw, how, regime)[0]
    merged = [cost for ops, cost in zip(recorded.calls, costs) if any(op.stage for op in ops)][:deciding]
    stops = len(merged) == deciding and all(cost.host_bound(slack) for cost in merged)
    return (recorded.paced, True) if stops else (recorded, False)


def price(recorded: list[Recorded], hw: Hardware, how: str, sweep: bool, regime: str = "eager") -> list[Priced]:
    """Each recording priced on ``hw`` in ``regime`` against the first (unpatched), and after each that the
    host-pace rule runs beside (``Recorded.paced``: the node's default) a row with the rule (``with_rule``); with
    ``sweep``, the range of speed-ups over gpuclock.swept and the other way of adding up."""
    base = recorded[0]
    _, base_step = per_step(base, hw, how, regime)
    base_flops = sum(op.flops for ops in base.calls for op in ops) / base.steps
    ranges = {}
    if sweep:
        settings = [(p, how) for _, p in swept(hw)] + [(hw, "additive" if how == "pipelined" else "pipelined")]
        base_steps = [per_step(base, p, h, regime)[1] for p, h in settings]  # once per setting, not per variant
        for r in recorded:
            ups = [b / per_step(r, p, h, regime)[1] for b, (p, h) in zip(base_steps, settings)]
            ranges[r.label] = (min(ups), max(ups))
            if r.paced is not None:
                ups = [b / per_step(with_rule(r, p, h, regime)[0], p, h, regime)[1]
                       for b, (p, h) in zip(base_steps, settings)]
                ranges[r.label + RULE_SUFFIX] = (min(ups), max(ups))
    rows = []
    for r in recorded:
        rows.append(priced_row(r, r.label, hw, how, regime, base, base_step, base_flops, ranges))
        if r.paced is not None:
            ran, stops = with_rule(r, hw, how, regime)
            label = r.label + RULE_SUFFIX
            row = priced_row(ran, label, hw, how, regime, base, base_step, base_flops, ranges)
            row.flag = (f"host-bound: merging stops after {r.pace_rule[0]} calls" if stops else
                        "off under torch.compile" if REGIMES[regime].traced else "GPU-bound: merges on")
            rows.append(row)
    return rows


def priced_row(r: Recorded, label: str, hw: Hardware, how: str, regime: str, base: Recorded, base_step: float,
               base_flops: float, ranges: dict) -> Priced:
    costs, step = per_step(r, hw, how, regime)
    ops = [op for call in r.calls for op in call]
    flops = sum(op.flops for op in ops) / r.steps
    stages = {k: 100 * sum(c.stages[k] for c in costs) / r.steps / step for k in ("select", "merge", "unmerge")}
    classes = {}
    for c in costs:
        for k, v in c.classes.items():
            classes[k] = classes.get(k, 0.0) + 1000 * v / r.steps
    text, flag = merged_text(r)
    return Priced(label, regime, 1000 * step, base_step / step, ranges.get(label), flops / 1e9,
                  None if r is base else 100 * (1 - flops / base_flops), stages,
                  sum(c.kernels for c in costs) / r.steps,
                  sum(op.sync for op in ops) / max(1, len(r.calls)),
                  1000 * sum(c.gpu for c in costs) / r.steps, 1000 * sum(c.host for c in costs) / r.steps,
                  classes, text, flag)


COLUMNS = """Columns:
  variant       the node and setting (CA-ToMe's data-dependent merge count is fixed: the meta device has no data)
  ms/step       modelled milliseconds per sampling step (all model calls of the run / steps: steps that
                select destinations and steps that reuse them as the node's schedule has them)
  speed-up      unpatched ms/step / this variant's
  range         lowest-highest speed-up over --sweep (each assumption varied alone, and the other way of adding up)
  GFLOP/step    GEMM, convolution and attention FLOPs per step; saved %: against unpatched
  sel/mrg/unm % shares of the step spent selecting destinations, merging and unmerging (each op's larger of
                GPU and host time, tagged through the runtime's stage-clock listeners)
  kernels/step  kernels launched per step (aten ops that launch one; under the compiled regimes, after fusion)
  syncs/call    ops per model call that make the host wait for the GPU (values read back)
  GPU/host ms   total GPU time and host time per step (pipelined, they overlap)
  merged        each merged level or block group: tokens -> merged tokens (MERGED NOTHING flags a patched
                variant whose every plan fell back to running unmerged)

The row "<default> + host-pace rule" prices the node's default with the rule that stops merging for a run where
the host sets the pace (nodes/runtime/pace.py): where the clock finds the GPU done within the rule's slack of the
host in each of the first merged calls, the run as recorded with merging stopped after those calls ("stops" in
the table by profile and regime); elsewhere, and under torch.compile (every regime but eager), the default's.

Regimes (--regimes; toma_bench.gpuclock.REGIMES):
""" + "\n".join(f"  {r.name:<12}  {r.title}" for r in REGIMES.values())


def table(rows: list[Priced]) -> str:
    head = ["variant", "ms/step", "speed-up", "range", "GFLOP/step", "saved %", "sel/mrg/unm %", "kernels/step",
            "syncs/call", "GPU ms", "host ms", "merged"]
    body = []
    for r in rows:
        rng = "-" if r.speed_range is None else f"{r.speed_range[0]:.2f}-{r.speed_range[1]:.2f}x"
        stages = "/".join(f"{r.stage_percent[k]:.1f}" for k in ("select", "merge", "unmerge"))
        body.append([r.label, f"{r.ms_per_step:.1f}", f"{r.speed_up:.2f}x", rng, f"{r.gflop_per_step:,.0f}",
                     format_cell(r.flops_saved, "{:.1f}"), stages, f"{r.kernels_per_step:,.0f}",
                     f"{r.syncs_per_call:.1f}", f"{r.gpu_ms_per_step:.1f}", f"{r.host_ms_per_step:.1f}",
                     (r.merged + (f"  [{r.flag}]" if r.flag else ""))])
    return format_table(head, body)


def profile_table(priced: dict) -> str:
    """Variants down, columns across (a profile, or a profile and a regime): each variant's speed-up, with its
    range over the sweep where it was swept."""
    names = list(priced)
    head = ["variant"] + [f"{n} ({priced[n][0].ms_per_step:,.1f} ms)" for n in names]

    def cell(r):
        rng = "" if r.speed_range is None else f" ({r.speed_range[0]:.2f}-{r.speed_range[1]:.2f})"
        return f"{r.speed_up:.2f}x{rng}" + (" stops" if r.flag.startswith("host-bound") else "")

    body = [[row.label] + [cell(priced[n][i]) for n in names] for i, row in enumerate(priced[names[0]])]
    return format_table(head, body)


DEFAULT_LABEL = "ToMA default"


def kernels_per_step(recorded: Recorded, regime: str = "eager", stage: str | None = "any") -> float:
    """Kernels ``recorded`` launches a step in ``regime``; ``stage``: only those of one merge stage (None:
    outside the stages)."""
    return sum(op.kernel for ops in recorded.calls_in(regime) for op in ops
               if stage == "any" or op.stage == stage) / recorded.steps


def kernel_budget(recorded: list[Recorded], hw: Hardware, how: str = "pipelined") -> dict | None:
    """What the node's default (the row labelled DEFAULT_LABEL) adds to unpatched (the first row) a step: its
    kernels in each regime, the eager ones by merge stage, the host time an eager host spends issuing them,
    and the GPU time its merging saves (eager); None without a default row."""
    base = recorded[0]
    default = next((r for r in recorded if r.label.startswith(DEFAULT_LABEL)), None)
    if default is None or default is base:
        return None
    stages = {stage: kernels_per_step(default, "eager", stage) for stage in ("select", "merge", "unmerge")}
    stages["model"] = kernels_per_step(default, "eager", None) - kernels_per_step(base, "eager", None)
    added = {regime: (kernels_per_step(base, regime), kernels_per_step(default, regime)) for regime in REGIMES}
    gpu = [sum(c.gpu for c in per_step(r, hw, how)[0]) / r.steps for r in (base, default)]
    extra = added["eager"][1] - added["eager"][0]
    return {"label": default.label, "kernels": added, "eager_by_stage": stages,
            "eager_host_ms": extra * hw.host_us_per_kernel / 1000, "gpu_ms_saved": 1000 * (gpu[0] - gpu[1]),
            "host_us_per_kernel": hw.host_us_per_kernel, "profile": hw.name}


def budget_line(budget: dict) -> str:
    k = budget["kernels"]
    stages = budget["eager_by_stage"]
    regimes = ", ".join(f"{regime} {before:,.0f} -> {after:,.0f} ({after - before:+,.0f})"
                        for regime, (before, after) in k.items())
    return (f"kernel budget, {budget['label']}: kernels a step {regimes}; eager, by stage: selection "
            f"{stages['select']:,.0f}, merge {stages['merge']:,.0f}, unmerge {stages['unmerge']:,.0f}, in the model "
            f"{stages['model']:+,.0f}. On {budget['profile']} an eager host at {budget['host_us_per_kernel']:g} us a "
            f"kernel spends {budget['eager_host_ms']:.1f} ms a step issuing them, against "
            f"{budget['gpu_ms_saved']:.1f} ms of GPU work the merging saves.")


def select_variants(variants: list, wanted: list[str] | None) -> list:
    """Unpatched (the first) and the variants whose label contains one of ``wanted`` (case-insensitive), or
    all of them; a name that matches none is an error naming the labels."""
    if not wanted:
        return variants
    lower = [w.lower() for w in wanted]
    unmatched = [w for w in wanted if not any(w.lower() in v.label.lower() for v in variants)]
    if unmatched:
        raise ValueError(f"--variants: {unmatched} match no variant (labels: {'; '.join(v.label for v in variants)})")
    return variants[:1] + [v for v in variants[1:] if any(w in v.label.lower() for w in lower)]


# -- sequence parallelism (raylight's USP) ------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """The interconnect Ulysses' collectives cross: ``gbps`` the bytes a GPU sends (and receives) a second in an
    all-to-all, ``latency_us`` what each collective costs besides. Collectives block the ranks' compute (Ulysses'
    all-to-alls sit between the projections and the attention): their time adds to the step's."""

    name: str
    gbps: float
    latency_us: float
    source: str


LINKS = {
    # NVIDIA H200 SXM (and H100 SXM) datasheet: fourth-generation NVLink, 900 GB/s per GPU (450 GB/s each way),
    # every GPU of an HGX board reaching every other through NVSwitch at that rate; an all-to-all taken at 80%
    # of it, and 15 us a collective (NCCL's small-message latency over NVLink is some 10-20 us)
    "nvlink": Link("nvlink", 360.0, 15.0, "NVLink 4 (H200 SXM: 450 GB/s each way) at 80%, 15 us a collective"),
    # GPUs without NVLink (RTX 4090, L40S) on PCIe 4.0 x16: 32 GB/s each way, at 80%, 30 us a collective
    "pcie4": Link("pcie4", 25.0, 30.0, "PCIe 4.0 x16 (32 GB/s each way) at 80%, 30 us a collective"),
}


class UlyssesMeta:
    """xfuser as rank 0 of ``world`` sees it while the cost model records on the meta device: Ulysses
    attention as the GPU runs it (the queries, keys and values of every rank's slab for ``heads / world``
    heads: an all-to-all of each, the attention, an all-to-all of its output back) and the all-gather after
    the blocks. Each collective's bytes sent by a rank go to ``collectives`` ((what, bytes)); on meta the
    collectives themselves are allocations, so the recording holds the ranks' compute alone."""

    def __init__(self, world: int):
        self.world = world
        self.collectives: list[tuple[str, float]] = []

    def sent(self, what: str, t: torch.Tensor, share: float) -> None:
        self.collectives.append((what, t.numel() * t.element_size() * share))

    def attention(self, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                  **kwargs):
        """q, k, v (B, L, heads * d) of the rank's slab (raylight's Wan calls pass no mask and no reshape flags)."""
        from comfy.ldm.modules.attention import optimized_attention

        if mask is not None or skip_reshape or skip_output_reshape or heads % self.world:
            raise ValueError("the cost model's Ulysses stand-in takes (B, L, heads * d) inputs without a mask, heads "
                             f"divisible by the ranks ({heads} heads, {self.world} ranks)")
        world, share = self.world, (self.world - 1) / self.world
        for name, t in (("q", q), ("k", k), ("v", v)):
            self.sent(name, t, share)
        b, c = q.shape[0], q.shape[-1] // world
        out = optimized_attention(q.new_empty(b, world * q.shape[1], c), k.new_empty(b, world * k.shape[1], c),
                                  v.new_empty(b, world * v.shape[1], c), heads // world)
        self.sent("out", out, share)
        return q.new_empty(q.shape)

    def all_gather(self, x, dim):
        self.sent("all-gather", x, self.world - 1)
        shape = list(x.shape)
        shape[dim] *= self.world
        return x.new_empty(shape)


@dataclass
class RankRecording:
    """One variant's sampling run as rank 0 of ``world`` records it: the ops (``recorded``) and the collectives
    of one model call (every call exchanges alike: ``UlyssesMeta.collectives``)."""

    world: int
    recorded: Recorded
    collectives: list

    def comm_seconds(self, link: Link) -> float:
        """A step's collectives on ``link``: every model call's."""
        calls = len(self.recorded.calls) / self.recorded.steps
        return calls * sum(link.latency_us * 1e-6 + sent / (link.gbps * 1e9) for _, sent in self.collectives)

    def block_bytes(self) -> list[float]:
        """Bytes a rank sends in each block of a model call: its self- and cross-attention's all-to-alls."""
        exchanges = [sent for what, sent in self.collectives if what != "all-gather"]
        return [sum(exchanges[i:i + 8]) for i in range(0, len(exchanges), 8)]


def sequence_parallel_variants(pack) -> list[Variant]:
    """What the ranks run: unpatched, the node's default (keys/values: on slabs it steps aside, since xfuser's
    attention takes no override) and whole blocks (scope block, which slabs merge at) at ratios 0.5 and 0.75."""
    tn = pack.nodes.toma_nodes
    advanced = tn.ToMAPatchModelAdvanced()
    return [Variant("unpatched", patch=lambda m: m),
            Variant("ToMA default (r=auto)",
                    patch=lambda m: tn.ToMAPatchModel().patch(m, tn.DEFAULT_RATIO, tn.DEFAULT_WINDOW, tn.DEFAULT_REUSE)[0])
            ] + [Variant(f"ToMA scope block r={r:g}",
                         patch=lambda m, r=r: advanced.patch(m, r, 4, tn.DEFAULT_REUSE, scope="block")[0])
                 for r in (0.5, 0.75)]


def record_ranks(spec: Spec, pack, steps: int, world: int, progress=print) -> list[RankRecording]:
    """Rank 0's recordings of sequence_parallel_variants under raylight's USP over ``world`` ranks (its own
    injection, read from a mirror of raylight: pack_source), with xfuser's stand-ins in sys.modules while it
    samples (ToMA reads the rank there); one GPU (``world`` 1) without raylight."""
    variants = sequence_parallel_variants(pack)
    if world == 1:
        return [RankRecording(1, r, []) for r in record_model(spec, pack, steps, variants, progress)]
    ulysses = UlyssesMeta(world)
    modules = pack_source.raylight_usp(lambda: 0, lambda: world, ulysses, ulysses.attention)
    saved = {name: sys.modules.get(name) for name in modules}
    out = []
    try:
        sys.modules.update(modules)
        with meta_sampling():
            base = build_meta(spec)
            modules["raylight.distributed_modules.usp"].USPInjectRegistry.inject(base, None, 0, False, True)
            for variant in variants:
                started = time.perf_counter()
                ulysses.collectives = []
                recorded = record_variant(base, spec, variant, pack, steps)
                # record_variant samples 1 step, then ``steps``: the last model call's collectives are one call's
                calls = (1 + steps) * len(recorded.calls) // steps
                out.append(RankRecording(world, recorded, ulysses.collectives[-len(ulysses.collectives) // calls:]))
                progress(f"[costmodel] {spec.name} over {world} ranks: {variant.label} recorded in "
                         f"{time.perf_counter() - started:.1f} s")
    finally:
        pack_source.restore_modules(saved)
    return out


def ranks_table(by_world: dict, hw: Hardware, link: Link, how: str) -> str:
    """Per rank count and variant: a rank's compute, its all-to-all bytes per block (the first block, which
    never merges, and the last), the collectives' time, the step, and the speed-up over unpatched on as many
    ranks and over unpatched on one GPU."""
    one_gpu = per_step(by_world[1][0].recorded, hw, how)[1]
    head = ["ranks", "variant", "compute ms", "all-to-all MB/block (first, last)", "comm ms", "ms/step",
            "speed-up (same ranks)", "vs one GPU", "merged"]
    body = []
    for world, recordings in by_world.items():
        base = None
        for r in recordings:
            compute = per_step(r.recorded, hw, how)[1]
            comm = r.comm_seconds(link)
            step = compute + comm
            base = step if base is None else base
            blocks = r.block_bytes()
            mb = "-" if not blocks else f"{blocks[0] / 2**20:,.1f}, {blocks[-1] / 2**20:,.1f}"
            body.append([str(world), r.recorded.label, f"{1000 * compute:,.1f}", mb, f"{1000 * comm:,.1f}",
                         f"{1000 * step:,.1f}", f"{base / step:.2f}x", f"{one_gpu / step:.2f}x",
                         merged_text(r.recorded)[0]])
    return format_table(head, body)


# -- command line ------------------------------------------------------------------------------------------
def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m toma_bench.costmodel", description=__doc__.split("\n\n")[0],
                                 epilog=COLUMNS, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SPECS),
                    help=f"comma list of {', '.join(SPECS)} (default: all the ComfyUI tree has)")
    ap.add_argument("--hardware", default="h200",
                    help=f"comma list of profiles ({', '.join(PROFILES)}) or JSON files of toma_bench.gpuclock.Hardware "
                         "fields (default h200); the same recordings are priced on each")
    ap.add_argument("--regimes", default="eager",
                    help=f"comma list of {', '.join(REGIMES)} (toma_bench.gpuclock.REGIMES; default eager): the same "
                         "recordings are priced in each")
    ap.add_argument("--variants", default=None,
                    help="';'-separated parts of variant labels to record (labels hold commas; e.g. 'default;r=0.5'; unpatched always; "
                         "default: every variant of the model)")
    ap.add_argument("--steps", type=int, default=None, help="sampling steps per run (default 15: a whole period of the default reuse 5 and of merge_every 3)")
    ap.add_argument("--how", choices=("pipelined", "additive"), default="pipelined",
                    help="how host and GPU time add up (toma_bench.gpuclock; default pipelined)")
    ap.add_argument("--sweep", action="store_true", help="also vary each assumption and print the speed-up range")
    ap.add_argument("--json", default=None, help="also write every number to this JSON file")
    ap.add_argument("--ranks", default=None,
                    help="comma list of GPU counts (e.g. 2,4,8): price each model under raylight's sequence "
                         "parallelism (USP, Ulysses attention) on that many GPUs instead, rank 0 recorded, its "
                         "collectives priced on --link; needs a mirror of komikndr/raylight (toma_bench/pack_source.py)")
    ap.add_argument("--link", default="nvlink",
                    help="comma list of the interconnects --ranks prices the same recordings on (default nvlink): "
                         + "; ".join(f"{k}: {v.source}" for k, v in LINKS.items()).replace("%", "%%"))
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in SPECS]
    if unknown or not args.models:
        ap.error(f"--models: unknown {unknown} (known: {', '.join(SPECS)})")
    try:
        args.profiles = [profile(h.strip()) for h in args.hardware.split(",") if h.strip()]
    except ValueError as e:
        ap.error(str(e))
    if not args.profiles:
        ap.error("--hardware names no profile")
    args.regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    if not args.regimes or any(r not in REGIMES for r in args.regimes):
        ap.error(f"--regimes: comma list of {', '.join(REGIMES)}, got {','.join(args.regimes) or 'none'}")
    args.variants = [v.strip() for v in args.variants.split(";") if v.strip()] if args.variants else None
    if args.steps is not None and not 1 <= args.steps <= 200:
        ap.error(f"--steps must be in [1, 200], got {args.steps}")
    if args.ranks is not None:
        try:
            args.ranks = sorted({int(r) for r in args.ranks.split(",") if r.strip()})
        except ValueError:
            args.ranks = []
        if not args.ranks or min(args.ranks) < 2 or max(args.ranks) > 64:
            ap.error("--ranks: a comma list of GPU counts from 2 to 64")
    args.link = [name.strip() for name in args.link.split(",") if name.strip()]
    if not args.link or any(name not in LINKS for name in args.link):
        ap.error(f"--link: comma list of {', '.join(LINKS)}")
    return args


def record_model(spec: Spec, pack, steps: int, variants=None, progress=print, wanted=None,
                 traced: bool = False) -> list[Recorded]:
    """The recordings of ``variants`` (default: variants_for the model, those ``wanted`` by select_variants);
    ``traced``: each variant the pack patched is recorded again in traced_form (Recorded.traced)."""
    out = []
    variants = variants or select_variants(variants_for(spec.name, pack), wanted)
    with model_classes(spec) as module, meta_sampling():
        base = build_meta(spec, getattr(module, spec.tree.unet_model) if spec.tree else None)
        for variant in variants:
            started = time.perf_counter()
            out.append(record_variant(base, spec, variant, pack, steps))
            if out[-1].pace_rule is not None and out[-1].label.startswith(DEFAULT_LABEL):
                out[-1].paced = record_variant(base, spec, variant, pack, steps, host_bound=True)
            if traced and out[-1].patched_by_pack:
                with traced_form(pack):
                    out[-1].traced = record_variant(base, spec, variant, pack, steps)
            progress(f"[costmodel] {spec.name}: {variant.label} recorded in {time.perf_counter() - started:.1f} s")
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    root = comfy_host.import_core("cpu", require_flux=False)
    pack = comfy_host.load_pack()
    report = {"hardware": [dataclasses.asdict(p) for p in args.profiles], "how": args.how,
              "regimes": args.regimes, "models": {}}
    print(run.header("python -m toma_bench.costmodel", argv, "priced, not run: ops recorded on the meta device",
                     f"{args.how}; ComfyUI tree {root.name}"))
    for hw in args.profiles:
        print(f"# profile {hw.name}: {hw.source or 'from a file'}; host {hw.host_us_per_kernel:g} us per kernel, "
              f"{hw.host_us_per_view:g} per view, {hw.host_us_per_graph:g} per graph; compiled code "
              f"{hw.host_us_per_compiled_kernel:g} per kernel, {hw.host_us_per_compiled_call:g} per graph entry")
    for regime in args.regimes:
        print(f"# regime {regime}: {REGIMES[regime].title}")
    if args.ranks:
        return main_ranks(args, pack, report)
    for name in args.models:
        spec = SPECS[name]
        reason = missing(spec)
        if reason:
            print(f"\n## {name}: skipped ({reason})")
            continue
        steps = args.steps or spec.steps
        try:
            recorded = record_model(spec, pack, steps, progress=lambda line: print(line, file=sys.stderr),
                                    wanted=args.variants, traced=any(REGIMES[r].traced for r in args.regimes))
        except ValueError as e:
            sys.exit(str(e))
        report["models"][name] = {"title": spec.title, "steps": steps, "profiles": {}}
        first = args.profiles[0]
        priced = {(hw.name, regime): price(recorded, hw, args.how, args.sweep and hw is first, regime)
                  for hw in args.profiles for regime in args.regimes}
        print(f"\n## {name}: {spec.title}, {steps} steps; {first.name}, {args.regimes[0]}\n")
        print(table(priced[first.name, args.regimes[0]]))
        if len(priced) > 1:
            print(f"\nspeed-up by profile and regime (unpatched ms/step in the head"
                  f"{'; the sweep range on ' + first.name if args.sweep else ''}):\n")
            print(profile_table({f"{hw} {regime}": rows for (hw, regime), rows in priced.items()}))
        budget = kernel_budget(recorded, first, args.how)
        if budget:
            print("\n" + budget_line(budget))
        report["models"][name]["kernel_budget"] = budget
        for (hw_name, regime), rows in priced.items():
            report["models"][name]["profiles"].setdefault(hw_name, {})[regime] = [dataclasses.asdict(r) for r in rows]
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def main_ranks(args, pack, report: dict) -> None:
    """--ranks: each model on one GPU and on each rank count under raylight's USP, priced on the first profile
    (eager) with its collectives on --link."""
    hw, links = args.profiles[0], [LINKS[name] for name in args.link]
    reason = pack_source.missing("raylight")
    if reason:
        sys.exit(f"--ranks: {reason}")
    for link in links:
        print(f"# link {link.name}: {link.source}")
    for name in args.models:
        spec = SPECS[name]
        reason = missing(spec)
        if reason or spec.tree is not None:
            print(f"\n## {name}: skipped ({reason or 'a model of another tree: raylight injects the host tree'})")
            continue
        steps = args.steps or spec.steps
        progress = lambda line: print(line, file=sys.stderr)
        by_world = {world: record_ranks(spec, pack, steps, world, progress) for world in [1] + args.ranks}
        for link in links:
            print(f"\n## {name}: {spec.title}, {steps} steps; {hw.name}, eager, {link.name}; rank 0 of each count\n")
            print(ranks_table(by_world, hw, link, args.how))
        report["models"][name] = {
            "title": spec.title, "steps": steps, "links": [dataclasses.asdict(link) for link in links],
            "ranks": {world: [{"label": r.recorded.label, "compute_ms": 1000 * per_step(r.recorded, hw, args.how)[1],
                               "comm_ms": {link.name: 1000 * r.comm_seconds(link) for link in links},
                               "block_bytes": r.block_bytes(), "merged": merged_text(r.recorded)[0]}
                              for r in recordings]
                      for world, recordings in by_world.items()}}
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
