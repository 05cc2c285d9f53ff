"""``python -m toma_bench.stack_levers``: its variant grammar, and a whole run on a tiny random Flux proxy in the
ComfyUI under test (a subprocess: the benchmark imports ComfyUI with its own settings; core's LazyCache:
v0.3.64 on)."""
import json
import os
import re
import subprocess
import sys

import pytest

from toma_bench import comfy_host, proxy, proxy_training, stack_levers


def test_variants_read_cache_toma_and_levers():
    v = stack_levers.parse_variant("lc0.3+r0.2+calls+fixed+reuse3+wgt5")
    assert (v.cache, v.threshold, v.ratio, v.node) == ("LazyCache", 0.3, 0.2, False)
    reuse, wgt = stack_levers.lever_number(v.levers, "reuse", 5), stack_levers.lever_number(v.levers, "wgt", 1)
    assert (reuse, wgt, "calls" in v.levers) == (3, 5, True)
    node = stack_levers.parse_variant("tc0.4+node")
    assert (node.cache, node.ratio, node.node, node.levers) == ("TeaCache", None, True, ())
    plain = stack_levers.parse_variant("unpatched")
    assert (plain.cache, plain.ratio, plain.node) == (None, None, False)
    assert stack_levers.parse_variant("lc0.5+r0.3+corr").levers == ("corr",)


def test_each_proxy_takes_the_ratios_its_real_size_model_was_priced_at():
    wan = stack_levers.ARCHES["wan32"].per_call
    assert stack_levers.parse_variant("lc0.5+r0.9", wan).ratio == 0.9
    with pytest.raises(ValueError, match="ratio 0.9 has no per-call speed-up"):
        stack_levers.parse_variant("lc0.5+r0.9")  # flux32's
    args = stack_levers.parse_args(["--arch", "wan32", "lc0.5+r0.7"])
    assert (args.side, args.proxy.name, args.variants[0].ratio) == (64, "wan32_proxy.safetensors", 0.7)


@pytest.mark.parametrize("name, why", [
    ("xc0.3", "'xc0.3' is not 'unpatched' nor a cache"), ("lcfast", "threshold 'fast' is not a number"),
    ("lc0.3+t0.3", "ToMA is 'node' or 'r<ratio>'"), ("lc0.3+r0.4", "ratio 0.4 has no per-call speed-up"),
    ("lc0.3+r0.3+faster", "unknown lever 'faster'"), ("lc0.3+r0.3+wgt0", "unknown lever 'wgt0'"),
    ("lc0.3+node+fixed", "'node' takes no levers"), ("tc0", "TeaCache threshold: above 0"),
])
def test_a_bad_variant_is_refused_by_name(name, why, capsys):
    with pytest.raises(ValueError, match=f"{re.escape(f'variant {name!r}')}.*{re.escape(why)}"):
        stack_levers.parse_variant(name)
    with pytest.raises(SystemExit):
        stack_levers.parse_args(["lc0.5", name])
    assert f"variant '{name}'" in capsys.readouterr().err


def levers(comfy, *argv, cwd=comfy_host.REPO):
    env = dict(os.environ, COMFYUI_PATH=str(comfy), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "toma_bench.stack_levers", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)
def test_a_run_on_a_tiny_flux_counts_calls_and_records_the_cache_the_node_found(comfy, tmp_path):
    pytest.importorskip("comfy_extras.nodes_easycache", reason="no LazyCache in this ComfyUI")
    model = proxy.build("flux", proxy.FLUX_TINY, seed=0)
    proxy_training.save(model, tmp_path / "tiny.safetensors", proxy.FLUX_TINY, {"size": "tiny", "steps": 0})
    setup = ["--proxy", str(tmp_path / "tiny.safetensors"), "--side", "16", "--batch", "1", "--steps", "10",
             "--reference", str(tmp_path / "unpatched.pt")]
    done = levers(comfy, "lc0.5+r0.3", "lc0.5+node", "lc0.5+r0.3+corr", *setup, "--out", str(tmp_path / "rows.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert list(rows) == ["unpatched", "lc0.5+r0.3", "lc0.5+node", "lc0.5+r0.3+corr"]  # the reference first
    assert (rows["unpatched"]["calls"], rows["unpatched"]["merged_calls"], rows["unpatched"]["psnr"]) == (10, 0, None)
    assert rows["unpatched"]["modelled"] == 1.0
    hand, node = rows["lc0.5+r0.3"], rows["lc0.5+node"]
    assert 0 < hand["merged_calls"] <= hand["calls"] <= 10 and hand["psnr"] > 0
    assert hand["stack"]["cache"] == "LazyCache" and hand["stack"]["setting"] == "merges with its settings as set"
    # the basic node found LazyCache at 0.5 and took its stack setting
    assert node["stack"]["cache"] == "LazyCache" and node["stack"]["settings"]["threshold"] == 0.5
    assert node["stack"]["ratio"] == 0.3 and node["merged_calls"] > 0
    line = next(line for line in done.stdout.splitlines() if line.startswith("lc0.5+node "))
    assert "merges at ratio 0.3" in line and f"{node['calls']} ({node['merged_calls']})" in line
    # the correction: the calls that chose destinations ran unmerged too (not counted as calls), each priced whole
    corr = rows["lc0.5+r0.3+corr"]
    assert 0 < corr["unmerged_runs"] <= corr["merged_calls"] <= corr["calls"] <= 10
    per_call = stack_levers.ARCHES["flux32"].per_call[0.3]
    assert corr["modelled"] == pytest.approx(
        10 / (corr["merged_calls"] / per_call + corr["calls"] - corr["merged_calls"] + corr["unmerged_runs"]))
    assert corr["psnr"] != hand["psnr"]
    # the cached reference serves the same settings only
    other = levers(comfy, "lc0.5", *setup[:-4], "--steps", "8", *setup[-2:])
    assert other.returncode != 0 and "made with" in other.stderr and "'steps': 10" in other.stderr
