"""A modelled GPU clock: what the ops of a model call (toma_bench.oprecord) cost on a given GPU.

A hardware profile is a handful of published or typical numbers, every one written out:

- a GEMM runs at ``peak * gemm_eff * F / (F + gemm_half_gflop)`` (F: its GFLOPs), so small GEMMs run
  below the large ones' efficiency; a convolution the same with ``conv_eff``;
- fused attention (FlashAttention class) at ``peak * attention_eff * L / (L + attention_half_len)``
  (L: key length); an SDPA call with a mask or bias leaves FlashAttention for the memory-efficient
  kernel, ``attention_masked_eff``;
- every kernel takes at least its bytes over ``bandwidth * bandwidth_eff``, and at least
  ``kernel_min_us`` (a launch and the gap to the next kernel);
- the host spends ``host_us_per_kernel`` on each aten op that launches a kernel (and on each op of
  host work) and ``host_us_per_view`` on each one that does not (views, allocations): eager ComfyUI
  issues every op from one Python thread. On a datacenter host that is 25 us (published eager against
  CUDA-graph timings of SD1.5 on an A100 imply 30-45 ms of host time a step: 20-35 us per
  kernel-launching op; ``--sweep`` covers that range); on a fast desktop CPU 5 us. Compiled code
  launches from inductor's wrapper instead (the "compiled" regime below): 9 us a kernel and 35 us a
  graph on a datacenter host, 5 and 20 on a fast desktop CPU.

Four regimes (REGIMES): how the kernels reach the GPU.
- "eager": as above, the host issues every op.
- "graphs" (CUDA-graph replay without inductor: TorchCompileModel's backend "cudagraphs", or a graph captured
  by hand): the kernels of a model call are replayed from a graph; the host pays ``host_us_per_graph`` per
  graph, not per kernel, and nothing per view. A graph cannot hold a read-back: a sync ends one and the next
  kernel starts another. Host work on CPU tensors is still paid op by op. Replayed kernels follow each other
  closer: ``replay_kernel_min_us``.
- "compiled" (torch.compile with inductor and mode None, as ComfyUI's TorchCompileModel node compiles:
  ``comfy_api.torch_helpers.set_torch_compile_wrapper``; KJNodes' compile nodes at their default mode): every
  run of elementwise and copy ops between two GEMM, convolution or attention kernels fuses, one kernel per
  reduction in it (pointwise ops fuse into the reduction before them, or into the first kernel); a fused
  kernel moves the bytes of the largest op it holds (it reads its inputs and writes its output once). No
  graph replay: the host runs inductor's generated wrapper, which launches every fused kernel (and calls
  every GEMM, convolution and attention kernel) itself, ``host_us_per_compiled_kernel`` each, and pays
  ``host_us_per_compiled_call`` each time it enters a compiled graph (dynamo's guards, the wrapper's
  set-up; again after a sync, which breaks the graph). Views cost the host nothing there. Published:
  inductor's per-kernel launch path (CachingAutotuner.run) 6.8 us with no arguments and 9.1 us with 19, a
  raw cuLaunchKernel 3.0-3.3 us, and a one-kernel compiled graph 42-44 us end to end, guards included, on
  a GB200's Grace host (meta-pytorch/tritonbench#1017, April 2026); a one-kernel compiled function 25 us
  against 18 us for the bare Triton launch (pytorch/pytorch#166733). Kernels come from the host, so they
  are spaced as eager ones (``kernel_min_us``).
- "compiled+graphs" (torch.compile's mode reduce-overhead, KJNodes' ``mode`` option): inductor's fusion as
  "compiled", and its kernels replayed from CUDA graphs as "graphs".
  ComfyUI's few ops around the diffusion model (apply_model's scalings) are priced as inside the compiled
  graph in both compiled regimes.

Two ways to add them up per model call:
- "pipelined" (the estimate): the host issues ops in order; the GPU runs each kernel once it has been
  issued and the previous one is done; an op that reads a value back (a sync) makes the host wait for
  the GPU. A call costs whichever of host and GPU finishes last. Every call starts with an empty queue
  (ComfyUI's samplers read a sigma on the host at every step, which drains it).
- "additive" (a pessimistic bound): host time plus GPU time, no overlap.
"""
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .oprecord import ATTENTION, ATTENTION_MASKED, HOST, OP_CLASSES, Op


@dataclass(frozen=True)
class Hardware:
    """One GPU and the host that drives it; every field is documented in the module docstring."""

    name: str
    peak_tflops: float  # dense bf16 tensor-core peak
    bandwidth_tbs: float  # memory bandwidth, TB/s
    gemm_eff: float = 0.70
    gemm_half_gflop: float = 2.0
    conv_eff: float = 0.55
    attention_eff: float = 0.34
    attention_half_len: float = 256.0
    attention_masked_eff: float = 0.20
    bandwidth_eff: float = 0.80
    kernel_min_us: float = 2.0
    host_us_per_kernel: float = 25.0
    host_us_per_view: float = 5.0
    host_us_per_graph: float = 50.0
    replay_kernel_min_us: float = 1.0
    host_us_per_compiled_kernel: float = 9.0
    host_us_per_compiled_call: float = 35.0
    source: str = ""

    def gpu_seconds(self, op: Op, replayed: bool = False) -> float:
        """GPU time of one kernel-launching op (``replayed``: from a graph)."""
        memory = op.bytes / (self.bandwidth_tbs * 1e12 * self.bandwidth_eff)
        if op.cls in ("gemm", "conv"):
            gflop = op.flops / 1e9
            eff = (self.gemm_eff if op.cls == "gemm" else self.conv_eff) * gflop / (gflop + self.gemm_half_gflop)
            compute = op.flops / (self.peak_tflops * 1e12 * eff) if op.flops else 0.0
        elif op.cls == ATTENTION:
            eff = self.attention_eff * op.key_len / (op.key_len + self.attention_half_len)
            compute = op.flops / (self.peak_tflops * 1e12 * eff)
        elif op.cls == ATTENTION_MASKED:
            eff = self.attention_masked_eff * op.key_len / (op.key_len + self.attention_half_len)
            compute = op.flops / (self.peak_tflops * 1e12 * eff)
        else:
            compute = 0.0
        return max(compute, memory, (self.replay_kernel_min_us if replayed else self.kernel_min_us) * 1e-6)

    def host_seconds(self, op: Op) -> float:
        return (self.host_us_per_kernel if op.kernel or op.cls == HOST else self.host_us_per_view) * 1e-6


# Published peaks (dense bf16 with fp32 accumulation, memory bandwidth); efficiencies are typical
# achieved fractions (large GEMMs 60-75% of peak on Hopper, FlashAttention-2 forward 250-350 TFLOP/s on
# an H100, streaming kernels ~80% of bandwidth). The GPU kit (toma_bench.gpu) fits them on a real run.
# Hopper at a UNet's sizes (December 2026): with the A100's proportions (half-saturation 2 GFLOP,
# convolutions at 55%) SDXL 1024 priced 31.5 ms a step on an H100 graph-replayed and fused, where
# TensorRT's UNet, which fuses at least as much, takes 44.3 ms (1,772 ms for 40 steps,
# stabilityai/stable-diffusion-xl-1.0-tensorrt model card), while the A100 profile's 79 ms matched the
# A100's 84 ms there and diffusers' compiled 2.54 s for 30 steps (huggingface.co/docs/diffusers,
# tutorials/fast_diffusion). SDXL's projections (K and N of 640-1280, 442 GEMMs of 6.7 GFLOP a step)
# and its NCHW convolutions fill an H100's 132 SMs worse than square GEMMs do: half-saturation 8 GFLOP
# and convolutions at 30% put the H100 at 44 ms and the H200 at 43. FLUX.1-dev's step (GEMMs of 300-600
# GFLOP) moves by 1%. Square GEMMs of 1,024/2,048/4,096 are then priced at 0.15/0.48/0.66 of peak against
# 0.18/0.68/0.80 measured on an H100 with PyTorch 2.7 (zzc0721/torch-performance-test-data#79): the fit
# is to whole SDXL steps; how their time splits between GEMMs and convolutions is not measured.
HOPPER_UNET = dict(gemm_half_gflop=8.0, conv_eff=0.30)
PROFILES = {
    "h200": Hardware("h200", 989.0, 4.8, **HOPPER_UNET, source="H200 SXM: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e"),
    "h100": Hardware("h100", 989.0, 3.35, **HOPPER_UNET, source="H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3"),
    "a100": Hardware("a100", 312.0, 2.04, attention_eff=0.60, attention_masked_eff=0.40, conv_eff=0.60,
                     gemm_half_gflop=1.0, source="A100 SXM 80GB: 312 TFLOP/s bf16 dense, 2.04 TB/s"),
    "l40s": Hardware("l40s", 362.0, 0.864, attention_eff=0.50, attention_masked_eff=0.30, gemm_eff=0.65,
                     gemm_half_gflop=1.0, source="L40S: 362 TFLOP/s bf16 dense, 864 GB/s GDDR6"),
    "rtx4090": Hardware("rtx4090", 165.2, 1.008, attention_eff=0.60, attention_masked_eff=0.40, gemm_eff=0.75,
                        gemm_half_gflop=0.5, host_us_per_kernel=5.0, host_us_per_view=1.0, host_us_per_graph=20.0,
                        host_us_per_compiled_kernel=5.0, host_us_per_compiled_call=20.0, source="RTX 4090: 165 TFLOP/s bf16 (fp32 accumulate), 1.01 TB/s; a fast desktop CPU"),
    "rtx3090": Hardware("rtx3090", 71.0, 0.936, attention_eff=0.65, attention_masked_eff=0.45, gemm_eff=0.75,
                        gemm_half_gflop=0.3, host_us_per_kernel=5.0, host_us_per_view=1.0, host_us_per_graph=20.0,
                        host_us_per_compiled_kernel=5.0, host_us_per_compiled_call=20.0, source="RTX 3090: 71 TFLOP/s bf16 (fp32 accumulate), 936 GB/s; a fast desktop CPU"),
}

DATACENTER = ("h200", "h100", "a100", "l40s")  # host_us_per_kernel 25; the desktop profiles 5
DESKTOP = ("rtx4090", "rtx3090")

# Each assumption varied alone (a field and the factors it takes), for --sweep: the host per op over the
# published range (20-35 us around 25 on a datacenter host); compiled code's launch from 6.8 us (inductor's
# bare per-kernel path) to 18 (older Triton launchers: pytorch/pytorch#166733 measured 18 us for a bare
# Triton launch); Hopper's half-saturation from the A100 proportions' 2 GFLOP to 32.
SWEEP = (
    ("host_us_per_kernel", (0.8, 1.4)),
    ("host_us_per_view", (0.0, 2.0)),
    ("host_us_per_graph", (0.5, 2.0)),
    ("replay_kernel_min_us", (0.5, 2.0)),
    ("host_us_per_compiled_kernel", (0.75, 2.0)),
    ("host_us_per_compiled_call", (0.5, 2.0)),
    ("gemm_eff", (0.8, 1.2)),
    ("gemm_half_gflop", (0.25, 4.0)),
    ("conv_eff", (0.8, 1.2)),
    ("attention_eff", (0.8, 1.2)),
    ("bandwidth_eff", (0.8, 1.15)),
    ("kernel_min_us", (0.5, 2.0)),
)


def profile(name_or_file: str) -> Hardware:
    """A profile by name (PROFILES) or from a JSON file of Hardware fields (``name``, ``peak_tflops`` and
    ``bandwidth_tbs`` required)."""
    if name_or_file in PROFILES:
        return PROFILES[name_or_file]
    path = Path(name_or_file)
    if not path.is_file():
        raise ValueError(f"--hardware must be one of {', '.join(PROFILES)} or a JSON file; got {name_or_file!r}")
    fields = json.loads(path.read_text())
    known = {f.name for f in dataclasses.fields(Hardware)}
    unknown = set(fields) - known
    if unknown:
        raise ValueError(f"{path}: unknown hardware fields {sorted(unknown)} (known: {sorted(known)})")
    return Hardware(**fields)


def swept(hw: Hardware):
    """(description, profile) for each single change of SWEEP, factors applied to ``hw``'s values
    (efficiencies capped at 0.95)."""
    for name, factors in SWEEP:
        for factor in factors:
            value = getattr(hw, name) * factor
            if name.endswith("_eff"):
                value = min(value, 0.95)
            yield f"{name} x{factor:g}", dataclasses.replace(hw, **{name: value})


@dataclass(frozen=True)
class Regime:
    """How a model call's kernels reach the GPU (the module docstring): ``replay``, from a graph, the host
    paying per graph; ``fuse``, inductor's fusion of elementwise and copy chains (without ``replay``, the
    host launches each fused kernel from inductor's wrapper)."""

    name: str
    replay: bool
    fuse: bool
    title: str

    @property
    def traced(self) -> bool:
        """Whether the model runs as torch.compile traced it (every regime but eager)."""
        return self.replay or self.fuse


REGIMES = {r.name: r for r in (
    Regime("eager", False, False, "eager PyTorch: the host issues every op"),
    Regime("graphs", True, False, "CUDA-graph replay without inductor (TorchCompileModel backend cudagraphs): "
                                  "the host pays per graph"),
    Regime("compiled", False, True, "torch.compile, inductor, mode None (ComfyUI's TorchCompileModel node): "
                                    "elementwise and copy chains fused, the host launches every kernel"),
    Regime("compiled+graphs", True, True, "torch.compile, inductor, mode reduce-overhead (KJNodes' mode option): "
                                          "fused as compiled, and graph replay"),
)}

FUSIBLE = ("elementwise", "copy")
# aten reductions: inductor gives each of them a kernel of its own (the pointwise ops before it fuse into it)
REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "std_mean", "_softmax",
              "_log_softmax", "native_layer_norm", "native_group_norm", "_fused_rms_norm", "norm",
              "linalg_vector_norm", "logsumexp", "prod", "cumsum", "argmax", "argmin", "topk", "sort", "any", "all"}


def fused(ops: list[Op]) -> list[Op]:
    """``ops`` as inductor runs them: each run of elementwise and copy kernels (views and host work between
    them do not break it; a sync, another class of kernel or a change of merge stage does) becomes one
    kernel per reduction it holds (at least one), moving the bytes of the largest op it takes in."""
    out: list[Op] = []
    chain: list[Op] = []

    def close():
        if not chain:
            return
        parts, current = [], []
        for op in chain:
            if op.name in REDUCTIONS and any(o.name in REDUCTIONS for o in current):
                parts.append(current)
                current = []
            current.append(op)
        parts.append(current)
        for part in parts:
            out.append(Op("fused:" + "+".join(dict.fromkeys(o.name for o in part)), "elementwise", 0,
                          max(o.bytes for o in part), True, False, 0, part[0].stage))
        chain.clear()

    for op in ops:
        if op.kernel and op.cls in FUSIBLE and not op.sync:
            if chain and chain[-1].stage != op.stage:
                close()
            chain.append(op)
        elif op.kernel or op.sync:
            close()
            out.append(op)
        else:
            out.append(op)
    close()
    return out


@dataclass
class CallCost:
    """What one model call costs under a profile: seconds (the chosen way of adding up), the GPU and host
    totals, the critical seconds of each merge stage (each op's larger of GPU and host time), GPU
    seconds per op class, and the kernels launched (after fusion) and graphs replayed or entered; pipelined,
    when the host is done issuing the call (``host_end``) and when the GPU is done running it (``gpu_end``),
    both from the call's start."""

    seconds: float
    gpu: float
    host: float
    stages: dict
    classes: dict
    kernels: int = 0
    graphs: int = 0
    host_end: float = 0.0
    gpu_end: float = 0.0

    def host_bound(self, slack: float) -> bool:
        """Whether the host-pace rule (nodes/runtime/pace.py) judges the call host-bound: the GPU, which starts
        the call with the host (every call starts with an empty queue), done within ``slack`` of the host."""
        return self.gpu_end <= self.host_end * (1 + slack)


def call_cost(ops: list[Op], hw: Hardware, how: str = "pipelined", regime: Regime | str = "eager",
              fuse: bool = True) -> CallCost:
    """What ``ops`` (one model call) cost on ``hw`` in ``regime``; ``fuse``: False where they come fused
    already (costmodel.Recorded.calls_in fuses once per recording)."""
    if how not in ("pipelined", "additive"):
        raise ValueError(f"how must be 'pipelined' or 'additive', got {how!r}")
    if isinstance(regime, str):
        if regime not in REGIMES:
            raise ValueError(f"regime must be one of {', '.join(REGIMES)}, got {regime!r}")
        regime = REGIMES[regime]
    if regime.fuse and fuse:
        ops = fused(ops)
    host = gpu = gpu_total = host_total = 0.0
    issued = 0.0  # when the host issued the current kernel (eager, compiled) or launched the current graph (replay)
    stages = {"select": 0.0, "merge": 0.0, "unmerge": 0.0}
    classes = dict.fromkeys(OP_CLASSES, 0.0)
    kernels = graphs = 0
    in_graph = False
    for op in ops:
        if op.cls == HOST and regime.traced:
            h = hw.host_us_per_kernel * 1e-6  # host work stays outside the graph; its kernels do not wait for it
        elif not regime.traced:
            h = hw.host_seconds(op)
        elif not op.kernel:
            h = 0.0  # a view in a graph or in inductor's wrapper costs the host nothing
        elif not regime.replay:  # inductor's wrapper launches each kernel; entering the graph runs the guards
            h = (hw.host_us_per_compiled_kernel + (0.0 if in_graph else hw.host_us_per_compiled_call)) * 1e-6
            graphs += not in_graph
            in_graph = True
        elif not in_graph:
            h = hw.host_us_per_graph * 1e-6
            in_graph = True
            graphs += 1
        else:
            h = 0.0
        host += h
        host_total += h
        if not regime.replay or (op.kernel and h):
            issued = host
        g = 0.0
        if op.kernel:
            g = hw.gpu_seconds(op, replayed=regime.replay)
            gpu = max(gpu, issued) + g
            gpu_total += g
            classes[op.cls] += g
            kernels += 1
        if op.sync:
            host = max(host, gpu)
            in_graph = False
        if op.stage is not None:
            stages[op.stage] += max(g, h)
    seconds = max(host, gpu) if how == "pipelined" else host_total + gpu_total
    return CallCost(seconds, gpu_total, host_total, stages, classes, kernels, graphs, host, gpu)
