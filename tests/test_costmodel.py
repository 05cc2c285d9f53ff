"""The cost model (toma_bench.costmodel): op recording on the meta device, pricing, flags and the command line.

Recording runs in a subprocess (tests/costmodel_probe.py, tiny models through the cost model's own code):
the cost model needs ComfyUI imported with PyTorch attention, which the in-process fixture does not choose.
Both hosts: the pinned tree (UNets) and COMFYUI_PATH (plus Flux where the tree has it, HiDream and LTX-2 in
the Nov-2025 tree, at tiny sizes through their real rows' code).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch

from toma_bench import comfy_host, costmodel, gpuclock, models
from toma_bench.oprecord import ATTENTION, ATTENTION_MASKED, Op, recording

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def probe():
    env = dict(os.environ)
    env.setdefault("COMFYUI_PATH", str(comfy_host.PINNED_TREE))
    if not (Path(env["COMFYUI_PATH"]) / "main.py").is_file():
        pytest.skip(f"no ComfyUI tree at {env['COMFYUI_PATH']} (run tests/setup_host.sh)")
    done = subprocess.run([sys.executable, str(REPO / "tests" / "costmodel_probe.py")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_comfyui_tome_on_sdxl_adds_no_op(probe):
    # SDXL has no attention at full resolution, where ComfyUI's ToMe merges: its patches return at once
    assert probe["sdxl_ops"] > 100
    assert probe["sdxl_identical"]


def test_toma_attention_runs_on_merged_keys(probe):
    # SD1.5 layout at a 16x16 latent: self-attention over 256 tokens at 1/1; 77 text tokens
    unpatched, toma = probe["sd15"]["unpatched"], probe["sd15"]["ToMA r=0.5"]
    assert 256 in unpatched["attention_keys"] and 77 in unpatched["attention_keys"]
    assert 128 in toma["attention_keys"] and 256 not in toma["attention_keys"]
    assert toma["merged"] == [["16x16 (1/1)", 256, 128]] or [m[1:] for m in toma["merged"]] == [[256, 128]]


def test_stages_are_tagged_through_the_stage_clock(probe):
    assert probe["sd15"]["ToMA r=0.5"]["stages"] == ["merge", "select", "unmerge"]
    assert probe["sd15"]["unpatched"]["stages"] == []


def test_every_model_call_is_recorded_and_reuse_steps_cost_less(probe):
    toma = probe["sd15"]["ToMA r=0.5"]
    assert toma["calls"] == 5  # 5 steps, cond and uncond batched in one call each
    kernels = toma["kernels_per_call"]
    # reuse 5: step 0 selects destinations and builds weights, steps 1-4 reuse destinations
    assert kernels[0] > kernels[1]
    assert len(set(kernels[1:])) == 1
    # the step's sigma, read once per model call, where the sampler cannot report its steps to the pack
    assert toma["syncs_per_call"] == (0.0 if probe["sampler_reports_steps"] else 1.0)


def test_kernels_per_merged_block_as_documented(probe):
    # docs/benchmarks.md, "Predicted on GPUs": on a GPU (the meta device stands for one) scope attention
    # adds one GEMM to merge and one to unmerge per merged self-attention, the windows folded into dense
    # operators (toma_core.plan.dense_operators); SD15_TINY has 5 blocks at 1/1 (2 down, 3 up)
    stages = probe["sd15"]["ToMA r=0.5"]["stage_kernels_step1"]
    assert stages["merge"] == 5 and stages["unmerge"] == 5
    assert stages["select"] > 0  # weights_interval 1: the weights are refreshed every step


def test_a_variant_that_cannot_merge_is_flagged(probe):
    # without a fixed count CA-ToMe's data-dependent read fails on meta: every plan falls back to unmerged
    assert probe["sd15"]["CA-ToMe, no fixed count"]["flag"] == "MERGED NOTHING"
    fixed = probe["sd15"]["CA-ToMe, count fixed"]
    assert fixed["flag"] == "" and [m[1:] for m in fixed["merged"]] == [[256, 192]]
    assert "MERGED NOTHING" in probe["table"]


def test_sweep_brackets_the_estimate(probe):
    for row in probe["sd15"].values():
        low, high = row["range"]
        assert low <= high


def test_flux_joint_attention_has_merged_image_tokens(probe):
    if "flux" not in probe:
        pytest.skip(comfy_host.CURRENT_ONLY)
    # 16x16 latent -> 8x8 = 64 image tokens + 16 text tokens; r=0.5 keeps 32 image tokens
    assert 80 in probe["flux"]["unpatched"]["attention_keys"]
    assert 48 in probe["flux"]["ToMA r=0.5"]["attention_keys"]


def test_hidream_row_routes_its_experts_evenly(probe):
    if "hidream" not in probe:
        pytest.skip("no HiDream in this ComfyUI tree (COMFYUI_PATH=.comfyui-newest has it)")
    unpatched, toma = probe["hidream"]["unpatched"], probe["hidream"]["ToMA r=0.5"]
    # each of the 3 blocks' feed-forward selects its 4 experts' tokens by mask, reads and writes: 24 counts
    # read back per call; the patched run adds none where the sampler reports its steps to the pack (the
    # tree has SAMPLER_SAMPLE wrappers), else its read of the step's sigma
    assert unpatched["calls"] == 5 and set(unpatched["syncs_per_call"]) == {24}
    assert set(toma["syncs_per_call"]) == {24 if probe["sampler_reports_steps"] else 25}
    # 8x8 image tokens, 16 T5 + 16 Llama tokens before each block's 16 of its own Llama layer; the image-DiT
    # default merges whole blocks on every step, so no attention keeps all 64
    assert unpatched["attention_keys"] == [64 + 48] and toma["attention_keys"] == [32 + 48]
    assert sorted(m[1:] for m in toma["merged"]) == [[64, 32], [64, 32]]


def test_ltx2_row_calls_its_model_as_its_sampler_does(probe):
    if "ltx2" not in probe:
        pytest.skip("no LTX-2 here: a current ComfyUI tree and toma_bench/ltx2_source.py's mirror")
    unpatched, toma = probe["ltx2"]["unpatched"], probe["ltx2"]["ToMA r=0.5"]
    assert unpatched["calls"] == toma["calls"] == 5
    # video 5x5x7 = 175 tokens, audio 9, text 11: the video self-attention's keys merge to half; the audio,
    # the text and the video keys of the video-to-audio attention never merge
    assert unpatched["attention_keys"] == [9, 11, 175] and toma["attention_keys"] == [9, 11, 88, 175]
    assert toma["merged"] == [["video 5x5x7", 175, 88]]
    # driven as that tree's sampler reports its steps, the pack reads no sigma; the model itself never waits
    assert set(toma["syncs_per_call"]) == {0} and set(unpatched["syncs_per_call"]) == {0}


def test_every_family_of_2026_has_a_row_at_its_usual_size():
    rows = {spec.model_config: spec for spec in costmodel.SPECS.values()}
    assert {"ZImage", "Flux2", "HunyuanVideo15", "HiDream", "LTXV"} <= set(rows)
    ltx2 = [spec for spec in costmodel.SPECS.values() if spec.config is models.LTX2_FULL]
    # the template's two passes of 121 frames at 24 fps: 16 latent frames, 127 audio latents (25 a second)
    assert {spec.latent for spec in ltx2} == {((1, 128, 16, 11, 20), (1, 8, 127, 16)),
                                               ((1, 128, 16, 22, 40), (1, 8, 127, 16))}
    assert all(spec.tree is costmodel.LTX2_TREE for spec in ltx2)
    # MiniMax-H3 at 1344x768 (24 x 42 tokens a latent frame): 124 frames are 37 latent frames (2 + 5 per 17) and
    # 207 stereo audio latents (40 a second), the templates' 73 frames 22 and 122; 30 steps with CFG (15 recorded),
    # the distilled 8 steps and the templates' 4 at CFG 1; its timestep stays on the host, which reads it
    minimax = {spec.name: spec for spec in costmodel.SPECS.values() if spec.config is models.MINIMAX_H3_FULL}
    assert {name: (spec.latent, spec.steps, spec.cfg > 1) for name, spec in minimax.items()} == {
        "minimax_h3": (((1, 24, 37, 48, 84), (1, 32, 2, 207)), 15, True),
        "minimax_h3_8step": (((1, 24, 37, 48, 84), (1, 32, 2, 207)), 8, False),
        "minimax_h3_template": (((1, 24, 22, 48, 84), (1, 32, 2, 122)), 4, False)}
    assert all(spec.host_timestep for spec in minimax.values())


def test_qwen_image21_rows_at_1024_and_2048_build_the_7b_model_where_the_tree_or_its_stand_in_has_it(pack):
    """Qwen-Image 2.1 at 1024 (64 x 64 = 4,096 target tokens) and 2048 (16,384), 40 steps without CFG, its prefix
    cache off (its key compare cannot run on meta); the model is ComfyUI's own or, in a tree without it, the
    stand-in, at the real size: 32 blocks of width 4096, about 7B parameters, served by its family."""
    rows = {spec.name: spec for spec in costmodel.SPECS.values() if spec.model_config == "QwenImage21"}
    assert {name: (spec.latent, spec.steps, spec.cfg) for name, spec in rows.items()} == {
        "qwen_image21": ((1, 64, 64, 64), 40, 1.0), "qwen_image21_2048": ((1, 64, 128, 128), 40, 1.0)}
    assert all(spec.transformer_options == {"qwen_image21_cache": {"device": "off"}} for spec in rows.values())
    spec = rows["qwen_image21"]
    reason = costmodel.missing(spec)
    if reason:
        pytest.skip(reason)
    with costmodel.model_classes(spec):
        model = costmodel.build_meta(spec)
        dm = model.model.diffusion_model
        assert (len(dm.transformer_blocks), dm.inner_dim) == (32, 4096)
        assert 6.5e9 < sum(p.numel() for p in dm.parameters()) < 7.5e9
        assert pack.nodes.adapters.adapter_for(model) is pack.nodes.adapters.families.QWEN_IMAGE21


# -- pricing (no ComfyUI) ---------------------------------------------------------------------------------
def test_a_mask_index_on_meta_selects_its_share_and_waits_for_the_count():
    x, mask = torch.empty(8, 4, device="meta"), torch.empty(8, dtype=torch.bool, device="meta")
    with recording() as rec:
        rec.meta_mask_share = 0.25
        with rec.model_call():
            picked = x[mask]
            x[mask] = picked
    assert picked.shape == (2, 4)
    assert [op.name for op in rec.calls[0] if op.sync] == ["nonzero", "nonzero"]
    with pytest.raises(RuntimeError, match="meta_mask_share"), recording() as rec:
        with rec.model_call():
            x[mask]


def op(cls="elementwise", flops=0, nbytes=0, kernel=True, sync=False, key_len=0, stage=None):
    return Op("x", cls, flops, nbytes, kernel, sync, key_len, stage)


H200 = gpuclock.PROFILES["h200"]


def test_pipelined_overlaps_host_and_gpu_and_additive_does_not():
    ops = [op("gemm", flops=10**12, nbytes=10**6)] + [op(nbytes=10) for _ in range(10)]
    piped, added = gpuclock.call_cost(ops, H200, "pipelined"), gpuclock.call_cost(ops, H200, "additive")
    assert added.seconds == pytest.approx(piped.gpu + piped.host)
    assert max(piped.gpu, piped.host) <= piped.seconds < added.seconds


def test_a_sync_makes_the_host_wait():
    big = op("gemm", flops=10**13)
    free = gpuclock.call_cost([big] + [op(nbytes=10)] * 200, H200)
    synced = gpuclock.call_cost([big, op(kernel=False, sync=True, cls="host")] + [op(nbytes=10)] * 200, H200)
    # unsynced, the 200 small kernels queue behind the GEMM; after the wait the host issues them one by one,
    # and the GPU runs the last one after it is issued
    waited = (200 * (H200.host_us_per_kernel - H200.kernel_min_us) + H200.kernel_min_us) * 1e-6
    assert synced.seconds == pytest.approx(free.seconds + waited, rel=1e-4)


def test_masked_attention_is_priced_off_flashattention():
    plain = H200.gpu_seconds(op(ATTENTION, flops=10**12, nbytes=10**6, key_len=4096))
    masked = H200.gpu_seconds(op(ATTENTION_MASKED, flops=10**12, nbytes=10**6, key_len=4096))
    assert masked > 1.5 * plain


def test_small_kernels_cost_at_least_the_launch_gap_and_large_ones_their_bytes():
    assert H200.gpu_seconds(op(nbytes=8)) == pytest.approx(H200.kernel_min_us * 1e-6)
    assert H200.gpu_seconds(op(nbytes=4 * 10**9)) == pytest.approx(4e9 / (4.8e12 * 0.8))


def test_hardware_from_a_json_file_and_clear_errors(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"name": "mine", "peak_tflops": 100.0, "bandwidth_tbs": 1.0}))
    assert gpuclock.profile(str(path)).peak_tflops == 100.0
    path.write_text(json.dumps({"name": "mine", "peak_tflops": 100.0, "bandwidth_tbs": 1.0, "speed": 3}))
    with pytest.raises(ValueError, match="unknown hardware fields"):
        gpuclock.profile(str(path))
    with pytest.raises(ValueError, match="--hardware must be one of"):
        gpuclock.profile("h300")


def test_sweep_changes_one_assumption_at_a_time():
    changed = [name for name, p in gpuclock.swept(H200)]
    assert len(changed) == 2 * len(gpuclock.SWEEP)
    assert all(p.gemm_eff <= 0.95 for _, p in gpuclock.swept(H200))


def test_command_line_explains_columns_and_refuses_bad_input(capsys):
    with pytest.raises(SystemExit):
        costmodel.parse_args(["--help"])
    help_text = capsys.readouterr().out
    for column in ("ms/step", "speed-up", "range", "GFLOP/step", "sel/mrg/unm %", "kernels/step", "syncs/call",
                   "merged"):
        assert column in help_text
    assert "graph replay" in help_text and "inductor" in help_text
    assert costmodel.parse_args(["--regimes", "eager,compiled"]).regimes == ["eager", "compiled"]
    assert costmodel.parse_args(["--regimes", "compiled+graphs"]).regimes == ["compiled+graphs"]
    for bad in (["--models", "sd4"], ["--hardware", "h200,tpu"], ["--steps", "0"], ["--regimes", "eager,jit"]):
        with pytest.raises(SystemExit) as exit_info:
            costmodel.parse_args(bad)
        assert exit_info.value.code == 2
        assert bad[0] in capsys.readouterr().err


# -- the host and the regimes (no ComfyUI) ---------------------------------------------------------------
def test_datacenter_host_is_priced_from_published_eager_against_graph_timings():
    # 30-45 ms of host time a step for SD1.5 on an A100: 20-35 us per kernel-launching op; --sweep covers it
    for name in gpuclock.DATACENTER:
        hw = gpuclock.PROFILES[name]
        assert 20 <= hw.host_us_per_kernel <= 35
        hosts = {p.host_us_per_kernel for label, p in gpuclock.swept(hw) if label.startswith("host_us_per_kernel")}
        assert min(hosts) <= 20 and max(hosts) >= 35
    assert {gpuclock.PROFILES[name].host_us_per_kernel for name in gpuclock.DESKTOP} == {5.0}


def test_graph_replay_pays_the_host_per_graph_not_per_kernel():
    small = [op(nbytes=10) for _ in range(1000)]
    eager = gpuclock.call_cost(small, H200, regime="eager")
    graphs = gpuclock.call_cost(small, H200, regime="graphs")
    assert eager.host == pytest.approx(1000 * H200.host_us_per_kernel * 1e-6)
    assert graphs.graphs == 1 and graphs.host == pytest.approx(H200.host_us_per_graph * 1e-6)
    assert graphs.seconds == pytest.approx((H200.host_us_per_graph + 1000 * H200.replay_kernel_min_us) * 1e-6)
    # a read-back cannot sit inside a graph: it ends one, and the next kernel starts another
    split = gpuclock.call_cost(small[:500] + [op(kernel=False, sync=True, cls="host")] + small[500:], H200,
                               regime="graphs")
    assert split.graphs == 2 and split.seconds > graphs.seconds
    with pytest.raises(ValueError, match="regime must be one of"):
        gpuclock.call_cost(small, H200, regime="jit")


def test_regimes_are_what_users_run():
    # ComfyUI's TorchCompileModel compiles with inductor and mode None: fusion without graph replay
    assert list(gpuclock.REGIMES) == ["eager", "graphs", "compiled", "compiled+graphs"]
    compiled, reduce_overhead = gpuclock.REGIMES["compiled"], gpuclock.REGIMES["compiled+graphs"]
    assert compiled.fuse and not compiled.replay and reduce_overhead.fuse and reduce_overhead.replay
    assert [r.traced for r in gpuclock.REGIMES.values()] == [False, True, True, True]


def test_compiled_code_launches_each_fused_kernel_from_the_host():
    gemm = op("gemm", flops=10**6, nbytes=10)
    chain = [op(nbytes=10), op("view", kernel=False), op(nbytes=10)]
    ops = [gemm, *chain, gemm, *chain]  # inductor: gemm, fused chain, gemm, fused chain
    hw = H200
    compiled = gpuclock.call_cost(ops, hw, regime="compiled")
    assert compiled.kernels == 4 and compiled.graphs == 1
    assert compiled.host == pytest.approx((hw.host_us_per_compiled_call + 4 * hw.host_us_per_compiled_kernel) * 1e-6)
    replayed = gpuclock.call_cost(ops, hw, regime="compiled+graphs")
    assert replayed.kernels == 4 and replayed.host == pytest.approx(hw.host_us_per_graph * 1e-6)
    # many small kernels: the compiled host, not the GPU, sets the pace; replayed, the GPU does
    small = [op(nbytes=10) if i % 2 else gemm for i in range(2000)]
    many = gpuclock.call_cost(small, hw, regime="compiled")
    assert many.seconds == pytest.approx(many.host, rel=1e-3) and many.host > many.gpu  # the last kernel runs after
    assert gpuclock.call_cost(small, hw, regime="compiled+graphs").seconds < many.seconds
    # a read-back breaks the graph: the guards run again when the next kernel enters it
    split = gpuclock.call_cost(ops + [op(kernel=False, sync=True, cls="host")] + ops, hw, regime="compiled")
    assert split.graphs == 2
    assert split.host == pytest.approx((2 * hw.host_us_per_compiled_call + 8 * hw.host_us_per_compiled_kernel
                                        + hw.host_us_per_kernel) * 1e-6)


def test_compiled_launch_cost_is_the_published_one():
    # inductor's per-kernel launch 6.8-9.1 us and a one-kernel graph 42-44 us end to end on a datacenter
    # host (meta-pytorch/tritonbench#1017); a fast desktop CPU below it; the sweep reaches both ends
    for name in gpuclock.DATACENTER:
        hw = gpuclock.PROFILES[name]
        assert 6.8 <= hw.host_us_per_compiled_kernel <= 9.1
        assert 42 <= hw.host_us_per_compiled_call + hw.host_us_per_compiled_kernel <= 46
        swept = {p.host_us_per_compiled_kernel for label, p in gpuclock.swept(hw)
                 if label.startswith("host_us_per_compiled_kernel")}
        assert min(swept) <= 6.8 and max(swept) >= 18
    for name in gpuclock.DESKTOP:
        hw = gpuclock.PROFILES[name]
        assert hw.host_us_per_compiled_kernel < gpuclock.PROFILES["h200"].host_us_per_compiled_kernel


def test_inductor_fuses_elementwise_chains_one_kernel_per_reduction():
    gemm = op("gemm", flops=10**9, nbytes=10**6)
    view = op("view", kernel=False)
    chain = [op(nbytes=100), view, op("copy", nbytes=300), op(nbytes=200)]
    reduction = Op("sum", "elementwise", 0, 50, True, False, 0, None)
    ops = [gemm, *chain, gemm, *chain, reduction, op(nbytes=10), reduction, gemm]
    out = gpuclock.fused(ops)
    kernels = [o for o in out if o.kernel]
    # gemm, chain, gemm, chain+sum+pointwise, sum, gemm
    assert [o.cls for o in kernels] == ["gemm", "elementwise", "gemm", "elementwise", "elementwise", "gemm"]
    assert kernels[1].bytes == 300  # the largest op it holds
    compiled = gpuclock.call_cost(ops, H200, regime="compiled")
    assert compiled.kernels == 6 and gpuclock.call_cost(ops, H200, regime="graphs").kernels == 12
    # a merge stage's ops fuse among themselves, not with the model's
    staged = [op(nbytes=10), op(nbytes=10, stage="merge"), op(nbytes=10, stage="merge")]
    assert [o.stage for o in gpuclock.fused(staged)] == [None, "merge"]


def test_kernel_budget_counts_what_the_default_adds_by_stage():
    def recorded(label, calls):
        return costmodel.Recorded(label, calls, 2, [], True, [])

    model = [op("gemm", flops=10**9, nbytes=10**6), op(nbytes=10), op(nbytes=10)]
    toma = model + [op(nbytes=10, stage="select")] * 3 + [op(nbytes=10, stage="merge")] * 2
    budget = costmodel.kernel_budget([recorded("unpatched", [model] * 2),
                                      recorded("ToMA default (r=0.75)", [toma] * 2)], H200)
    assert budget["kernels"]["eager"] == (3.0, 8.0)
    assert budget["kernels"]["compiled"] == (2.0, 4.0)  # the model's chain, the select and merge chains
    assert budget["eager_by_stage"] == {"select": 3.0, "merge": 2.0, "unmerge": 0.0, "model": 0.0}
    assert budget["eager_host_ms"] == pytest.approx(5 * H200.host_us_per_kernel / 1000)
    assert "+5" in costmodel.budget_line(budget)
    assert costmodel.kernel_budget([recorded("unpatched", [model])], H200) is None


def test_the_default_is_recorded_again_with_the_host_pace_rule_stopping(probe):
    paced = probe["paced"]
    deciding, _ = paced["rule"]
    assert paced["merged_calls"] == [True] * 5
    assert paced["paced_merged_calls"] == [True] * deciding + [False] * (5 - deciding)
    assert not any(paced["others"])  # only the node's default row: other settings and the baselines have none


def test_the_host_pace_rule_is_priced_where_the_clock_finds_the_host_setting_the_pace():
    def recorded(label, calls, paced=None):
        return costmodel.Recorded(label, calls, len(calls), [], True, [], paced=paced,
                                  pace_rule=None if paced is None else (2, 0.05))

    def run(model, merged, stopped_after=None):
        calls = [model + merged if stopped_after is None or i < stopped_after else model for i in range(6)]
        return recorded("ToMA default" if stopped_after is None else "stopped", calls)

    merging = [op(nbytes=10, stage="merge")] * 40  # what merging adds: kernels, little GPU work
    for model, host_bound in (([op("gemm", flops=10**9)] + [op(nbytes=10)] * 200, True), ([op("gemm", flops=10**13)] * 2, False)):
        cost = gpuclock.call_cost(model + merging, H200)
        assert cost.host_bound(0.05) == host_bound and cost.host_end > 0 and cost.gpu_end > 0
        base = recorded("unpatched", [model] * 6)
        default = run(model, merging)
        default.paced, default.pace_rule = run(model, merging, stopped_after=2), (2, 0.05)
        ran, stops = costmodel.with_rule(default, H200, "pipelined", "eager")
        assert stops == host_bound and ran is (default.paced if host_bound else default)
        for regime in ("graphs", "compiled"):  # under torch.compile the rule stays out
            assert costmodel.with_rule(default, H200, "pipelined", regime) == (default, False)
        rows = costmodel.price([base, default], H200, "pipelined", sweep=True)
        assert [r.label for r in rows] == ["unpatched", "ToMA default", "ToMA default + host-pace rule"]
        rule = rows[-1]
        assert rule.flag == ("host-bound: merging stops after 2 calls" if host_bound else "GPU-bound: merges on")
        assert rule.speed_range is not None
        if host_bound:  # 2 of 6 calls pay for the merging: between the default and unpatched
            assert rows[1].speed_up < rule.speed_up < 1.0
            assert rule.ms_per_step == pytest.approx(rows[1].ms_per_step / 3 + rows[0].ms_per_step * 2 / 3)
        else:
            assert rule.speed_up == rows[1].speed_up
    assert recorded("ToMA default", [[op()]]).paced is None
    assert costmodel.with_rule(recorded("ToMA default", [[op()]]), H200, "pipelined") == (
        recorded("ToMA default", [[op()]]), False)


def test_variants_are_chosen_by_parts_of_their_labels():
    variants = [costmodel.Variant(label) for label in ("unpatched", "ToMA default (r=0.75)", "ToMA r=0.5", "ToMeSD r=0.5")]
    assert [v.label for v in costmodel.select_variants(variants, ["default"])] == ["unpatched", "ToMA default (r=0.75)"]
    assert len(costmodel.select_variants(variants, ["R=0.5"])) == 3
    assert costmodel.select_variants(variants, None) == variants
    with pytest.raises(ValueError, match="match no variant"):
        costmodel.select_variants(variants, ["nothing"])


def test_graph_replay_prices_the_traced_recording():
    def recorded(label, calls, traced=None):
        return costmodel.Recorded(label, calls, 1, [], True, [], traced)

    eager = [op("gemm", flops=10**9, nbytes=10**6)]
    traced = [op("copy", nbytes=10), op("gemm", flops=10**9, nbytes=10**6)]
    r = recorded("ToMA", [eager], recorded("ToMA", [traced]))
    assert r.calls_in("eager") == [eager] and r.calls_in("graphs") == [traced]
    assert len(r.calls_in("compiled")[0]) == 2 and r.calls_in("compiled+graphs") == r.calls_in("compiled")
    assert recorded("unpatched", [eager]).calls_in("graphs") == [eager]


def test_ranks_are_checked_and_each_ranks_collectives_priced_per_block(capsys):
    """--ranks and --link refuse bad input; a rank's collectives: what each all-to-all and the all-gather send
    (UlyssesMeta, on meta), summed per block (8 all-to-alls: self- and cross-attention's q, k, v, out) and
    priced on a link per model call."""
    for bad in (["--ranks", "1"], ["--ranks", "2,x"], ["--ranks", "2", "--link", "nvlink,carrier-pigeon"]):
        with pytest.raises(SystemExit) as exit_info:
            costmodel.parse_args(bad)
        assert exit_info.value.code == 2
        assert bad[-2] in capsys.readouterr().err
    args = costmodel.parse_args(["--ranks", "8,2,2", "--link", "nvlink,pcie4"])
    assert args.ranks == [2, 8] and args.link == ["nvlink", "pcie4"]
    ulysses = costmodel.UlyssesMeta(4)
    x = torch.empty(2, 10, 8, device="meta", dtype=torch.bfloat16)
    assert ulysses.all_gather(x, 1).shape == (2, 40, 8)
    assert ulysses.collectives == [("all-gather", 3 * 2 * 10 * 8 * 2)]
    recorded = costmodel.Recorded("r", calls=[[], [], [], []], steps=2, merged=[], patched_by_pack=False, failed=[])
    rank = costmodel.RankRecording(4, recorded, [("q", 1e9)] * 16 + [("all-gather", 2e9)])
    assert rank.block_bytes() == [8e9, 8e9]
    link = costmodel.Link("test", 100.0, 10.0, "")
    assert rank.comm_seconds(link) == pytest.approx(2 * (17 * 10e-6 + 18e9 / 100e9))  # 2 model calls a step
