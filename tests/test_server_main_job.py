"""``python -m toma_bench.main_job`` end to end on a tiny checkpoint, and its graph splitting."""
import numpy as np
import pytest
from PIL import Image

from toma_bench import server
from toma_bench import main_job

TINY_SD15 = {"channel_mult": [1, 2], "num_res_blocks": [1, 1], "transformer_depth": [1, 1],
             "transformer_depth_output": [1, 1, 1, 1]}


def test_comparison_graph_splits_into_one_prompt_per_method():
    graph = server.load_workflow(main_job.WORKFLOW)

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


@pytest.mark.comfy  # looks in the tree's models/checkpoints (imports nothing from it)
def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="nope.safetensors"):
        main_job.main(["--ckpt", "nope.safetensors", "--output", str(tmp_path)])


@pytest.mark.server
def test_main_job_runs_all_methods_and_writes_pictures(comfy, tmp_path, capsys):
    from toma_bench import models

    checkpoint = tmp_path / "models" / "checkpoints" / "tiny.safetensors"
    checkpoint.parent.mkdir(parents=True)
    models.save_sd15_checkpoint(checkpoint, seed=0, config=dict(models.SD15_SMALL, **TINY_SD15), vae=True)
    output = tmp_path / "out"

    code = main_job.main(["--ckpt", "tiny.safetensors", "--models-dir", str(tmp_path / "models"),
                          "--size", "64", "--steps", "2", "--output", str(output)])

    printed = capsys.readouterr().out
    assert code == 0, printed
    for label in ("unpatched", "toma", "tomesd"):
        assert np.asarray(Image.open(output / f"{label}.png")).shape[:2] == (64, 64)
    assert Image.open(output / "side_by_side.png").size == (3 * 64, 64 + 24)
    assert (output / "comfyui.log").is_file()
    rows = {line.split()[0]: line.split()[1:] for line in printed.splitlines() if line.endswith("/255")}
    assert sorted(rows) == ["ToMA", "ToMeSD", "unpatched"], printed
    assert rows["unpatched"][1] == "1.00x"  # speed-ups are against the unpatched run
    for name, (sampling, speedup, prompt, cpu, *_) in rows.items():
        assert sum(line.split()[:3] == [name, "step", "2/2"] for line in printed.splitlines()) == 1, printed
        assert 0 < float(sampling) <= float(prompt) and float(cpu) > 0
    assert "attention: sdpa -> Using pytorch" in printed
    assert "no text encoder: random test conditioning" in printed
