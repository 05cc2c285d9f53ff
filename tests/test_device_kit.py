"""The GPU benchmark kit cannot rot: toma_bench/gpu_kit/prepare.sh builds .device/, and `bash .device/run.sh
--dry-run` runs python -m toma_bench.gpu (the cost model's predictions first, then the measurements and
the profiler pass) on the CPU at tiny sizes in a fresh virtual environment (torch and
the GPU machine's packages from the package cache, everything else only from .device/ with --no-index).
Where no ComfyUI mirror is at hand (CI) the kit packs the pinned tree, which has no Flux: Flux is then
skipped with a note. Takes a few minutes (installing torch into the fresh venv is most of it).
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.device

SDXL_VARIANTS = 1 + 1 + 3 * 2 * 2 + 1 + 1  # unpatched, node default, ToMA ratios x levels x scopes, keys/values candidate, ToMeSD
FLUX_VARIANTS = 1 + 1 + 3 * 2  # unpatched, node default, ToMA ratios x placements


def run(command: list[str], env: dict, timeout: int) -> str:
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{output[-6000:]}"
    return output


def test_prepared_kit_runs_the_benchmark_dry_on_the_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_PATH", "PYTHONPATH")}
    prepared = run(["bash", "toma_bench/gpu_kit/prepare.sh"], env, 600)
    kit = REPO / ".device"
    size = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())
    assert size <= 48 * 2**20, f".device/ holds {size / 2**20:.1f} MiB"
    assert {p.name.split("-")[0] for p in (kit / "wheels").glob("*.whl")} == {"torchsde", "trampoline"}
    code = kit / "comfyui"
    assert (code / "comfy" / "sample.py").is_file()
    assert not [p for p in code.rglob("*") if p.is_file() and p.suffix != ".py" and not p.name.startswith(".comfyui-")]
    has_flux = (code / "comfy" / "ldm" / "flux" / "model.py").is_file()

    output = run(["bash", ".device/run.sh", "--dry-run"], dict(env, OUT=str(tmp_path)), 1200)

    results = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert results["meta"]["dry_run"] and results["meta"]["complete"], output[-3000:]
    sdxl = results["models"]["sdxl"]["rows"]
    assert len(sdxl) == SDXL_VARIANTS and all(r["runs"] >= 1 and r["step_ms"] > 0 for r in sdxl)
    assert all(r["merged_tokens"] != "all" for r in sdxl[1:]), "a patched variant merged nothing"
    assert all(r["merge_percent"] is not None for r in sdxl[1:])
    counted = {s["variant"] for s in results["syncs"] if s["model"] == "sdxl"}
    assert {"ToMA r=0.5 auto attention (the earlier default)", "ToMeSD r=0.5 (1/2 level)",
            "ToMA node default (r=auto, SDXL preset)"} <= counted
    assert all(s["model_calls"] >= 2 for s in results["syncs"])
    if has_flux:
        flux = results["models"]["flux"]["rows"]
        assert len(flux) == FLUX_VARIANTS and all(r["runs"] >= 1 for r in flux)
        assert all(r["merged_tokens"] != "all" for r in flux[1:])
    else:
        assert "flux" not in results["models"]
        assert any(n.startswith("flux skipped") for n in results["notes"]), prepared
    # the cost model's predictions of every variant, written before the first measurement
    assert set(results["predictions"]["sdxl"]) == {r["variant"] for r in sdxl}
    assert all(p["ms"] > 0 for p in results["predictions"]["sdxl"].values())
    assert output.index("[costmodel] sdxl: unpatched recorded") < output.index("[gpu] sdxl: repeat 1/")
    # the profiler pass (unpatched and the node's default) and the fit on the unpatched run
    profiled = results["profiles"]["sdxl"]
    assert set(profiled) == {"unpatched", "ToMA node default (r=auto, SDXL preset)"}
    assert all(p["kernels_per_call"] > 0 and p["device_ms_per_step"] for p in profiled.values())
    fit = results["fits"]["sdxl"]
    assert set(fit["rows"]) == {r["variant"] for r in sdxl} and fit["parameters"]["host_us_per_kernel"] > 0
    # predictions eager and compiled; the host pass (SD1.5 and SDXL unpatched, eager; no CUDA graph on the
    # CPU) and the compile pass (unpatched and the node's default under ComfyUI's TorchCompileModel path)
    assert all(set(p["regimes"]) == {"eager", "compiled"} for p in results["predictions"]["sdxl"].values())
    assert set(results["host"]) == {"sd15", "sdxl"}
    assert all(h["kernels_per_call"] > 100 and h["eager_ms"] > 0 and h["graph_ms"] is None
               for h in results["host"].values())
    if has_flux:  # a current tree: comfy_api.torch_helpers is there
        compiled = results["compiled"]["sdxl"]["rows"]
        assert [r["variant"].split(" (")[0] for r in compiled] == ["unpatched", "ToMA node default"]
        assert all(r["compiled_ms"] > 0 and r["graphs"] >= 1 for r in compiled)
    markdown = (tmp_path / "gpu_bench.md").read_text()
    assert "The host's cost per op" in markdown and "predicted compiled" in markdown
    assert "predicted speed-up" in markdown and "fitted on the unpatched run" in markdown
    assert "## sdxl" in markdown and "ToMA r=0.75 auto+next block" in markdown
