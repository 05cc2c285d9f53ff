"""kijai's ComfyUI-WanVideoWrapper, its real code from a mirror, loaded into the test host and driven through its
own nodes: a tiny random ``WanModel`` built by its own classes, sampled by its ``WanVideoSampler``.

Where its code is: bare git mirrors of public repositories (``pack_source``: "wanvideowrapper" is kijai's code
to 2026-05-24, "wanvideowrapper-2026-02" kijai's code of 2026-02-01, "wanvideowrapper-2025-03" kijai's own
repository as mirrored, March 2025). ``load(name)`` writes a mirror's HEAD into a temporary
``custom_nodes/ComfyUI-WanVideoWrapper`` and has ComfyUI load it as it loads any custom node (once per process
and mirror); nothing of it is kept in this repository. Its test-only requirements are in
``tests/requirements-wanvideowrapper.txt`` (diffusers for its schedulers, accelerate for ``init_empty_weights``,
gguf, ftfy); the host must be current ComfyUI (the 2026 code needs ``comfy.ldm.modules.attention`` of 2025 on).

How the model is made, as its loader makes it (``WanVideoModelLoader``): the ``WanModel`` is built under
``init_empty_weights`` and the sampler loads the state dict (``model["sd"]``) into it at the start of every run.
Built eagerly a t2v ``WanModel`` of the 2026 code cannot run: ``WanAttentionBlock`` passes ``qk_norm`` into
``WanT2VCrossAttention``'s ``kv_dim`` slot, so its ``cross_attn.k/v`` are ``Linear(1, dim)`` until real weights
replace them; the random state dict here has them at ``(dim, dim)``, as checkpoints do.
"""
from __future__ import annotations

import asyncio
import copy
import inspect
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from . import pack_source

FOLDER_NAME = "ComfyUI-WanVideoWrapper"
# The pipeline keys the wrapper's loader sets on the model (patcher.model[...]) and its sampler reads
PIPELINE = {"base_dtype": torch.float32, "weight_dtype": torch.float32, "quantization": "disabled",
            "auto_cpu_offload": False, "control_lora": False, "compile_args": None, "gguf_reader": None,
            "fp8_matmul": False, "scale_weights": {}, "lora": None, "base_path": "tiny", "model_name": "tiny"}

_loaded: dict = {}  # mirror name -> Wrapper
_folders: list = []  # the temporary folders the loaded packages live in (kept for the process)


def missing(name: str = "wanvideowrapper") -> str | None:
    """Why the wrapper's code of mirror ``name`` cannot be loaded here, or None (no mirror, or a test-only
    requirement missing)."""
    reason = pack_source.missing(name)
    if reason:
        return reason
    for module in ("diffusers", "accelerate", "gguf", "ftfy"):
        try:
            __import__(module)
        except ImportError:
            return (f"kijai's ComfyUI-WanVideoWrapper needs {module}: pip install -r "
                    "tests/requirements-wanvideowrapper.txt")
    return None


def prompt_server_stand_in():
    """What the wrapper's ``latent_preview.py`` reads from ``server.PromptServer.instance`` at import, where no
    server runs (tests in-process): an object that takes its messages and drops them."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is not None:
        return
    stand_in = types.SimpleNamespace(send_sync=lambda *a, **k: None, send_progress_text=lambda *a, **k: None,
                                     client_id=None, last_node_id=None, last_prompt_id=None)
    if server is None:
        server = sys.modules["server"] = types.ModuleType("server")
    if not hasattr(server, "PromptServer"):
        server.PromptServer = types.SimpleNamespace()
    server.PromptServer.instance = stand_in


@dataclass
class Wrapper:
    """One loaded copy of the wrapper: its package name in sys.modules, its nodes, its commit."""

    name: str  # the mirror's name (pack_source.PACKS)
    commit: str
    package: str  # the module name ComfyUI registered it under
    nodes: dict  # NODE_CLASS_MAPPINGS

    def module(self, path: str):
        """The wrapper's module ``path`` ("wanvideo.modules.model", "nodes_sampler", ...)."""
        return sys.modules[f"{self.package}.{path}"]

    def node(self, name: str):
        return self.nodes[name]()


def load(name: str = "wanvideowrapper") -> Wrapper:
    """The wrapper's code at the HEAD of mirror ``name``, loaded by ComfyUI's ``nodes.load_custom_node``
    (ComfyUI must be imported: comfy_host.import_comfy). FileNotFoundError with the reason where it cannot
    be (``missing``)."""
    if name in _loaded:
        return _loaded[name]
    reason = missing(name)
    if reason:
        raise FileNotFoundError(reason)
    import nodes

    prompt_server_stand_in()
    folder = Path(tempfile.mkdtemp(prefix=f"{name}_")) / "custom_nodes" / FOLDER_NAME
    _folders.append(folder)
    pack_source.extract(name, folder)
    before = set(sys.modules)
    result = nodes.load_custom_node(str(folder))
    if inspect.isawaitable(result):
        result = asyncio.run(result)
    package = next((m for m in set(sys.modules) - before if m.endswith(FOLDER_NAME) or m == FOLDER_NAME), None)
    if not result or package is None:
        raise ImportError(f"ComfyUI could not load the WanVideoWrapper of {pack_source.PACKS[name][0]} (the log says why)")
    wrapper = Wrapper(name, pack_source.head(name), package, dict(sys.modules[package].NODE_CLASS_MAPPINGS))
    _loaded[name] = wrapper
    return wrapper


@dataclass(frozen=True)
class TinyConfig:
    """A WanModel small enough to sample on a CPU in a second: 16-channel latents, 4 heads of 16 channels."""

    dim: int = 64
    heads: int = 4
    layers: int = 4
    ffn_dim: int = 128
    text_dim: int = 32
    text_len: int = 16  # the prompt's tokens, padded
    attention_mode: str = "sdpa"
    seed: int = 0


def random_state_dict(transformer, config: TinyConfig) -> dict:
    """Seeded random weights for every parameter of ``transformer`` (built on meta), at the shapes a
    checkpoint has (``cross_attn.k/v``: (dim, dim), whatever the meta module says)."""
    generator = torch.Generator().manual_seed(config.seed)
    sd = {}
    for key, param in transformer.named_parameters():
        shape = tuple(param.shape)
        if ".cross_attn.k." in key or ".cross_attn.v." in key:
            shape = (config.dim, config.dim) if key.endswith("weight") else (config.dim,)
        if "norm" in key and key.endswith("weight"):
            sd[key] = 1 + 0.1 * torch.randn(shape, generator=generator)
        else:
            fan_in = shape[1] if len(shape) > 1 else 1
            for extra in shape[2:]:
                fan_in *= extra
            sd[key] = torch.randn(shape, generator=generator) / max(fan_in, 1) ** 0.5
    return sd


def tiny_model(wrapper: Wrapper, config: TinyConfig = TinyConfig()):
    """A WANVIDEOMODEL as the wrapper's loader returns it: a ModelPatcher of its ``WanVideoModel`` around a
    tiny t2v ``WanModel`` built under ``init_empty_weights``. The 2026 code: the random state dict in
    ``model["sd"]`` for the sampler to load, and the loader's ``transformer_options``; the March-2025 code
    (a ``WanVideoModel`` that is a ComfyUI BaseModel, no ``nodes_model_loading``): the weights assigned at
    once, as its loader does."""
    import comfy.model_base
    import comfy.model_patcher
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    march_2025 = f"{wrapper.package}.nodes_model_loading" not in sys.modules
    loading = wrapper.module("nodes" if march_2025 else "nodes_model_loading")
    WanModel = wrapper.module("wanvideo.modules.model").WanModel
    cpu = torch.device("cpu")
    wanted = dict(model_type="t2v", patch_size=(1, 2, 2), text_len=config.text_len, in_dim=16, dim=config.dim,
                  in_features=config.dim, out_features=config.dim, ffn_dim=config.ffn_dim, ffn2_dim=config.ffn_dim,
                  freq_dim=32, text_dim=config.text_dim, out_dim=16, num_heads=config.heads,
                  num_layers=config.layers, eps=1e-6, attention_mode=config.attention_mode, rope_func="comfy",
                  main_device=cpu, offload_device=cpu, dtype=torch.float32)
    accepted = inspect.signature(WanModel.__init__).parameters
    with init_empty_weights():
        transformer = WanModel(**{k: v for k, v in wanted.items() if k in accepted}).eval()
    sd = random_state_dict(transformer, config)
    if march_2025:
        for key, value in sd.items():
            set_module_tensor_to_device(transformer, key, device=cpu, dtype=torch.float32, value=value)
        model = loading.WanVideoModel(loading.WanVideoModelConfig(torch.float32),
                                      model_type=comfy.model_base.ModelType.FLOW, device=cpu)
        model.diffusion_model = transformer
    else:
        model = loading.WanVideoModel(loading.WanVideoModelConfig(), transformer=transformer, device=cpu)
    patcher = comfy.model_patcher.ModelPatcher(model, cpu, cpu)
    if march_2025:
        # its attention runs in bfloat16 and its sampler autocasts to model["dtype"] (float32 has no CPU autocast)
        for key, value in dict(dtype=torch.bfloat16, base_path="tiny", model_name="tiny", manual_offloading=False,
                               quantization="disabled", block_swap_args=None, auto_cpu_offload=False).items():
            patcher.model[key] = value
        return patcher
    patcher.model.is_patched = False
    for key, value in PIPELINE.items():
        patcher.model[key] = copy.copy(value)
    patcher.model["sd"] = sd
    patcher.model_options.setdefault("transformer_options", {})
    patcher.model_options["transformer_options"].update(block_swap_args=None, merge_loras=True)
    return patcher


def text_embeds(config: TinyConfig = TinyConfig(), tokens: int = 8, seed: int = 1) -> dict:
    """WANVIDEOTEXTEMBEDS for the tiny model: seeded random prompt and negative prompt embeddings."""
    generator = torch.Generator().manual_seed(seed)
    return {"prompt_embeds": [torch.randn(tokens, config.text_dim, generator=generator)],
            "negative_prompt_embeds": [torch.randn(tokens, config.text_dim, generator=generator)],
            "echoshot": False}


def empty_embeds(wrapper: Wrapper, frames: int = 9, width: int = 64, height: int = 64) -> dict:
    """WANVIDIMAGE_EMBEDS of an empty t2v video from the wrapper's own WanVideoEmptyEmbeds: 9 frames of 64x64
    pixels are a 16x3x8x8 latent, 3x4x4 tokens."""
    node = wrapper.node("WanVideoEmptyEmbeds")
    return getattr(node, node.FUNCTION)(num_frames=frames, width=width, height=height)[0]


def sample(wrapper: Wrapper, model, steps: int = 3, cfg: float = 5.0, seed: int = 0, image_embeds=None, text=None,
           **options) -> torch.Tensor:
    """The wrapper's ``WanVideoSampler.process`` on ``model``: the denoised latent (C, T, H, W). ``options``:
    the sampler's optional inputs (cache_args, batched_cfg, context_options, ...)."""
    node = wrapper.node("WanVideoSampler")
    inputs = dict(model=model, image_embeds=image_embeds if image_embeds is not None else empty_embeds(wrapper),
                  shift=5.0, steps=steps, cfg=cfg, seed=seed, scheduler="unipc", riflex_freq_index=0,
                  text_embeds=text if text is not None else text_embeds(), force_offload=False)
    inputs.update(options)
    accepted = inspect.signature(node.process).parameters
    out = node.process(**{k: v for k, v in inputs.items() if k in accepted})
    return out[0]["samples"].squeeze(0) if out[0]["samples"].dim() == 5 else out[0]["samples"]
