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
  issues every op from one Python thread.

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
    host_us_per_kernel: float = 7.0
    host_us_per_view: float = 1.5
    source: str = ""

    def gpu_seconds(self, op: Op) -> float:
        """GPU time of one kernel-launching op."""
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
        return max(compute, memory, self.kernel_min_us * 1e-6)

    def host_seconds(self, op: Op) -> float:
        return (self.host_us_per_kernel if op.kernel or op.cls == HOST else self.host_us_per_view) * 1e-6


# Published peaks (dense bf16 with fp32 accumulation, memory bandwidth); efficiencies are typical
# achieved fractions (large GEMMs 60-75% of peak on Hopper, FlashAttention-2 forward 250-350 TFLOP/s on
# an H100, streaming kernels ~80% of bandwidth). The GPU kit (toma_bench.gpu) fits them on a real run.
PROFILES = {
    "h200": Hardware("h200", 989.0, 4.8, source="H200 SXM: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e"),
    "h100": Hardware("h100", 989.0, 3.35, source="H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3"),
    "a100": Hardware("a100", 312.0, 2.04, attention_eff=0.60, attention_masked_eff=0.40, conv_eff=0.60,
                     gemm_half_gflop=1.0, source="A100 SXM 80GB: 312 TFLOP/s bf16 dense, 2.04 TB/s"),
    "l40s": Hardware("l40s", 362.0, 0.864, attention_eff=0.50, attention_masked_eff=0.30, gemm_eff=0.65,
                     gemm_half_gflop=1.0, source="L40S: 362 TFLOP/s bf16 dense, 864 GB/s GDDR6"),
    "rtx4090": Hardware("rtx4090", 165.2, 1.008, attention_eff=0.60, attention_masked_eff=0.40, gemm_eff=0.75,
                        gemm_half_gflop=0.5, host_us_per_kernel=5.0, host_us_per_view=1.0,
                        source="RTX 4090: 165 TFLOP/s bf16 (fp32 accumulate), 1.01 TB/s; a fast desktop CPU"),
    "rtx3090": Hardware("rtx3090", 71.0, 0.936, attention_eff=0.65, attention_masked_eff=0.45, gemm_eff=0.75,
                        gemm_half_gflop=0.3, host_us_per_kernel=5.0, host_us_per_view=1.0,
                        source="RTX 3090: 71 TFLOP/s bf16 (fp32 accumulate), 936 GB/s; a fast desktop CPU"),
}

# Each assumption varied alone (a field and the values it takes), for --sweep.
SWEEP = (
    ("host_us_per_kernel", (0.5, 2.0)),
    ("host_us_per_view", (0.0, 2.0)),
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


@dataclass
class CallCost:
    """What one model call costs under a profile: seconds (the chosen way of adding up), the GPU and host
    totals, the critical seconds of each merge stage (each op's larger of GPU and host time), and GPU
    seconds per op class."""

    seconds: float
    gpu: float
    host: float
    stages: dict
    classes: dict


def call_cost(ops: list[Op], hw: Hardware, how: str = "pipelined") -> CallCost:
    if how not in ("pipelined", "additive"):
        raise ValueError(f"how must be 'pipelined' or 'additive', got {how!r}")
    host = gpu = gpu_total = host_total = 0.0
    stages = {"select": 0.0, "merge": 0.0, "unmerge": 0.0}
    classes = dict.fromkeys(OP_CLASSES, 0.0)
    for op in ops:
        h = hw.host_seconds(op)
        host += h
        host_total += h
        g = 0.0
        if op.kernel:
            g = hw.gpu_seconds(op)
            gpu = max(gpu, host) + g
            gpu_total += g
            classes[op.cls] += g
        if op.sync:
            host = max(host, gpu)
        if op.stage is not None:
            stages[op.stage] += max(g, h)
    seconds = max(host, gpu) if how == "pipelined" else host_total + gpu_total
    return CallCost(seconds, gpu_total, host_total, stages, classes)
