"""``python -m toma_bench.main_job`` end to end (on a tiny proxy file and on a tiny checkpoint), its graphs,
its run order and its busy-machine warnings."""
import json
import os
import types

import numpy as np
import pytest
from PIL import Image

from toma_bench import main_job, server

TINY_SD15 = {"channel_mult": [1, 2], "num_res_blocks": [1, 1], "transformer_depth": [1, 1],
             "transformer_depth_output": [1, 1, 1, 1]}
NAMES = ["unpatched", "ToMA", "ToMeSD"]
PICTURE = (3 * main_job.PANEL, 2 * (main_job.PANEL + main_job.CAPTION))  # 64-pixel pictures enlarged 4x


def proxy_graph() -> dict:
    return json.loads(main_job.PROXY_WORKFLOW.read_text())


def table_rows(printed: str) -> dict:
    """{method: its 7 table cells} from the printed table."""
    rows = [line.split() for line in printed.splitlines()]
    return {row[0]: row[1:] for row in rows if len(row) == 8 and row[0] in NAMES}


def round_lines(printed: str) -> list[tuple[str, str]]:
    """(round, method) of each per-run line, in print order."""
    return [(line.split()[2], line.split()[3]) for line in printed.splitlines()
            if line.startswith("[main-job] round ")]


@pytest.mark.parametrize("graph", [server.load_workflow(main_job.CKPT_WORKFLOW), proxy_graph()],
                         ids=["checkpoint", "proxy"])
def test_comparison_graph_splits_into_one_prompt_per_method(graph):
    parts = main_job.branches(graph)

    assert list(parts) == ["unpatched", "toma", "tomesd"]
    for label, (part, sampler) in parts.items():
        kinds = sorted(node["class_type"] for node in part.values())
        assert kinds.count("KSampler") == 1 and kinds.count("SaveImage") == 1, (label, kinds)
        assert part[sampler]["class_type"] == "KSampler"
        for node in part.values():  # closed: every link points inside the part
            assert all(value[0] in part for value in node["inputs"].values() if isinstance(value, list))
    patches = {label: {n["class_type"] for n in part.values()} & {"ToMAPatchModel", "ToMeSDPatchModel"}
               for label, (part, _) in parts.items()}
    assert patches == {"unpatched": set(), "toma": {"ToMAPatchModel"}, "tomesd": {"ToMeSDPatchModel"}}


def test_proxy_graph_is_the_shipped_comparison_on_the_proxy_nodes():
    shipped, graph = server.load_workflow(main_job.CKPT_WORKFLOW), proxy_graph()
    swapped = {"CheckpointLoaderSimple": "ToMAProxyLoader", "VAEDecode": "ToMAProxyDecode"}
    kept = [(i, n["class_type"]) for i, n in shipped.items() if n["class_type"] != "CLIPTextEncode"]
    assert [(i, swapped.get(kind, kind)) for i, kind in kept] == [(i, n["class_type"]) for i, n in graph.items()]
    loader = next(i for i, n in graph.items() if n["class_type"] == "ToMAProxyLoader")
    for node_id, node in graph.items():
        if node["class_type"] in ("ToMAPatchModel", "ToMeSDPatchModel", "SaveImage"):
            assert node["inputs"] == shipped[node_id]["inputs"]
        if node["class_type"] == "KSampler":  # the proxy is unconditional: its fixed conditioning both ways
            assert node["inputs"]["cfg"] == 1.0
            assert node["inputs"]["positive"] == node["inputs"]["negative"] == [loader, 1]

    configured = main_job.proxy_configured(main_job.DEFAULT_PROXY, 96, 7, 1.0)

    latent = next(n for n in configured.values() if n["class_type"] == "EmptyLatentImage")["inputs"]
    assert (latent["width"], latent["height"]) == (96 // 2 * 8, 96 // 2 * 8)  # 48x48 latent, 96-pixel pictures
    assert {n["inputs"]["steps"] for n in configured.values() if n["class_type"] == "KSampler"} == {7}
    assert configured["4"]["inputs"]["proxy"] == str(main_job.DEFAULT_PROXY)


def test_interleaved_rounds_rotate_the_first_method():
    labels = ["unpatched", "toma", "tomesd"]

    order = main_job.interleaved(labels, 3)

    assert [label for r, label in order if r == 0] == labels
    for r in range(3):
        assert sorted(label for rr, label in order if rr == r) == sorted(labels)
    assert [label for r, label in order[::3]] == ["unpatched", "toma", "tomesd"]  # each label first once
    firsts = [label for _, label in main_job.interleaved(labels, 5)[::3]]
    assert all(a != b for a, b in zip(firsts, firsts[1:]))  # never the same method first twice in a row


class RecordingClient:
    """A stand-in for server.Client that records each prompt it is asked to run and answers with one
    KSampler run (no server: the structure of the job's runs, not their times)."""

    pid = os.getpid()

    def __init__(self):
        self.prompts = []

    def run(self, prompt, timeout=600, on_message=None):
        self.prompts.append(prompt)
        sampler = next(i for i, node in prompt.items() if node["class_type"] == "KSampler")
        for node in (sampler, None):
            if on_message is not None:
                on_message("executing", {"node": node})
        return types.SimpleNamespace(node_seconds=lambda: {sampler: 1.0}, images=lambda: [])


def test_warm_up_runs_every_branch_as_the_rounds_run_it():
    """Round 1 must cost what the others do: before the first timed run, each method's branch ran once as
    its own prompt with all its steps, from a seed no timed run uses."""
    graph, seed, repeats = proxy_graph(), 42, 2
    parts = main_job.branches(graph)
    client = RecordingClient()

    timings, _ = main_job.timed_runs(client, graph, seed, repeats)

    warm_up, timed = client.prompts[:len(parts)], client.prompts[len(parts):]
    assert len(timed) == repeats * len(parts) and all(len(t) == repeats for t in timings.values())
    timed_seeds = {node["inputs"]["seed"] for p in timed for node in p.values() if node["class_type"] == "KSampler"}
    warm_seeds = set()
    for (part, sampler), prompt in zip(parts.values(), warm_up):
        assert set(prompt) == set(part)  # the branch alone, as its own prompt
        warm_seeds.add(prompt[sampler]["inputs"]["seed"])
        assert prompt[sampler]["inputs"]["steps"] == part[sampler]["inputs"]["steps"]
        assert {i: n for i, n in prompt.items() if i != sampler} == {i: n for i, n in part.items() if i != sampler}
    assert not warm_seeds & timed_seeds


@pytest.mark.parametrize("load_before, load_after, cores, threads, runs, expected", [
    (0.1, 1.2, 2, 2, [(1.0, 1.6)], []),  # quiet: one core busy, the other half used by the second thread
    (0.9, 1.9, 2, 1, [(1.0, 0.98)], []),  # one core taken by another job, the other free for 1 thread
    (0.9, 1.9, 2, 2, [(1.0, 1.0)], ["busy before"]),  # ... but 2 threads want both
    (1.8, 2.2, 2, 1, [(1.0, 0.98)], ["busy before"]),
    (0.2, 3.1, 2, 1, [(1.0, 0.98)], ["busy during"]),
    (0.2, 1.0, 2, 1, [(1.0, 0.98), (1.0, 0.5)], ["starved"]),  # a run that got half a core
    (0.2, 1.0, 2, 1, [(0.02, 0.0)], []),  # 20 ms with no CPU tick counted is clock resolution, not starving
    (3.7, 4.2, 2, 1, [(1.5, 1.0)] * 6, ["busy before", "busy during", "6 of 6 runs were starved"]),
])
def test_busy_warnings(load_before, load_after, cores, threads, runs, expected):
    warnings = main_job.busy_warnings(load_before, load_after, cores, threads,
                                      [main_job.Timing(wall, cpu) for wall, cpu in runs])

    if not expected:
        assert warnings == []
    else:
        assert len(warnings) == len(expected) + 1
        for warning, words in zip(warnings, expected):
            assert words in warning
        assert "wall-time ratios are unreliable" in warnings[-1] and "CPU-time columns" in warnings[-1]


def test_verdict_ranks_by_cpu_time_not_wall_time():
    """The issue's run: on a busy machine ToMA's wall time said 0.61x while its CPU time said 1.13x."""
    timing = main_job.Timing
    timings = {"unpatched": [timing(10.0, 9.0), timing(10.0, 9.0)], "toma": [timing(16.4, 8.0), timing(16.4, 8.0)],
               "tomesd": [timing(14.7, 9.9), timing(14.7, 9.9)]}

    assert main_job.verdict(timings) == "by CPU time, against unpatched: ToMA 1.12x faster, ToMeSD 1.10x slower"


@pytest.mark.comfy  # looks in the tree's models/checkpoints (imports nothing from it)
def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="nope.safetensors"):
        main_job.main(["--ckpt", "nope.safetensors", "--output", str(tmp_path)])


@pytest.mark.comfy  # finds the tree (imports nothing from it)
def test_missing_proxy_names_the_file_and_the_training_command(tmp_path, monkeypatch):
    monkeypatch.setattr(main_job, "DEFAULT_PROXY", tmp_path / "sd15_proxy.safetensors")

    with pytest.raises(SystemExit) as error:
        main_job.main(["--output", str(tmp_path)])

    assert str(tmp_path / "sd15_proxy.safetensors") in str(error.value)
    assert "python -m toma_bench.proxy_training train --arch sd15" in str(error.value)


def write_random_proxy(path):
    """A tiny SD1.x-layout proxy file with seeded random weights. A few training steps would leave its
    attention outputs near their zero start, so merging would change no pixel; random ones do."""
    from toma_bench import proxy, proxy_training

    model = proxy.build("sd15", proxy.SD15_TINY, seed=0)
    proxy_training.save(model, path, proxy.SD15_TINY, {"size": "tiny", "steps": 0})


@pytest.mark.server
def test_main_job_on_a_proxy_runs_interleaved_rounds_and_draws_differences(comfy, tmp_path, capsys):
    write_random_proxy(tmp_path / "tiny_proxy.safetensors")
    output = tmp_path / "out"

    code = main_job.main(["--proxy", str(tmp_path / "tiny_proxy.safetensors"), "--repeats", "2", "--steps", "3",
                          "--output", str(output)])

    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "workflow: toma_bench/workflows/sd15_proxy_compare_api.json, 64x64, 3 steps, cfg 1.0" in printed
    assert round_lines(printed) == [("1/2", "unpatched"), ("1/2", "ToMA"), ("1/2", "ToMeSD"),
                                    ("2/2", "ToMA"), ("2/2", "ToMeSD"), ("2/2", "unpatched")]
    assert "[main-job] settings: " in printed and "2 round(s)" in printed and "model tiny_proxy.safetensors" in printed
    rows = table_rows(printed)
    assert sorted(rows) == sorted(NAMES), printed
    assert rows["unpatched"][1] == rows["unpatched"][4] == "1.00x" and rows["unpatched"][6] == "-"
    for name, (wall, wall_speedup, wall_rounds, cpu, cpu_speedup, cpu_rounds, psnr) in rows.items():
        assert float(wall) > 0 and float(cpu) > 0
        # with 2 rounds the ratio of medians is (a1 + a2) / (b1 + b2), between the two per-round ratios
        for speedup, rounds in ((wall_speedup, wall_rounds), (cpu_speedup, cpu_rounds)):
            low, high = map(float, rounds[:-1].split("-"))
            assert low - 0.01 <= float(speedup[:-1]) <= high + 0.01, (name, speedup, rounds)
    images = {label: np.asarray(Image.open(output / f"{label}.png").convert("RGB"))
              for label in ("unpatched", "toma", "tomesd")}
    assert all(image.shape == (64, 64, 3) for image in images.values())
    for label, name in (("toma", "ToMA"), ("tomesd", "ToMeSD")):  # merging changes a random model's picture
        assert not np.array_equal(images[label], images["unpatched"])
        assert 0 < float(rows[name][6]) < 100
    assert "[main-job] by CPU time, against unpatched: " in printed
    picture = Image.open(output / "side_by_side.png").convert("RGB")
    assert picture.size == PICTURE
    # the bottom row: |ToMA - unpatched| x 4, clipped and enlarged 4x, in the middle column
    expected = np.clip(np.abs(images["toma"].astype(int) - images["unpatched"].astype(int)) * main_job.AMPLIFY, 0, 255)
    top = main_job.PANEL + 2 * main_job.CAPTION
    panel = np.asarray(picture)[top:top + main_job.PANEL, main_job.PANEL:2 * main_job.PANEL]
    assert np.array_equal(panel[::4, ::4], expected) and panel.max() > 0
    top_row = np.asarray(picture)[main_job.CAPTION:main_job.CAPTION + main_job.PANEL, :main_job.PANEL]
    assert np.array_equal(top_row[::4, ::4], images["unpatched"])
    assert (output / "comfyui.log").is_file()


@pytest.mark.server
def test_main_job_on_a_checkpoint_runs_all_methods_and_writes_pictures(comfy, tmp_path, capsys):
    from toma_bench import models

    checkpoint = tmp_path / "models" / "checkpoints" / "tiny.safetensors"
    checkpoint.parent.mkdir(parents=True)
    models.save_sd15_checkpoint(checkpoint, seed=0, config=dict(models.SD15_SMALL, **TINY_SD15), vae=True)
    output = tmp_path / "out"

    code = main_job.main(["--ckpt", "tiny.safetensors", "--models-dir", str(tmp_path / "models"),
                          "--size", "64", "--steps", "2", "--repeats", "1", "--output", str(output)])

    printed = capsys.readouterr().out
    assert code == 0, printed
    for label in ("unpatched", "toma", "tomesd"):
        assert np.asarray(Image.open(output / f"{label}.png")).shape[:2] == (64, 64)
    assert Image.open(output / "side_by_side.png").size == PICTURE
    assert (output / "comfyui.log").is_file()
    assert "workflow: workflows/sd15_compare_api.json, 64x64, 2 steps, cfg 7.0" in printed
    rows = table_rows(printed)
    assert sorted(rows) == sorted(NAMES), printed
    assert rows["unpatched"][1] == "1.00x"  # speed-ups are against the unpatched run
    assert round_lines(printed) == [("1/1", name) for name in NAMES]
    for name, (wall, _, _, cpu, *_) in rows.items():
        assert float(wall) > 0 and float(cpu) > 0
    assert "attention: sdpa -> Using pytorch" in printed
    assert "no text encoder: random test conditioning" in printed
