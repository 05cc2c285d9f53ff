"""Qwen-Image 2.1's model file as it first was: Comfy-Org/ComfyUI comfy/ldm/qwen_image21/model.py at
b806797696c10b92c8db8687b8842acf34db8d97, our code written after that structure (toma_bench.qwen_image21 says what
was read and how the stand-in meets ComfyUI; toma_bench.qwen_image21_later follows the later versions on top of
this one). Import it once ComfyUI is importable (comfy_host.import_comfy).
"""
import comfy.ldm.modules.attention as host_attention
import comfy.model_management
import comfy.ops
import comfy.patcher_extension
import comfy.quant_ops
import comfy.rmsnorm
import comfy.utils
import torch
import torch.nn as nn
import torch.nn.functional as F
from comfy.ldm.flux.layers import EmbedND, timestep_embedding
from comfy.ldm.flux.math import apply_rope1
from comfy.ldm.lightricks.model import TimestepEmbedding

FOLLOWS = "b806797696c10b92c8db8687b8842acf34db8d97"  # the commit of comfy/ldm/qwen_image21/model.py followed


class PreferredAttention(nn.Module):
    """The later trees' ``ComfyAttention``: a block's attention preference (a checkpoint may name a backend in a
    ``config`` entry); ``function`` None means ComfyUI's own."""

    def __init__(self):
        super().__init__()
        self.config = None
        self.function = None


# read from the module's namespace: a tree older than v0.37 has no such class (the stand-in takes its place)
ComfyAttention = vars(host_attention).get("ComfyAttention", PreferredAttention)
# whether the host's attention functions take preferred_attention themselves (a tree with ComfyAttention does)
HOST_PREFERS = hasattr(host_attention, "ComfyAttention")


def attention(q, k, v, heads, mask=None, transformer_options={}, preferred_attention=None):
    """ComfyUI's ``optimized_attention`` as the later trees call it: an ``optimized_attention_override`` in
    ``transformer_options`` first, else the preferred function, else ComfyUI's."""
    if HOST_PREFERS:
        return host_attention.optimized_attention(q, k, v, heads, mask=mask, transformer_options=transformer_options,
                                                  preferred_attention=preferred_attention)
    preferred = getattr(preferred_attention, "function", None)
    if preferred is not None and "optimized_attention_override" not in transformer_options:
        return preferred(q, k, v, heads, mask=mask, transformer_options=transformer_options)
    return host_attention.optimized_attention(q, k, v, heads, mask=mask, transformer_options=transformer_options)


# -- the model ------------------------------------------------------------------------------------------------------

class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose stored weight is the scale minus 1, computed in fp32."""

    def __init__(self, dim, eps=1e-6, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x):
        scale = comfy.model_management.cast_to(self.weight, dtype=torch.float32, device=x.device) + 1.0
        return comfy.rmsnorm.rms_norm(x.float(), scale, self.eps).to(x.dtype)


class TextProjection(nn.Module):
    def __init__(self, in_dim, hidden_size, eps=1e-6, dtype=None, device=None, operations=None):
        super().__init__()
        self.text_norm = ZeroCenteredRMSNorm(in_dim, eps=eps, dtype=dtype, device=device)
        self.in_layer = operations.Linear(in_dim, hidden_size, bias=False, dtype=dtype, device=device)
        self.out_layer = operations.Linear(hidden_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        return self.out_layer(F.gelu(self.in_layer(self.text_norm(x)), approximate="tanh"))


class TimestepProjEmbeddings(nn.Module):
    def __init__(self, embedding_dim, dtype=None, device=None, operations=None):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(in_channels=256, time_embed_dim=embedding_dim, sample_proj_bias=False,
                                                   dtype=dtype, device=device, operations=operations)

    def forward(self, timestep, dtype):
        return self.timestep_embedder(timestep_embedding(timestep.float(), 256).to(dtype))


class SwiGLUFeedForward(nn.Module):
    """silu(gate) * up, then down; ``fused``: gate and up in one projection [gate; up]."""

    def __init__(self, dim, hidden_dim, fused=True, dtype=None, device=None, operations=None):
        super().__init__()
        self.fused = fused
        if fused:
            self.gate_up = operations.Linear(dim, 2 * hidden_dim, bias=False, dtype=dtype, device=device)
        else:
            self.proj = operations.Linear(dim, hidden_dim, bias=False, dtype=dtype, device=device)
            self.gate_layer = operations.Linear(dim, hidden_dim, bias=False, dtype=dtype, device=device)
        self.out = operations.Linear(hidden_dim, dim, bias=False, dtype=dtype, device=device)

    def forward(self, x):
        if self.fused:
            return comfy.ops.linear_input_act(self.out, self.gate_up(x), "swiglu")
        return self.out(F.silu(self.gate_layer(x)) * self.proj(x))


class Attention(nn.Module):
    def __init__(self, dim, heads, dim_head, eps=1e-6, dtype=None, device=None, operations=None):
        super().__init__()
        self.comfy_attention = ComfyAttention()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = operations.Linear(dim, inner, bias=False, dtype=dtype, device=device)
        self.to_k = operations.Linear(dim, inner, bias=False, dtype=dtype, device=device)
        self.to_v = operations.Linear(dim, inner, bias=False, dtype=dtype, device=device)
        self.to_out = nn.ModuleList([operations.Linear(inner, dim, bias=False, dtype=dtype, device=device)])
        self.norm_q = operations.RMSNorm(dim_head, eps=eps, dtype=dtype, device=device)
        self.norm_k = operations.RMSNorm(dim_head, eps=eps, dtype=dtype, device=device)

    def forward(self, x, pe, attn_fn, prefix_len, transformer_options={}):
        # q, k, v stay (B, N, H, D); pe is (1, N, 1, D/2, 2, 2) to match
        B, N, _ = x.shape
        q, k, v = (proj(x).view(B, N, self.heads, -1) for proj in (self.to_q, self.to_k, self.to_v))
        patches = transformer_options.get("patches", {}).get("attn1_patch", [])
        if comfy.model_management.in_training or patches:
            q, k = self.norm_q(q), self.norm_k(k)
            if patches:
                # what patches see: Qwen-Image's layout, (B, H, N, D) before RoPE, the target rows in img_slice
                q, k, v, pe = (t.transpose(1, 2) for t in (q, k, v, pe))
                extra_options = {**transformer_options, "img_slice": [prefix_len, N]}
                for patch in patches:
                    out = patch(q, k, v, pe=pe, attn_mask=None, extra_options=extra_options)
                    q, k, v, pe = out.get("q", q), out.get("k", k), out.get("v", v), out.get("pe", pe)
                q, k, v, pe = (t.transpose(1, 2).contiguous() for t in (q, k, v, pe))
            q, k = apply_rope1(q, pe), apply_rope1(k, pe)
        else:
            q_scale, _, q_stream = comfy.ops.cast_bias_weight(self.norm_q, q, offloadable=True)
            k_scale, _, k_stream = comfy.ops.cast_bias_weight(self.norm_k, k, offloadable=True)
            q, k = comfy.quant_ops.ck.rms_rope(q, k, pe, q_scale, k_scale, self.norm_q.eps)
            comfy.ops.uncast_bias_weight(self.norm_q, q_scale, None, q_stream)
            comfy.ops.uncast_bias_weight(self.norm_k, k_scale, None, k_stream)
        return self.to_out[0](attn_fn(q, k, v, self.heads, preferred_attention=self.comfy_attention))


def _split_rows(p):
    """One modulation tensor (B + 1, C) -> (the t = 0 row for the prefix (1, 1, C), the target's rows (B, 1, C))."""
    return p[-1:].unsqueeze(1), p[:-1].unsqueeze(1)


def _modulated_norm(norm, x, scale, prefix_len, zero):
    """LayerNorm(x) * (1 + scale): every row with the target's scale, then the prefix rows again with theirs."""
    prefix_scale, target_scale = scale
    if comfy.model_management.in_training:
        out = norm(x)
        return torch.cat([out[:, :prefix_len] * (1 + prefix_scale), out[:, prefix_len:] * (1 + target_scale)], dim=1)
    out = comfy.quant_ops.ck.adaln(x, target_scale, zero, norm.eps)
    if prefix_len:
        out[:, :prefix_len] = comfy.quant_ops.ck.adaln(x[:, :prefix_len], prefix_scale, zero, norm.eps)
    return out


def _gated_residual(x, y, gate, prefix_len):
    prefix_gate, target_gate = gate
    out = torch.addcmul(x, y, target_gate)
    if prefix_len:
        out[:, :prefix_len] = torch.addcmul(x[:, :prefix_len], y[:, :prefix_len], prefix_gate)
    return out


class QwenImage21TransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim, mlp_ratio=3, eps=1e-6, fused_mlp=True,
                 dtype=None, device=None, operations=None):
        super().__init__()
        self.img_norm1 = operations.LayerNorm(dim, elementwise_affine=False, eps=eps, dtype=dtype, device=device)
        self.attn = Attention(dim, num_attention_heads, attention_head_dim, eps=eps, dtype=dtype, device=device,
                              operations=operations)
        self.img_norm2 = operations.LayerNorm(dim, elementwise_affine=False, eps=eps, dtype=dtype, device=device)
        self.img_mlp = SwiGLUFeedForward(dim, dim * mlp_ratio, fused=fused_mlp, dtype=dtype, device=device,
                                         operations=operations)

    def forward(self, x, mod, pe, attn_fn, prefix_len, transformer_options={}):
        scale1, gate1, scale2, gate2, zero = mod
        attended = self.attn(_modulated_norm(self.img_norm1, x, scale1, prefix_len, zero), pe, attn_fn, prefix_len,
                             transformer_options)
        x = _gated_residual(x, attended, gate1, prefix_len)
        x = _gated_residual(x, self.img_mlp(_modulated_norm(self.img_norm2, x, scale2, prefix_len, zero)), gate2,
                            prefix_len)
        if x.dtype == torch.float16:
            x = x.clip(-65504, 65504)
        return x


class LastLayer(nn.Module):
    """LayerNorm scaled by the timestep (no shift)."""

    def __init__(self, dim, eps=1e-6, dtype=None, device=None, operations=None):
        super().__init__()
        self.linear = operations.Linear(dim, dim, bias=False, dtype=dtype, device=device)
        self.norm = operations.LayerNorm(dim, eps, elementwise_affine=False, dtype=dtype, device=device)

    def forward(self, x, temb):
        scale = self.linear(F.silu(temb)).unsqueeze(1)
        if comfy.model_management.in_training:
            return self.norm(x) * (1 + scale)
        return comfy.quant_ops.ck.adaln(x, scale, torch.zeros_like(scale[:1]), self.norm.eps)


def block_causal_attention(segments, transformer_options={}, cache=None, block_index=0, prefix_len=0):
    """A block's attention over its whole sequence: ``segments`` [(start, end, mask)] of queries, each attending to
    the keys before its end (a text segment with its causal ``mask``); with ``cache``, the prefix's keys and values
    (the first ``prefix_len`` rows) are stored for block ``block_index``, k and v stacked on dim 1."""
    def attn(q, k, v, heads, preferred_attention=None):
        if cache is not None:
            cache.put(block_index, torch.stack([k[:, :prefix_len], v[:, :prefix_len]], dim=1))
        outs = [attention(q[:, start:end].flatten(2), k[:, :end].flatten(2), v[:, :end].flatten(2), heads, mask=mask,
                          transformer_options=transformer_options, preferred_attention=preferred_attention)
                for start, end, mask in segments]
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return attn


def prefix_cached_attention(prefix_k, prefix_v, transformer_options={}):
    """A cached step's attention: the target's queries over [the cached prefix, the target] (block-causal attention
    of the last segment, the only one left)."""
    def attn(q, k, v, heads, preferred_attention=None):
        return attention(q.flatten(2), torch.cat([prefix_k, k], dim=1).flatten(2),
                         torch.cat([prefix_v, v], dim=1).flatten(2), heads, transformer_options=transformer_options,
                         preferred_attention=preferred_attention)
    return attn


def prefix_cache_key(x, context, refs, slots):
    """What the prefix depends on, one fp32 row per batch row: the lengths, the target's size (the references'
    RoPE ids are centred on it), the slots, the reference sizes, then the prompt and the reference latents."""
    header = [context.shape[1], len(refs), *x.shape[-2:], *slots, *(s for r in refs for s in r.shape[-2:])]
    header = torch.tensor(header, dtype=torch.float32, device=context.device).expand(context.shape[0], -1)
    return torch.cat([header, context.float().flatten(1)] + [r.float().flatten(1) for r in refs], dim=1)


class PrefixCache:
    """The prefix's keys and values per block for one sampling run, a slot per cache key (cond and uncond, prompts
    of a batch list), least recently used slots freed when the store device runs low (the later trees'
    ``PoseBranchCache`` interface: select, filled, put, prefetch, take, free)."""

    def __init__(self, store_device=None, dtype="default"):
        self.store_device = torch.device(store_device) if store_device is not None else torch.device("cpu")
        self.dtype = dtype
        self.slots = []  # most recently used last
        self.slot = None

    def select(self, key, create=True):
        """Select the slot of ``key``: True where it exists; else a new one (``create``) or none."""
        for i, slot in enumerate(self.slots):
            if slot["key"].shape == key.shape and torch.equal(slot["key"], key.to(slot["key"].device)):
                self.slots.append(self.slots.pop(i))
                self.slot = slot
                return True
        self.slot = None
        if not create:
            return False
        estimate = max((self._bytes(s) for s in self.slots), default=0) * 1.5
        while self.slots and comfy.model_management.get_free_memory(self.store_device) < estimate:
            self.slots.pop(0)
        self.slot = {"key": key.clone().to(self.store_device), "blocks": {}}
        self.slots.append(self.slot)
        return False

    def free(self):
        self.slots, self.slot = [], None

    def filled(self, num_blocks):
        return self.slot is not None and len(self.slot["blocks"]) == num_blocks

    def put(self, i, kv):
        self.slot["blocks"][i] = kv.to(self.store_device, copy=True)

    def prefetch(self, i, device, dtype):
        """Nothing to queue ahead here (the real cache copies block i's entry on a side stream)."""

    def take(self, i, device, dtype, batch_size):
        return comfy.utils.repeat_to_batch_size(self.slot["blocks"][i].to(device=device, dtype=dtype), batch_size)

    @staticmethod
    def _bytes(slot):
        return sum(t.numel() * t.element_size() for t in slot["blocks"].values())


class QwenImage21Transformer2DModel(nn.Module):
    block_class = QwenImage21TransformerBlock  # what later versions change (qwen_image21_later)
    def __init__(self, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128, num_attention_heads=32,
                 context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6, fused_mlp=True,
                 image_model=None, dtype=None, device=None, operations=None):
        super().__init__()
        self.dtype = dtype
        self.out_channels = out_channels
        self.inner_dim = num_attention_heads * attention_head_dim
        self.pe_embedder = EmbedND(dim=attention_head_dim, theta=10000, axes_dim=list(axes_dims_rope))
        self.time_text_embed = TimestepProjEmbeddings(self.inner_dim, dtype=dtype, device=device, operations=operations)
        self.txt_in = TextProjection(context_in_dim, self.inner_dim, eps=eps, dtype=dtype, device=device,
                                     operations=operations)
        self.img_in = operations.Linear(in_channels, self.inner_dim, bias=False, dtype=dtype, device=device)
        # one modulation for every block: scale and gate of the attention, then of the MLP
        self.modulation = nn.Sequential(nn.SiLU(), operations.Linear(self.inner_dim, 4 * self.inner_dim, bias=False,
                                                                     dtype=dtype, device=device))
        self.transformer_blocks = nn.ModuleList([
            self.block_class(self.inner_dim, num_attention_heads, attention_head_dim, mlp_ratio=mlp_ratio,
                                        eps=eps, fused_mlp=fused_mlp, dtype=dtype, device=device, operations=operations)
            for _ in range(num_layers)])
        self.norm_out = LastLayer(self.inner_dim, eps=eps, dtype=dtype, device=device, operations=operations)
        self.proj_out = operations.Linear(self.inner_dim, out_channels, bias=False, dtype=dtype, device=device)
        # the prefix's keys and values do not depend on the step (t = 0 modulation, causal prefix): cached for a run
        self.prefix_cache = None
        self.prefix_cache_enabled = False

    def reset_prefix_cache(self, enabled):
        if self.prefix_cache is not None:
            self.prefix_cache.free()
        self.prefix_cache = None
        self.prefix_cache_enabled = enabled

    def select_prefix_cache(self, key, cache_bytes, device, options):
        """(the cache with ``key``'s slot selected, whether that slot is filled), or (None, False): compute the
        prefix this step ("off", or no room)."""
        if options.get("device") == "off":
            return None, False
        cache = self.prefix_cache
        if cache is not None and cache.select(key, create=False):
            return cache, cache.filled(len(self.transformer_blocks))
        dtype = options.get("dtype", "default")
        cache_bytes //= {"int8": 2, "int4": 4}.get(dtype, 1)
        if cache is None:
            store = options.get("device", "auto")
            if store == "auto":  # spare device memory first, then host memory; room for cond and uncond
                store = next((d for d in (device, torch.device("cpu"))
                              if comfy.model_management.get_free_memory(d) > 4 * cache_bytes), None)
                if store is None:
                    return None, False
            else:
                store = device if store == "gpu" else torch.device("cpu")
            cache = self.prefix_cache = PrefixCache(store_device=store, dtype=dtype)
        if comfy.model_management.get_free_memory(cache.store_device) < 2 * cache_bytes:
            return None, False  # recompute rather than evict the other cond's slot every step
        cache.select(key)
        return cache, False

    def build_sequence(self, x, context, ref_latents, image_slots):
        """(tokens [text with each reference spliced in at its slot, target], RoPE table (1, N, 1, ...), segments)."""
        txt = self.txt_in(context)
        slots = (image_slots + [txt.shape[1]] * len(ref_latents))[:len(ref_latents)]
        bounds = [0] + slots + [txt.shape[1]]
        parts, ids, segments = [], [], []
        position, length = 0, 0
        for (start, end), img in zip(zip(bounds[:-1], bounds[1:]), ref_latents + [x]):
            n = end - start
            if n > 0:  # text before this image: causal within itself
                parts.append(txt[:, start:end])
                ids.append(torch.arange(position, position + n, device=x.device, dtype=torch.float32)
                           .unsqueeze(1).expand(n, 3))
                segments.append((length, length + n,
                                 torch.ones((n, length + n), dtype=torch.bool, device=x.device).tril(length)))
                position += n
                length += n
            h, w = img.shape[-2:]
            parts.append(self.img_in(img.flatten(2).transpose(1, 2)))
            # a grid of the other parity than the target's sits half a token off, centred on the target
            hh = torch.arange(h, device=x.device, dtype=torch.float32) - (h - h // 2) + 0.5 * (h % 2 - x.shape[-2] % 2)
            ww = torch.arange(w, device=x.device, dtype=torch.float32) - (w - w // 2) + 0.5 * (w % 2 - x.shape[-1] % 2)
            ids.append(torch.stack([torch.full((h, w), position, device=x.device, dtype=torch.float32),
                                    hh[:, None].expand(h, w), ww[None, :].expand(h, w)], dim=-1).flatten(0, 1))
            segments.append((length, length + h * w, None))
            position += max(h, w)
            length += h * w
        pe = self.pe_embedder(torch.cat(ids, dim=0).unsqueeze(0)).transpose(1, 2).contiguous()
        return torch.cat(parts, dim=1), pe, segments

    def forward(self, x, timestep, context, ref_latents=None, image_slots=None, transformer_options={}, **kwargs):
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self,
            comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                                                     transformer_options)
        ).execute(x, timestep, context, ref_latents, image_slots, transformer_options, **kwargs)

    def _start(self, x, timesteps, context, ref_latents, image_slots, transformer_options):
        """What every version's forward does before its blocks: the sequence (target rows last) with its RoPE rows
        and segments, post_input patches applied, the modulation, the dit block replacements and the prefix cache
        chosen (a cached step keeps the target rows only). (hidden_states, pe, segments, prefix_len, temb, mod,
        patches, blocks_replace, cache, cached)."""
        B, _, H, W = x.shape
        dtype = x.dtype
        hidden_states, pe, segments = self.build_sequence(x, context, ref_latents, image_slots)
        prefix_len = hidden_states.shape[1] - H * W
        patches = transformer_options.get("patches", {})
        for p in patches.get("post_input", []):
            out = p({"img": hidden_states, "pe": pe, "transformer_options": transformer_options})
            hidden_states, pe = out["img"], out.get("pe", pe)

        # the pipeline rounds t to the compute dtype; the prefix rows modulate from t = 0 (the last row)
        t = ((timesteps * 1000).to(dtype) / 1000).to(dtype)
        temb = self.time_text_embed(torch.cat([t, t.new_zeros(1)]), dtype)
        scale1, gate1, scale2, gate2 = self.modulation(temb).chunk(4, dim=-1)
        mod = (_split_rows(scale1), _split_rows(gate1.tanh()), _split_rows(scale2), _split_rows(gate2.tanh()),
               torch.zeros_like(scale1[:1, None]))

        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        cache, cached = None, False
        # a cached step runs the target rows only: whatever hooks the blocks would see another sequence from step 2
        hooked = (blocks_replace or patches.get("post_input") or patches.get("single_block")
                  or patches.get("attn1_patch"))
        if self.prefix_cache_enabled and prefix_len > 0 and not hooked:
            key = prefix_cache_key(x, context, ref_latents, image_slots)
            cache_bytes = 2 * len(self.transformer_blocks) * B * prefix_len * self.inner_dim * hidden_states.element_size()
            cache, cached = self.select_prefix_cache(key, cache_bytes, x.device,
                                                     transformer_options.get("qwen_image21_cache", {}))
        if cached:
            hidden_states, pe, prefix_len = hidden_states[:, prefix_len:], pe[:, prefix_len:], 0

        return hidden_states, pe, segments, prefix_len, temb, mod, patches, blocks_replace, cache, cached

    def _forward(self, x, timesteps, context, ref_latents=None, image_slots=None, transformer_options={}, **kwargs):
        B, _, H, W = x.shape
        dtype = x.dtype
        ref_latents, image_slots = list(ref_latents or []), list(image_slots or [])
        hidden_states, pe, segments, prefix_len, temb, mod, patches, blocks_replace, cache, cached = self._start(
            x, timesteps, context, ref_latents, image_slots, transformer_options)

        transformer_options["total_blocks"] = len(self.transformer_blocks)
        transformer_options["block_type"] = "single"
        for i, block in enumerate(self.transformer_blocks):
            transformer_options["block_index"] = i
            if cached:
                prefix_k, prefix_v = cache.take(i, x.device, dtype, B).unbind(1)
                cache.prefetch(i + 1, x.device, dtype)
                attn_fn = prefix_cached_attention(prefix_k, prefix_v, transformer_options)
            else:
                attn_fn = block_causal_attention(segments, transformer_options, cache, i, prefix_len)
            if ("single_block", i) in blocks_replace:
                def block_wrap(args, block=block, attn_fn=attn_fn):
                    return {"img": block(args["img"], mod, args["pe"], attn_fn, prefix_len, args["transformer_options"])}
                hidden_states = blocks_replace[("single_block", i)](
                    {"img": hidden_states, "vec": temb, "pe": pe, "transformer_options": transformer_options},
                    {"original_block": block_wrap})["img"]
            else:
                hidden_states = block(hidden_states, mod, pe, attn_fn, prefix_len, transformer_options)
            for p in patches.get("single_block", []):
                hidden_states = p({"img": hidden_states, "x": x, "block_index": i,
                                   "transformer_options": transformer_options})["img"]

        hidden_states = self.proj_out(self.norm_out(hidden_states[:, prefix_len:], temb[:-1]))
        return hidden_states.transpose(1, 2).reshape(B, self.out_channels, H, W)


# -- ComfyUI's classes around it --------------------------------------------------------------------------------
