"""``python -m toma_bench.main_job`` end to end (on a tiny proxy file and on a tiny checkpoint), its graphs,
its run order and its busy-machine warnings."""
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from toma_bench import comfy_host, comfy_requirements, main_job, server

REPO = comfy_host.REPO

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


def test_busy_warnings_on_several_threads_say_to_run_on_one():
    """On a busy machine the CPU times of 2 server threads scattered as much as the wall times (4.4-28.6 s): the
    warning must not send the reader to them, but to --threads 1."""
    busy = (1.8, 3.5, 2)
    runs = [main_job.Timing(1.5, 1.0)]

    several, one = main_job.busy_warnings(*busy, 2, runs)[-1], main_job.busy_warnings(*busy, 1, runs)[-1]

    assert "--threads 1" in several and "with 2 server threads the CPU-time columns too" in several
    assert "--threads" not in one and "read the CPU-time columns" in one


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


def started_server(monkeypatch) -> list[dict]:
    """Records the settings of each server the job starts (its main.py options and environment) instead of
    starting it; the job then fails as if the server had not started."""
    started = []

    @contextlib.contextmanager
    def comfy_server(workdir, *extra, env=None, **settings):
        started.append({"extra": extra, "env": env, **settings})
        raise server.ServerError("not started (the test records its settings)")
        yield

    monkeypatch.setattr(server, "comfy_server", comfy_server)
    return started


@pytest.mark.comfy  # finds the tree (imports nothing from it)
@pytest.mark.parametrize("argv, threads", [([], "1"), (["--threads", "2"], "2")])
def test_the_server_runs_on_one_thread_unless_told(tmp_path, monkeypatch, capsys, argv, threads):
    """One server thread by default: with 2 on a busy machine the headline flipped from faster to slower."""
    started = started_server(monkeypatch)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    assert main_job.main(argv + ["--output", str(tmp_path)]) == 1

    assert [run["env"] for run in started] == [{"OMP_NUM_THREADS": threads}]
    assert f", {threads} server CPU thread(s)" in capsys.readouterr().out


@pytest.mark.comfy
def test_threads_below_one_are_refused(tmp_path, monkeypatch):
    started_server(monkeypatch)

    with pytest.raises(SystemExit, match="--threads at least 1"):
        main_job.main(["--threads", "0", "--output", str(tmp_path)])


def v0_33_tree(tmp_path) -> Path:
    """A folder that looks like ComfyUI v0.33.0 to the job (main.py, comfy/, its requirements.txt)."""
    tree = tmp_path / "ComfyUI"
    (tree / "comfy").mkdir(parents=True)
    (tree / "main.py").write_text("")
    (tree / "requirements.txt").write_text(V0_33_REQUIREMENTS)
    return tree


# ComfyUI v0.33.0's requirements.txt (2026-08), the part that matters here: start, and the optional ones
V0_33_REQUIREMENTS = """comfyui-frontend-package==1.49.6
torch
torchvision
numpy>=1.25.0
aiohttp>=3.11.8
psutil
alembic
SQLAlchemy>=2.0.0
blake3

#non essential dependencies:
kornia>=0.7.1
spandrel
"""


def test_what_a_tree_needs_is_read_from_its_requirements(tmp_path, monkeypatch):
    """SQLAlchemy and alembic missing (the harness's venv as tests/setup_host.sh makes it): they are named, an
    optional package missing is not."""
    absent = {"sqlalchemy", "alembic", "kornia"}
    monkeypatch.setattr(comfy_requirements, "is_installed", lambda name: name.lower() not in absent)

    assert comfy_requirements.missing(v0_33_tree(tmp_path)) == ["alembic", "SQLAlchemy>=2.0.0"]
    assert comfy_requirements.missing(tmp_path) == []  # no requirements.txt: nothing known to check


def test_a_tree_whose_requirements_are_missing_is_named_before_its_server_starts(tmp_path, monkeypatch):
    """The harness's venv on ComfyUI v0.33.0 failed with "No module named 'sqlalchemy'" from the server's log."""
    started = started_server(monkeypatch)
    monkeypatch.setattr(comfy_requirements, "is_installed", lambda name: name.lower() not in {"sqlalchemy"})
    tree = v0_33_tree(tmp_path)
    monkeypatch.setenv("COMFYUI_PATH", str(tree))

    with pytest.raises(SystemExit) as error:
        main_job.main(["--comfyui", str(tree), "--output", str(tmp_path / "out")])

    message = str(error.value)
    assert "SQLAlchemy>=2.0.0" in message and str(tree) in message and "--install-requirements" in message
    assert started == []


def test_install_requirements_installs_what_is_missing_and_keeps_torch(tmp_path, monkeypatch, capsys):
    installed = set()
    commands = []

    def pip(command, check):
        constraints = command[command.index("-c") + 1]
        commands.append((command, open(constraints).read().split()))
        installed.update(comfy_requirements.name_of(line).lower() for line in command[command.index("-c") + 2:])

    monkeypatch.setattr(comfy_requirements.subprocess, "run", pip)
    monkeypatch.setattr(comfy_requirements, "is_installed",
                        lambda name: name.lower() not in {"sqlalchemy", "alembic"} - installed)
    started = started_server(monkeypatch)
    tree = v0_33_tree(tmp_path)
    monkeypatch.setenv("COMFYUI_PATH", str(tree))

    assert main_job.main(["--comfyui", str(tree), "--install-requirements", "--output", str(tmp_path / "out")]) == 1

    ((command, pins),) = commands
    assert command[:4] == [sys.executable, "-m", "pip", "install"] and command[6:] == ["alembic", "SQLAlchemy>=2.0.0"]
    assert f"torch=={importlib.metadata.version('torch')}" in pins
    assert "installing what ComfyUI at" in capsys.readouterr().out and len(started) == 1  # then it starts


def test_the_server_client_needs_no_websocket_client():
    """A ComfyUI's own Python has aiohttp (its server runs on it) but not websocket-client."""
    hidden = "import sys; sys.modules['websocket'] = None; import toma_bench.server, toma_bench.main_job"
    done = subprocess.run([sys.executable, "-c", hidden], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


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


BLOCKER = """import importlib.machinery, json, os, sys

HIDDEN = set(json.loads(os.environ["TOMA_TEST_HIDDEN_MODULES"]))


class PathFinder(importlib.machinery.PathFinder):
    \"\"\"sys.path's finder, not finding the hidden modules (find_spec None, import ModuleNotFoundError).\"\"\"

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [PathFinder if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]
"""


def installed_by(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, with what they require in turn (their extras left out)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), [canonicalize_name(comfy_requirements.name_of(line)) for line in requirements]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in map(Requirement, requires):
            if not line.marker or line.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(line.name))
    return seen


@pytest.mark.server
def test_main_job_runs_in_a_python_with_only_what_comfyui_installs(comfy, tmp_path):
    """``--comfyui DIR`` run by that ComfyUI's own Python, which has the tree's requirements and not the
    harness's (websocket-client, pytest, ...): every module of an installed package outside the tree's
    requirements.txt (and what they require) is hidden from the job and from its server."""
    from packaging.utils import canonicalize_name

    tree = comfy
    allowed = installed_by(comfy_requirements.essential(tree))
    hidden = sorted(module for module, names in importlib.metadata.packages_distributions().items()
                     if not {canonicalize_name(name) for name in names} & allowed)
    assert "websocket" in hidden and "_pytest" in hidden  # what a ComfyUI's own Python lacks is hidden
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    write_random_proxy(tmp_path / "tiny_proxy.safetensors")
    env = dict(os.environ, TOMA_TEST_HIDDEN_MODULES=json.dumps(hidden),
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])))

    done = subprocess.run([sys.executable, "-m", "toma_bench.main_job", "--comfyui", str(tree), "--proxy",
                           str(tmp_path / "tiny_proxy.safetensors"), "--repeats", "1", "--steps", "2",
                           "--output", str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.rstrip().splitlines()[-1].startswith("[main-job] done")
    assert "[main-job] by CPU time, against unpatched: " in done.stdout


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


def test_constraints_pin_the_installed_torch_family_and_skip_what_is_absent(monkeypatch):
    """A Python without torchaudio (CI's) pins torch and torchvision and says nothing of torchaudio."""
    versions = {"torch": "2.14.1", "torchvision": "0.29.1"}
    monkeypatch.setattr(comfy_requirements, "installed_version", versions.get)
    assert comfy_requirements.constraints() == ["torch==2.14.1", "torchvision==0.29.1"]
