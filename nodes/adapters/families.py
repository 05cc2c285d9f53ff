"""The DiT families ToMA serves, one declaration each (``family.DiTFamily``; the generic supports/patch
are there, and docs/architecture.md, "DiT adapters", says how blocks merge). What a family needs beyond data (another
token layout, other per-token inputs) is a DiTPatch or LayoutStash subclass in its own module.

Skipped fractions: the paper merges Flux double blocks 5-18 of 19 and single blocks 5-37 of 38; other
depths skip the same fraction of each group (layout.SKIP_FRACTION, by the group's role). A group of whole
layers over one sequence (LTX-Video, Wan, NextDiT's layers) skips as Flux's single blocks do.
"""
from .. import placement
from . import hidream, hunyuan_video, krea2, ltxv, lumina, minimax, qwen_image, qwen_image21, wan
from .family import OBJECT_PATCH, BlockGroup, DiTFamily
from .layout import JOINT, TWO_STREAM, VIDEO

# Flux's layout: double blocks (image and text streams apart), then single blocks (one joint sequence)
FLUX_GROUPS = (BlockGroup("double_blocks", "double_block", TWO_STREAM, "double_block"),
               BlockGroup("single_blocks", "single_block", JOINT, "single_block"))
# Every DiT whose attention calls go through ComfyUI's attention functions (all but SD3's MMDiT) offers
# "block" and "keys/values": every merged block runs whole, only the keys and values of its self-attention
# come from merged tokens (attention_override.MergedKeysValues). Flux-layout double blocks offer "attention" too (the
# paper's: the double-block MLP at full resolution, only the joint attention on merged tokens). Merging the
# MLP holds most of the speed-up at 1024 px; keys/values saves attention FLOPs alone, which pays on long
# sequences (video, 2048 px); docs/benchmarks.md weighs them against fidelity.
WITH_KEYS_VALUES = (placement.BLOCK, placement.KEYS_VALUES)
BOTH = (placement.ATTENTION, placement.BLOCK, placement.KEYS_VALUES)

# Flux (dev, schnell, Kontext, Fill) and Flux.2 (the same class). The DIFFUSION_MODEL executor runs around
# ``_forward``, which sees the latent and the Kontext/Flux.2 reference latents (their tokens follow the
# image's and stay whole); a Flux without it is read at BaseModel._apply_model (the same latent).
FLUX = DiTFamily("Flux", ("Flux", "Flux.2"), False, "comfy.ldm.flux.model:Flux", FLUX_GROUPS,
                 wrappers=("DIFFUSION_MODEL", "APPLY_MODEL"), placements=BOTH,
                 never_merged="text, reference images")

# SD3/SD3.5 (MMDiT): the joint blocks merge as Flux's double blocks do; the position embedding is added
# once at the input, so nothing positional reaches the blocks. No DIFFUSION_MODEL executor: the latent is
# read at BaseModel._apply_model (same latent size). Its attention takes no transformer_options, so no
# attention override reaches it: whole blocks only (keys/values falls back to them, logged).
SD3 = DiTFamily("SD3/SD3.5", ("SD3",), False, "comfy.ldm.modules.diffusionmodules.mmdit:MMDiT",
                (BlockGroup("joint_blocks", "double_block", TWO_STREAM, "double_block"),),
                wrappers=("APPLY_MODEL",))

HUNYUAN_VIDEO = DiTFamily("HunyuanVideo", ("HunyuanVideo", "HunyuanVideo 1.5"), True,
                          "comfy.ldm.hunyuan_video.model:HunyuanVideo", FLUX_GROUPS, hunyuan_video.HunyuanVideoPatch,
                          hunyuan_video.HunyuanLayoutStash, placements=BOTH,
                          never_merged="text, SigLIP tokens, reference latents, the image-to-video first frame")

LTXV = DiTFamily("LTX-Video", ("LTX-Video",), True, "comfy.ldm.lightricks.model:LTXVModel",
                 (BlockGroup("transformer_blocks", "double_block", VIDEO, "block"),),
                 ltxv.LTXVPatch, ltxv.LTXVLayoutStash, patch_size="patchifier.patch_size",
                 placements=WITH_KEYS_VALUES, never_merged="text, keyframe guides, the image-to-video first frame",
                 read_outside=True)

# LTX-2 (audio-video; an LTXVModel subclass, so its row comes before LTX-Video's): the video merges as
# LTX-Video's; each merged block's video-to-audio attention is object-patched to see the full video.
LTX2 = DiTFamily("LTX-2", ("LTX-2",), True, "comfy.ldm.lightricks.av_model:LTXAVModel",
                 (BlockGroup("transformer_blocks", "double_block", VIDEO, "av_block"),),
                 ltxv.LTX2Patch, ltxv.LTX2LayoutStash, patch_size="patchifier.patch_size",
                 placements=WITH_KEYS_VALUES, never_merged="audio, text, keyframe guides, the image-to-video first frame")

WAN = DiTFamily("Wan 2.1/2.2", ("Wan",), True, "comfy.ldm.wan.model:WanModel",
                (BlockGroup("blocks", "double_block", VIDEO, "block"),), wan.WanPatch,
                wan.VideoLayoutStash, placements=WITH_KEYS_VALUES + (placement.FEED_FORWARD,),
                never_merged="text, CLIP image tokens, reference and subject frames, the TI2V first frame",
                unserved=wan.unserved, feed_forward=("cross_attn", "ffn"))

# MiniMax-H3 (video+audio, batch 1): one packed sequence [text, keyframe/reference rows, audio, video] per call,
# read from its PackedLayout at BaseModel._apply_model; the video rows merge, every row before them stays whole.
MINIMAX_H3 = DiTFamily("MiniMax-H3", ("MiniMax-H3",), True, "comfy.ldm.minimax.model:MiniMaxH3Model",
                       (BlockGroup("blocks", "double_block", VIDEO, "packed_block"),), minimax.PackedPatch,
                       minimax.PackedLayoutStash, wrappers=("APPLY_MODEL",), placements=WITH_KEYS_VALUES,
                       never_merged="text, audio, keyframe and reference rows", sparse_takes_blocks=True)

QWEN_IMAGE = DiTFamily("Qwen-Image", ("Qwen-Image",), False, "comfy.ldm.qwen_image.model:QwenImageTransformer2DModel",
                       (BlockGroup("transformer_blocks", "double_block", TWO_STREAM, "double_block"),),
                       qwen_image.QwenImagePatch, placements=WITH_KEYS_VALUES,
                       never_merged="text (Edit references merge by plans of their own)")

# Qwen-Image 2.1 (ComfyUI v0.37.0 on): one sequence [prefix, target] per block, the prefix (text with the reference
# images spliced in) causal and cached by the model across steps; the target merges, the prefix and its cached keys
# and values stay whole. Each block's forward is object-patched: a "dit" replace patch would switch the cache off.
QWEN_IMAGE21 = DiTFamily("Qwen-Image 2.1", ("Qwen-Image 2.1",), False,
                         "comfy.ldm.qwen_image21.model:QwenImage21Transformer2DModel",
                         (BlockGroup("transformer_blocks", "single_block", JOINT, "block_forward"),),
                         qwen_image21.QwenImage21Patch, qwen_image21.QwenImage21LayoutStash,
                         patch_size=qwen_image21.PATCH_SIZE, intercept=OBJECT_PATCH, placements=WITH_KEYS_VALUES,
                         never_merged="text, reference images (the prefix, whose keys and values the model caches)",
                         unserved=qwen_image21.unserved)

# Chroma and Chroma Radiance: Flux's blocks, merged as Flux's are. Each block's modulation comes from the
# distilled-guidance approximator as per-sample (B, 1, C) slices, not per token, so it passes unchanged; an
# attn_mask (T5 padding, regional prompts) is cut to the merged rows. Radiance patchifies pixels 16x16.
CHROMA = DiTFamily("Chroma", ("Chroma",), False, "comfy.ldm.chroma.model:Chroma", FLUX_GROUPS, placements=BOTH)

# Lumina 2 and Z-Image (NextDiT): no "dit" hook, each main layer's forward object-patched; the context and
# noise refiners (text only, image only) never merge.
LUMINA = DiTFamily("Lumina 2 / Z-Image", ("Z-Image", "Lumina 2"), False, "comfy.ldm.lumina.model:NextDiT",
                   (BlockGroup("layers", "layer", JOINT, "layer_forward"),), lumina.NextDiTPatch,
                   lumina.NextDiTLayoutStash, intercept=OBJECT_PATCH, placements=WITH_KEYS_VALUES,
                   never_merged="text, Z-Image's padding tokens", unserved=lumina.unserved, read_outside=True)

# HiDream-I1: no "dit" hook either; its double-stream and single-stream blocks' forwards object-patched.
HIDREAM = DiTFamily("HiDream", ("HiDream",), False, "comfy.ldm.hidream.model:HiDreamImageTransformer2DModel",
                    (BlockGroup("double_stream_blocks", "double_stream_block", TWO_STREAM, "double_forward"),
                     BlockGroup("single_stream_blocks", "single_stream_block", JOINT, "single_forward")),
                    hidream.HiDreamPatch, hidream.HiDreamLayoutStash, intercept=OBJECT_PATCH,
                    placements=WITH_KEYS_VALUES, never_merged="text and Llama layer tokens", unserved=hidream.unserved,
                    read_outside=True)

# Krea 2 (ComfyUI v0.33.0 on): one joint sequence [text, image, references] per block, blocks called directly, so
# each block's forward is object-patched; the image merges, text and style references stay whole.
KREA2 = DiTFamily("Krea 2", ("Krea 2",), False, "comfy.ldm.krea2.model:SingleStreamDiT",
                  (BlockGroup("blocks", "block", JOINT, "block_forward"),), krea2.Krea2Patch, krea2.Krea2LayoutStash,
                  patch_size="patch", intercept=OBJECT_PATCH, placements=WITH_KEYS_VALUES,
                  never_merged="text, reference images", unserved=krea2.unserved)

DIT_FAMILIES = (FLUX, SD3, HUNYUAN_VIDEO, LTX2, LTXV, WAN, MINIMAX_H3, QWEN_IMAGE, QWEN_IMAGE21, CHROMA, LUMINA, HIDREAM,
                KREA2)
