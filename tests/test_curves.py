"""``python -m toma_bench.curves``: its metric, its variant sets and a whole run on a tiny proxy in the
ComfyUI under test (a subprocess: the benchmark imports ComfyUI with its own settings)."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from toma_bench import comfy_host, curves, proxy, proxy_training
from toma_bench.metrics import ssim


def test_ssim_is_one_for_equal_pictures_and_falls_with_noise():
    g = torch.Generator().manual_seed(0)
    picture = torch.rand(2, 24, 24, 3, generator=g)
    assert ssim(picture, picture) == pytest.approx(1.0)
    noise = torch.randn(picture.shape, generator=g)
    scores = [ssim((picture + s * noise).clamp(0, 1), picture) for s in (0.02, 0.1, 0.3)]
    assert 1.0 > scores[0] > scores[1] > scores[2]
    assert ssim(picture, picture * 0.5) == pytest.approx(ssim(picture * 0.5, picture))  # symmetric


class FakeToMANodes:
    """What the variant builders read of the pack's toma_nodes module (nothing is patched here)."""

    DEFAULT_WINDOW, DEFAULT_REUSE = 4, 5
    ToMAPatchModelAdvanced = ToMeSDPatchModel = CAToMePatchModel = DiToPatchModel = object


def test_flux_methods_are_both_placements_every_step_and_one_in_three():
    labels = [v.label for v in curves.dit_methods(FakeToMANodes)]
    assert labels[0] == "unpatched" and len(labels) == 1 + 2 * 2 * len(curves.RATIOS)
    for scope in ("block", "attention"):
        for r in curves.RATIOS:
            assert f"ToMA {scope} r={r:g}" in labels and f"ToMA {scope}, 1 step in 3 r={r:g}" in labels


def test_video_methods_are_one_and_two_frame_windows_at_every_ratio():
    labels = [v.label for v in curves.video_methods(FakeToMANodes)]
    assert labels == ["unpatched"] + [f"ToMA {f}-frame windows r={r:g}" for f in (1, 2) for r in curves.RATIOS]


def test_unet_methods_sweep_every_baseline_knob():
    families = [v.family for v in curves.unet_methods(FakeToMANodes)]
    assert families.count("ToMeSD") == families.count("ComfyUI ToMe") == len(curves.RATIOS)
    assert families.count("CA-ToMe") == len(curves.THRESHOLDS)
    assert families.count("ToMA attention") == families.count("ToMA block") == len(curves.RATIOS)


def test_sdxl_sets_put_the_baselines_at_half_resolution_and_leave_out_comfyui_tome():
    """SDXL has no attention at 1/1: ToMeSD and CA-ToMe merge at 1/2 (max_downsample 2), where ToMA's levels
    "auto" merges; ComfyUI's ToMe, fixed at 1/1, would merge nothing."""
    for variants in (curves.unet_methods(FakeToMANodes, sdxl=True), curves.sdxl_placements(FakeToMANodes)):
        families = [v.family for v in variants]
        assert "ComfyUI ToMe" not in families and families.count("ToMeSD") >= 2 and "CA-ToMe" in families
    seen = {}

    class Recorder:
        def patch(self, model, ratio, max_downsample=1, **kwargs):
            seen.setdefault(ratio, []).append(max_downsample)
            return (model,)

    nodes = type("Nodes", (FakeToMANodes,), {"ToMeSDPatchModel": Recorder, "CAToMePatchModel": Recorder})
    for v in curves.sdxl_placements(nodes):
        if v.family in ("ToMeSD", "CA-ToMe"):
            v.patch("model")
    assert seen and all(d == [2] * len(d) for d in seen.values())


def test_dit_front_offers_the_attention_placement_only_on_images():
    image = [v.label for v in curves.dit_front(FakeToMANodes, video=False)]
    video = [v.label for v in curves.dit_front(FakeToMANodes, video=True)]
    assert image[0] == video[0] == "unpatched" and set(video) < set(image)
    assert {"ToMA block r=0.5", "ToMA block, start 0.2 r=0.5", "ToMA block, window 8 r=0.75"} <= set(video)
    assert any(label.startswith("ToMA attention") for label in image)
    assert not any(label.startswith("ToMA attention") for label in video)


def test_dit_front_offers_keys_values_with_its_fixes_on_images_and_video():
    for video in (False, True):
        labels = {v.label for v in curves.dit_front(FakeToMANodes, video=video)}
        assert {"ToMA keys/values r=0.75", "ToMA keys/values, proportional r=0.75",
                "ToMA keys/values, per block, proportional r=0.9",
                "ToMA keys/values, per block, shared destinations, proportional r=0.9"} <= labels


def test_dit_front_puts_dito_and_tomesd_beside_toma_on_images_and_video():
    for video in (False, True):
        labels = {v.label for v in curves.dit_front(FakeToMANodes, video=video)}
        assert {f"DiTo r={r:g}" for r in curves.RATIOS} | {"DiTo, no penalty r=0.5", "ToMeSD (DiT blocks) r=0.5"} <= labels


@pytest.mark.parametrize("argv, bad", [
    (["--arch", "flux", "--set", "placements"], "--set placements is for the UNet proxies"),
    (["--arch", "sdxl", "--set", "front"], "--set front is for the DiT proxies"),
    (["--arch", "flux32", "--set", "sparse"], "--set sparse is for the video proxies"),
    (["--arch", "sd15", "--real", "nope"], "--real"),
])
def test_cli_refuses_sets_the_proxy_cannot_run(argv, bad, capsys):
    with pytest.raises(SystemExit):
        curves.parse_args(argv)
    assert bad in capsys.readouterr().err


def test_setting_rows_are_the_advanced_nodes_inputs(pack):
    """--setting: the Advanced node's inputs by name, typed by the node's own input types; the rows are the
    unpatched model, the basic node at its defaults (the kind's ratio) and each setting."""
    tn = pack.nodes.toma_nodes
    text = "ratio=0.85,scope=keys/values,plan_per_block=true,start_percent=0.2,merge_every=2"
    assert curves.setting_values(tn, text) == {"ratio": 0.85, "scope": "keys/values", "plan_per_block": True,
                                               "start_percent": 0.2, "merge_every": 2}
    labels = [v.label for v in curves.named_settings(tn, [text, "ratio=0.5"])]
    assert labels == ["unpatched", "ToMA node default r=auto",
                      "ToMA scope keys/values, plan_per_block true, start_percent 0.2, merge_every 2 r=0.85",
                      "ToMA r=0.5"]
    assert curves.setting_values(tn, "ratio=0.5,scope=block,rotation=on") == {"ratio": 0.5, "scope": "block",
                                                                               "rotation": "on"}
    (_, _, rotating) = curves.named_settings(tn, ["ratio=0.5,scope=block,rotation=on"])
    assert rotating.label == "ToMA scope block, rotation on r=0.5"
    for bad, why in (("scope=block", "needs a ratio"), ("ratio=0.5,plan_per_block=yes", "true or false"),
                     ("ratio=0.5,window=8", "name=value pairs"), ("ratio=half", "a number"),
                     ("ratio=0.5,merge_every=1.5", "an integer")):
        with pytest.raises(ValueError, match=why):
            curves.setting_values(tn, bad)


def test_cli_prints_settings_and_frames_in_its_command(capsys):
    args = curves.parse_args(["--arch", "wan32", "--setting", "ratio=0.9,scope=keys/values", "--frames", "8"])
    assert args.frames == 8
    assert curves.command_line(args).startswith(
        "python -m toma_bench.curves --arch wan32 --setting ratio=0.9,scope=keys/values --side 64 --frames 8 ")
    assert "--frames" not in curves.command_line(curves.parse_args(["--arch", "wan32"]))
    for argv, bad in ((["--arch", "flux32", "--frames", "8"], "--frames is for the video proxies"),
                      (["--arch", "wan32", "--frames", "0"], "--frames must be at least 1")):
        with pytest.raises(SystemExit):
            curves.parse_args(argv)
        assert bad in capsys.readouterr().err


def test_cli_defaults_follow_the_proxy():
    """--side defaults to the proxy's training size, the speed axis to its family's real-size model; the
    printed command carries --real only where it is not the default."""
    args = curves.parse_args(["--arch", "flux32"])
    assert (args.side, args.real) == (64, "flux") and "--real" not in curves.command_line(args)
    args = curves.parse_args(["--arch", "sdxl", "--set", "placements"])
    assert (args.side, args.real) == (64, "sdxl")
    args = curves.parse_args(["--arch", "flux32", "--set", "fewsteps", "--steps", "8", "--real", "z_image_turbo"])
    assert args.side == 64 and curves.command_line(args).endswith("--real z_image_turbo")
    assert curves.parse_args(["--arch", "wan"]).side == 32


def test_a_run_on_a_tiny_proxy_prints_every_variant_and_draws(comfy, tmp_path):
    model = proxy.build("sd15", proxy.SD15_TINY, seed=0)  # random weights: merging changes pixels
    proxy_training.save(model, tmp_path / "tiny.safetensors", proxy.SD15_TINY, {"size": "tiny", "steps": 0})
    env = dict(os.environ, COMFYUI_PATH=str(comfy), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "toma_bench.curves", "--set", "toma", "--proxy",
                           str(tmp_path / "tiny.safetensors"), "--side", "8", "--batch", "1", "--steps", "3",
                           "--repeats", "2", "--out", str(tmp_path)],
                          cwd=comfy_host.REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "command: python -m toma_bench.curves --arch sd15 --set toma --side 8 --batch 1 --steps 3" in out
    # variant, modelled h200 speed-up (SD1.5 at real size, the default speed axis), FLOPs saved, PSNR, SSIM, ...
    found = {m.group(1).strip(): m.groups()[1:] for m in re.finditer(
        r"^(\S.*?)\s{2,}(\d+\.\d{3})x\s+(\d+\.\d)%\s+(inf|\d+\.\d\d)\s+\d\.\d{4}\s+\d\.\d{4}\s", out, re.M)}
    rows = {label: psnr for label, (_, _, psnr) in found.items()}
    assert rows["unpatched"] == "inf" and found["unpatched"][:2] == ("1.000", "0.0")
    # FLOPs saved: both ratios save, and differently. Not ordered: at r=0.75 SD1.5's 1/1 level keeps 1,024
    # tokens, within toma_core.plan.DENSE_MAX_MERGED, so its plans merge with dense operators (fewer
    # kernels, more FLOPs) where r=0.5's stay windowed
    saved = {r: float(found[f"ToMA defaults r={r}"][1]) for r in ("0.5", "0.75")}
    assert min(saved.values()) > 0 and saved["0.5"] != saved["0.75"]
    assert "speed axis: modelled h200 (SD1.5 512x512" in out
    labels = [v.label for v in curves.toma_settings(FakeToMANodes, "sd15")]
    assert set(rows) == set(labels)
    assert math.isfinite(float(rows["ToMA defaults r=0.75"]))  # merging moved the pictures
    for name in ("curves_sd15_toma_8.png", "curves_sd15_toma_8_samples.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_cli_prices_regimes_and_runs_chosen_variants(capsys):
    args = curves.parse_args(["--arch", "sdxl", "--set", "placements", "--regimes", "eager,graphs",
                              "--variants", "node default;start 0.25, weights every 5"])
    assert args.regimes == ["eager", "graphs"] and args.variants == ["node default", "start 0.25, weights every 5"]
    line = curves.command_line(args)
    assert "--regimes eager,graphs" in line and "--variants 'node default;start 0.25, weights every 5'" in line
    assert "--regimes" not in curves.command_line(curves.parse_args(["--arch", "sdxl"]))
    with pytest.raises(SystemExit):
        curves.parse_args(["--regimes", "eager,jit"])
    assert "--regimes" in capsys.readouterr().err


def test_cli_joins_settings_to_a_named_set_and_prices_more_models(capsys):
    """--setting with --set named: both sets of rows (--variants picks the set's); --also-real: more speed axes."""
    args = curves.parse_args(["--arch", "flux32", "--setting", "ratio=0.45,scope=block,rotation=on", "--set", "front",
                              "--variants", "DiTo r=;ToMeSD", "--also-real", "sd35"])
    assert (args.set, args.also_real) == ("front", ["sd35"])
    line = curves.command_line(args)
    assert "--setting ratio=0.45,scope=block,rotation=on --set front " in line and "--also-real sd35" in line
    alone = curves.parse_args(["--arch", "flux32", "--setting", "ratio=0.5"])
    assert alone.set is None and " --set " not in curves.command_line(alone)
    assert curves.parse_args(["--arch", "flux32"]).set == "methods"
    with pytest.raises(SystemExit):
        curves.parse_args(["--arch", "flux32", "--also-real", "sd35,nope"])
    assert "--also-real" in capsys.readouterr().err


def test_settings_rows_come_first_then_the_sets_picked_rows(pack):
    tn = pack.nodes.toma_nodes
    args = curves.parse_args(["--arch", "flux32", "--setting", "ratio=0.45,scope=block,rotation=on", "--set", "front",
                              "--variants", "DiTo r=;ToMeSD"])
    labels = [v.label for v in curves.variants_of(tn, args)]
    assert labels == ["unpatched", "ToMA node default r=auto", "ToMA scope block, rotation on r=0.45"] + [
        f"DiTo r={r:g}" for r in curves.RATIOS] + ["ToMeSD (DiT blocks) r=0.5", "ToMeSD (DiT blocks) r=0.75"]
    args = curves.parse_args(["--arch", "flux32", "--setting", "ratio=0.45", "--setting", "ratio=0.5,scope=block",
                              "--variants", "block"])
    assert [v.label for v in curves.variants_of(tn, args)] == ["unpatched", "ToMA scope block r=0.5"]


def test_fronts_draws_a_panel_per_rows_file_with_three_series(tmp_path):
    from toma_bench import fronts

    def row(family, setting, speed, psnr):
        return {"label": f"{family} {setting}", "family": family, "setting": setting,
                "speed_up": {"flux": speed, "sd35": speed * 2}, "psnr": psnr}

    data = {"arch": "flux32", "side": 128, "frames": None, "batch": 4, "steps": 20, "hardware": "h200",
            "regime": "eager", "real": {"flux": "FLUX.1-dev 1024x1024 (...)", "sd35": "SD3.5 Large 1024x1024 (...)"},
            "rows": [row("unpatched", "", 1.0, None), row("ToMA node default", "r=auto", 1.48, 22.5),
                     row("ToMA scope block", "r=0.5", 1.48, 22.0), row("ToMA scope block, rotation on", "r=0.4", 1.35, 25.9),
                     row("DiTo", "r=0.5", 1.24, 14.2), row("ToMeSD (DiT blocks)", "r=0.5", 0.89, 18.7)]}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(data))
    points = fronts.series(data, "sd35")
    assert points["ToMA"] == [(2.7, 25.9, "0.4", False), (2.96, 22.0, "0.5", True), (2.96, 22.5, "default", False)]
    assert points["DiTo"] == [(2.48, 14.2, "0.5", False)] and len(points["ToMeSD"]) == 1
    assert "the same pictures" in fronts.title(data, "sd35") and "64x64 tokens, 4 pictures" in fronts.title(data, "flux")
    fronts.main([str(path), f"{path}:sd35", "--out", str(tmp_path / "fronts.png")])
    assert (tmp_path / "fronts.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="not wan_720p"):
        fronts.main([f"{path}:wan_720p", "--out", str(tmp_path / "x.png")])
    # "+": a second run of the same setup joins the panel, its rows shared with the first checked, not repeated
    more = dict(data, rows=[row("unpatched", "", 1.0, None), row("ToMA node default", "r=auto", 1.48, 22.5),
                            row("ToMA scope block, rotation on", "r=0.3", 1.29, 27.4)])
    (tmp_path / "more.json").write_text(json.dumps(more))
    both, model = fronts.panel(f"{path}+{tmp_path / 'more.json'}:sd35")
    assert model == "sd35" and [r["setting"] for r in both["rows"]].count("r=auto") == 1
    assert (2.58, 27.4, "0.3", False) in fronts.series(both, model)["ToMA"]
    assert fronts.front([(1.2, 28.0), (1.3, 25.5), (1.5, 24.2), (2.5, 18.7), (2.5, 21.1), (1.4, 20.0)]) == [
        (1.2, 28.0), (1.3, 25.5), (1.5, 24.2), (2.5, 21.1)]  # ToMA's line: no point faster and closer beside it
    (tmp_path / "other.json").write_text(json.dumps(dict(more, frames=8)))
    with pytest.raises(ValueError, match="another run setup"):
        fronts.panel(f"{path}+{tmp_path / 'other.json'}")


# -- the step caches' fronts (--set caches) ----------------------------------------------------------------
def test_cli_takes_caches_and_their_stacks_and_prints_them_in_its_command(capsys):
    args = curves.parse_args(["--arch", "flux32", "--set", "caches", "--caches", "LazyCache=0.2,0.5;TeaCache",
                              "--stack-with", "default,0.3fixed", "--stacked-caches", "LazyCache"])
    assert args.caches == {"LazyCache": [0.2, 0.5], "TeaCache": [0.4]}  # a name alone: its node's default
    assert [curves.stack_toma(v) for v in ("default", "0.5", "0.3fixed")] == [(None, "auto"), (0.5, "on"), (0.3, "off")]
    assert ("--set caches --caches 'LazyCache=0.2,0.5;TeaCache=0.4' --stack-with default,0.3fixed "
            "--stacked-caches LazyCache --side 64") in curves.command_line(args)
    for argv, bad in ((["--caches", "FooCache=0.2"], "names are EasyCache"),
                      (["--caches", "LazyCache=0"], "LazyCache threshold: above 0"),
                      (["--caches", "LazyCache=a"], "LazyCache's thresholds"),
                      (["--stack-with", "0.3,1.5fixed"], "--stack-with: default, a ratio R (0 < R < 1) or Rfixed, got '1.5fixed'"),
                      (["--stack-with", "half"], "got 'half'"),
                      (["--caches", "LazyCache=0.2", "--stacked-caches", "TeaCache"], "caches of --caches")):
        with pytest.raises(SystemExit):
            curves.parse_args(["--arch", "flux32", "--set", "caches", *argv])
        assert bad in capsys.readouterr().err


def test_cache_rows_are_each_cache_alone_and_stacked_with_each_toma_row(pack, capsys):
    from toma_bench import step_caches

    tn = pack.nodes.toma_nodes
    rows = curves.cache_front(tn, "sd15", {"LazyCache": [0.2, 0.5], "TeaCache": [0.4]}, ["default", "0.3fixed"])
    said = capsys.readouterr().out
    assert "left out: TeaCache serves DiTs, not a sd15 model" in said  # and said why
    labels = [v.label for v in rows]
    toma = ["ToMA node default r=auto", "ToMA node default, rotation off r=0.3"]
    assert labels[:3] == ["unpatched", *toma]
    if "LazyCache: this ComfyUI has no" in said:  # a tree before core's caches: they are left out, and said why
        assert len(rows) == 3
        return
    assert labels[3:] == [f"{row} t={t}" for t in ("0.2", "0.5")
                          for row in ("LazyCache", *(f"LazyCache + {label}" for label in toma))]
    assert isinstance(rows[4].patch, step_caches.Stacked) and rows[4].patch.toma is not None
    assert rows[3].patch.toma is None and (rows[3].patch.name, rows[3].patch.threshold) == ("LazyCache", 0.2)
    alone = curves.cache_front(tn, "sd15", {"LazyCache": [0.2]}, ["default"], stacked=[])
    assert [v.label for v in alone] == ["unpatched", "ToMA node default r=auto", "LazyCache t=0.2"]


def test_fronts_draws_each_cache_and_each_stack_as_a_line(tmp_path):
    from toma_bench import fronts

    def row(family, setting, speed, psnr):
        return {"label": f"{family} {setting}", "family": family, "setting": setting, "speed_up": {"flux": speed},
                "psnr": psnr}

    data = {"arch": "flux32", "side": 128, "frames": None, "batch": 4, "steps": 20, "hardware": "h200",
            "regime": "eager", "real": {"flux": "FLUX.1-dev 1024x1024 (...)"},
            "rows": [row("unpatched", "", 1.0, None), row("ToMA node default", "r=auto", 1.48, 22.5),
                     row("ToMA node default, rotation off", "r=0.3", 1.29, 26.0),
                     row("LazyCache", "t=0.5", 2.0, 27.5), row("LazyCache", "t=0.2", 1.54, 34.2),
                     row("LazyCache + ToMA node default r=auto", "t=0.2", 2.1, 22.8),
                     row("LazyCache + ToMA node default, rotation on r=0.3", "t=0.2", 1.8, 27.9),
                     row("LazyCache + ToMA node default, rotation off r=0.3", "t=0.2", 1.9, 26.2),
                     row("TeaCache", "t=0.4", 1.9, 30.0)]}
    lines = fronts.cache_lines(data, "flux")
    assert lines == {("LazyCache", ""): [(1.54, 34.2, "0.2", False), (2.0, 27.5, "0.5", False)],
                     ("LazyCache", "ToMA default"): [(2.1, 22.8, "0.2", False)],
                     ("LazyCache", "ToMA r=0.3"): [(1.8, 27.9, "0.2", False)],
                     ("LazyCache", "ToMA r=0.3 fixed"): [(1.9, 26.2, "0.2", True)],
                     ("TeaCache", ""): [(1.9, 30.0, "0.4", False)]}
    # the ToMA rows beside them: the default rotates, the row that turns rotation off is fixed
    assert fronts.series(data, "flux")["ToMA"] == [(1.29, 26.0, "0.3", True), (1.48, 22.5, "default", False)]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(data))
    fronts.main([str(path), "--out", str(tmp_path / "fronts.png")])
    assert (tmp_path / "fronts.png").stat().st_size > 1000
