"""Every aten op of a model call, recorded on the meta device: what the cost model (toma_bench.costmodel)
prices.

A real-size model is built with ComfyUI's own classes on the meta device (weights have shapes, no data),
patched by the pack's nodes as a user patches it, and sampled through ComfyUI's sampler with the
sampler-side tensors on the CPU. Under ``recording()``:

- a TorchDispatchMode sees every aten op. The model call's inputs are moved to meta as the call begins
  (``model_call``), except the sigmas in ``transformer_options``, which stay on the CPU so the pack can
  read its step as it does from a GPU. An op that still mixes meta and CPU tensors (the model-sampling
  buffers stay on the CPU) gets its CPU operands moved to meta. An op on CPU tensors alone is host
  work (the pack's plan geometry, its read of the step's sigma): no kernel; a value read there is the
  sigma, a device read in a real run, and counts as a sync.
- a TorchFunctionMode catches ``F.scaled_dot_product_attention`` one level up: on meta it would
  decompose into bmm + softmax over the full Lq x Lk matrix, while a GPU runs one fused kernel
  (FlashAttention without a mask or bias; the memory-efficient kernel with one, priced lower).
- ``model_call()`` brackets one call of the diffusion model (the unet function wrapper): only ops inside
  a call are kept, each with the merge stage it ran in (``stage_listener``: the pack's runtime announces
  its select / merge / unmerge stages through its stage clock's listeners).

What an op costs is not decided here: an ``Op`` says what it is (class, FLOPs, bytes moved, whether it
launches a kernel, whether the host waits for the device).
"""
import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
CONVS = {aten.convolution, aten._convolution}
# ops that make the host wait for the device: a value read back, or an output whose size depends on data
SYNCS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.is_nonzero, aten.equal, aten.unique_dim,
         aten._unique2, aten.unique_consecutive, aten.repeat_interleave}
# allocations and metadata: no kernel is launched
NO_KERNEL = {aten._unsafe_view, aten._reshape_alias, aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.detach,
             aten.alias, aten.lift_fresh, aten.set_, aten.resize_, aten.lift_fresh_copy, aten.sym_size,
             aten.sym_stride, aten.sym_numel, aten.sym_storage_offset}
# data movement: gathers, scatters, concatenation and copies
COPIES = {aten._to_copy, aten.copy_, aten.clone, aten.cat, aten.stack, aten.index_select, aten.gather,
          aten.index, aten.index_put_, aten.index_put, aten.index_copy_, aten.index_copy, aten.scatter,
          aten.scatter_, aten.scatter_add_, aten.scatter_add, aten.scatter_reduce, aten.repeat, aten.roll,
          aten.constant_pad_nd, aten.embedding, aten.take_along_dim, aten.masked_scatter_, aten.flip}
# reads only the rows its index names: bytes are twice the output (read + write) plus the index
GATHERS = {aten.index_select, aten.gather, aten.index, aten.embedding, aten.take_along_dim}

# ops that may take a boolean mask among their indices (a GPU runs nonzero on it first)
MASK_INDEXED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}

ATTENTION = "attention"
ATTENTION_MASKED = "attention (mask/bias)"
OP_CLASSES = ("gemm", "conv", ATTENTION, ATTENTION_MASKED, "elementwise", "copy")
HOST = "host"  # an op on CPU tensors only: host work, no kernel


@dataclass(frozen=True, slots=True)
class Op:
    """One aten op of a model call. cls: one of OP_CLASSES, or "view" (no kernel). flops: multiply-adds
    x 2 of GEMMs, convolutions and attention, 0 elsewhere. bytes: read + written. key_len: the attention's
    key length (its kernel's efficiency depends on it), else 0. stage: "select", "merge", "unmerge" or
    None (the model itself)."""

    name: str
    cls: str
    flops: int
    bytes: int
    kernel: bool
    sync: bool
    key_len: int
    stage: str | None


def to_meta(v):
    """``v`` on the meta device if it is a CPU tensor, else ``v``."""
    return v.to("meta") if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches reading all of ``t``: its elements, but no more than its storage holds
    (an expanded tensor reads its storage once)."""
    logical = t.numel() * t.element_size()
    try:
        stored = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return logical
    return min(logical, stored) if stored else logical


_ATTENTION_SCALE = [1.0]  # attention_scaled's factor, innermost last


@contextlib.contextmanager
def attention_scaled(factor: float):
    """Attention recorded inside the block costs ``factor`` of a dense fused kernel (its FLOPs and bytes
    scaled alike, so its time scales so on any profile): a sparse kernel priced from its routed share
    (toma_bench.sparse_attention)."""
    _ATTENTION_SCALE.append(float(factor))
    try:
        yield
    finally:
        _ATTENTION_SCALE.pop()


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.bool


def _leaves(args, kwargs) -> list:
    """The arguments of an aten op, one level of lists opened (aten ops nest no deeper), with the
    keyword names among them (they are part of what an op does)."""
    out = []
    for v in args:
        if isinstance(v, (list, tuple)):
            out.extend(v)
        else:
            out.append(v)
    for name, v in kwargs.items():
        out.append(name)
        if isinstance(v, (list, tuple)):
            out.extend(v)
        else:
            out.append(v)
    return out


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among ``values``: an op's output (a tensor or a sequence), or a list of leaves."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for t in values if isinstance(t, torch.Tensor)]
    return []


def _is_view(func) -> bool:
    """Whether ``func`` only makes views of its inputs (every output aliases an input and none is written)."""
    if func.is_view:
        return True
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _is_functional(func) -> bool:
    """Whether ``func`` writes none of its inputs and returns fresh tensors (no views, no aliases)."""
    schema = func._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


class Recording:
    """The ops of each model call recorded so far: ``calls`` is a list of lists of Op."""

    def __init__(self):
        self.calls: list[list[Op]] = []
        self.stage: str | None = None
        self._current: list[Op] | None = None
        # the answer to a value read back from a meta tensor (None: such a read is an error); set for a
        # run whose only data-dependent value is known in advance (CA-ToMe's merge count, fixed)
        self.meta_scalar: int | None = None
        # the share of a boolean mask's elements that are true, for an index by mask on the meta device
        # (None: such an index is an error); set for a model that routes tokens by data, priced as routed
        # evenly (HiDream's mixture of experts)
        self.meta_mask_share: float | None = None
        # (op, input metadata) -> output metadata and its Op: running a meta kernel costs about a
        # millisecond of Python, rebuilding its output from metadata a few microseconds
        self._memo: dict = {}

    # -- what the modes and hooks call --------------------------------------------------------------
    def stage_listener(self, stage: str, entering: bool) -> None:
        """For a runtime's stage clock: ops between entering and leaving ``stage`` are tagged with it."""
        self.stage = stage if entering else None

    @contextlib.contextmanager
    def model_call(self):
        self._current = []
        try:
            yield
        finally:
            self.calls.append(self._current)
            self._current = None
            self.stage = None

    def add(self, op_name, cls, flops, nbytes, kernel, sync, key_len=0) -> None:
        if self._current is not None:
            self._current.append(Op(op_name, cls, int(flops), int(nbytes), kernel, sync, key_len, self.stage))

    # -- the modes -------------------------------------------------------------------------------------
    def dispatch(self, func, args, kwargs):
        leaves = _leaves(args, kwargs)
        devices = {t.device.type for t in leaves if isinstance(t, torch.Tensor)}
        if "meta" in devices and "cpu" in devices:
            args, kwargs = tree_map(to_meta, (args, kwargs))
            leaves = _leaves(args, kwargs)
            devices = {"meta"}
        if func is aten._to_copy.default and devices == {"meta"} and kwargs.get("device") is not None:
            # meta -> CPU: a model-side buffer kept on the CPU here (the model sampling's), on the GPU in a
            # real run, where this copy changes at most the dtype
            kwargs = dict(kwargs, device=torch.device("meta"))
            if kwargs.get("dtype") in (None, args[0].dtype):
                return args[0]
        if func is aten._local_scalar_dense.default and devices == {"meta"}:
            if self.meta_scalar is None:
                raise RuntimeError("a value was read back from a meta tensor: the cost model has no data "
                                   "(a variant whose sizes depend on data needs its meta_scalar)")
            if self._current is not None:
                self._current.append(Op("_local_scalar_dense", "elementwise", 0, 8, True, True, 0, self.stage))
            return self.meta_scalar
        if func in MASK_INDEXED and devices == {"meta"} and any(_is_mask(t) for t in args[1]):
            args = (args[0], self._mask_rows(args[1]), *args[2:])
            leaves = _leaves(args, kwargs)
        if devices == {"cpu"}:  # host-side work (the model's inputs are on meta): no kernel on a GPU
            out = func(*args, **kwargs)
            if self._current is not None:
                self._current.append(Op(func._overloadpacket.__name__, HOST, 0, 0, False,
                                        func is aten._local_scalar_dense.default, 0, self.stage))
            return out
        key = self._memo_key(func, leaves) if devices == {"meta"} else None
        known = self._memo.get(key) if key is not None else None
        if known is not None:
            shapes, sequence, op = known
            outs = [torch.empty_strided(size, stride, dtype=dtype, device="meta") for size, stride, dtype in shapes]
            out = tuple(outs) if sequence else outs[0]
        else:
            out = func(*args, **kwargs)
            op = self._describe(func, args, kwargs, leaves, out)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            if (key is not None and op.kernel and not op.sync and _is_functional(func)
                    and all(isinstance(o, torch.Tensor) for o in outs)):
                shapes = tuple((tuple(o.shape), o.stride(), o.dtype) for o in outs)
                self._memo[key] = (shapes, isinstance(out, (tuple, list)), op)
        if self._current is not None:
            self._current.append(op if self.stage is None else dataclasses.replace(op, stage=self.stage))
        return out

    def _mask_rows(self, indices) -> list:
        """``indices`` with each boolean mask replaced by the row indices a GPU's nonzero would give it, as
        many as ``meta_mask_share`` of its elements; the nonzero is recorded (its count is read back)."""
        if self.meta_mask_share is None:
            raise RuntimeError("a tensor was indexed by a boolean mask on the meta device: the cost model has no "
                               "data (a model that routes by data needs its meta_mask_share)")
        out = []
        for t in indices:
            if not _is_mask(t):
                out.append(t)
                continue
            count = round(t.numel() * self.meta_mask_share)
            if self._current is not None:
                self._current.append(Op("nonzero", "elementwise", 0, tensor_bytes(t) + 8 * t.ndim * count, True, True,
                                        0, self.stage))
            out.extend(torch.empty(count, dtype=torch.long, device="meta") for _ in range(t.ndim))
        return out

    @staticmethod
    def _memo_key(func, leaves):
        parts = [func]
        for v in leaves:
            parts.append((tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v)
        key = tuple(parts)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    @staticmethod
    def _describe(func, args, kwargs, leaves, out) -> Op:
        """The Op of ``func`` (its stage is set where it is recorded)."""
        packet = func._overloadpacket
        name = packet.__name__
        sync = packet in SYNCS
        if packet in NO_KERNEL or (not sync and _is_view(func)):
            return Op(name, "view", 0, 0, False, False, 0, None)
        ins, outs = _tensors(leaves), _tensors(out)
        if packet in GATHERS:
            index = [t for t in ins if not t.is_floating_point()]
            nbytes = 2 * sum(map(tensor_bytes, outs)) + sum(map(tensor_bytes, index))
        else:
            nbytes = sum(map(tensor_bytes, ins)) + sum(map(tensor_bytes, outs))
        flops = 0
        if packet in GEMMS or packet in CONVS:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            cls = "gemm" if packet in GEMMS else "conv"
        elif packet in COPIES:
            cls = "copy"
        else:
            cls = "elementwise"
        return Op(name, cls, int(flops), int(nbytes), True, sync, 0, None)

    def attention(self, q, k, v, attn_mask=None, scale=None, enable_gqa=False, **_):
        """One fused SDPA kernel: its output, recorded without running the decomposition."""
        q, k, v = (t.to("meta") for t in (q, k, v))
        batch_heads = q.numel() // (q.shape[-2] * q.shape[-1])
        lq, lk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
        flops = 2 * batch_heads * lq * lk * (d + dv)
        nbytes = sum(map(tensor_bytes, (q, k, v))) + batch_heads * lq * dv * q.element_size()
        masked = attn_mask is not None
        if masked:
            nbytes += tensor_bytes(attn_mask)
        flops, nbytes = flops * _ATTENTION_SCALE[-1], nbytes * _ATTENTION_SCALE[-1]
        self.add("scaled_dot_product_attention", ATTENTION_MASKED if masked else ATTENTION, flops, nbytes, True,
                 False, lk)
        return torch.empty(*q.shape[:-1], dv, dtype=q.dtype, device="meta")


class _Dispatch(TorchDispatchMode):
    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recording.dispatch(func, args, kwargs or {})


class _Functions(TorchFunctionMode):
    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            given = dict(zip(names, args), **kwargs)
            if given.get("is_causal"):
                raise NotImplementedError("causal SDPA is not priced (no model the pack patches uses it)")
            return self.recording.attention(given["query"], given["key"], given["value"], given.get("attn_mask"))
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording():
    """A Recording, with both modes active inside the block."""
    rec = Recording()
    with _Functions(rec), _Dispatch(rec):
        yield rec
