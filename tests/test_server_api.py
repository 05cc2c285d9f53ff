"""The pack inside a real headless ComfyUI (its own main.py, --cpu), driven over HTTP and the websocket.

The model is a real-architecture SD1.5 checkpoint with seeded random weights, written at test time
(SD1.5 widths so CheckpointLoaderSimple detects it, two UNet levels, a tiny TAESD as its VAE, no CLIP:
text conditioning comes from the test-only ToMATestConditioning node, toma_bench/testing_nodes).
"""
import io
import json

import numpy as np
import pytest
from PIL import Image

from node_info import COMPARED, canonical, v1_info
from toma_bench import comfy_host, server

pytestmark = [pytest.mark.server, pytest.mark.comfy]

CKPT = "toma-test-sd15.safetensors"
WIDTH, HEIGHT = 128, 96  # latent 16x12: not square, so a swapped axis shows
STEPS = 2
PACK_NODES = ("ToMAPatchModel", "ToMAPatchModelAdvanced", "ToMeSDPatchModel", "CAToMePatchModel", "DiToPatchModel")


@pytest.fixture(scope="module")
def client(comfy, tmp_path_factory):
    """A server with the pack, the test nodes and the random checkpoint in its checkpoints folder."""
    from toma_bench import models

    workdir = tmp_path_factory.mktemp("api-server")
    checkpoints = workdir / "checkpoints"
    checkpoints.mkdir()
    tiny = dict(models.SD15_SMALL, num_res_blocks=[1, 1], channel_mult=[1, 2], transformer_depth=[1, 1],
                transformer_depth_output=[1, 1, 1, 1])
    models.save_sd15_checkpoint(checkpoints / CKPT, seed=0, config=tiny, vae=True)
    with server.comfy_server(workdir, models={"checkpoints": checkpoints}) as client:
        yield client


def small(graph: dict, seed: int = 42) -> dict:
    """A shipped SD1.5 graph on the test checkpoint: test conditioning, WIDTHxHEIGHT, STEPS steps."""
    graph = server.use_test_conditioning(graph)
    graph = server.set_inputs(graph, "CheckpointLoaderSimple", ckpt_name=CKPT)
    graph = server.set_inputs(graph, "EmptyLatentImage", width=WIDTH, height=HEIGHT)
    return server.set_inputs(graph, "KSampler", steps=STEPS, seed=seed)


def png(client, image: dict) -> np.ndarray:
    picture = Image.open(io.BytesIO(client.view(**image)))
    assert picture.format == "PNG"
    return np.asarray(picture.convert("RGB"))


def test_object_info_lists_our_nodes_with_inputs_and_tooltips(client, pack):
    info = client.object_info()

    for name in PACK_NODES:
        assert name in info, f"{name} missing from /object_info"
        published = info[name]
        declared = pack.nodes.NODE_CLASS_MAPPINGS[name].INPUT_TYPES()
        assert published["display_name"] == pack.nodes.NODE_DISPLAY_NAME_MAPPINGS[name]
        assert published["category"] == "model_patches/token_merging"
        assert published["output"] == ["MODEL"]
        assert list(published["input"]["required"]) == list(declared["required"])
        for input_name, spec in published["input"]["required"].items():
            assert spec[1].get("tooltip", "").strip(), f"{name}.{input_name} has no tooltip"
        assert published["description"].strip()


def test_object_info_serves_each_node_as_its_declaration(client, pack):
    """V3 on a host with the schema, V1 on the pinned tree: /object_info shows what the V1 declaration says (the
    front end lays out widgets and loads saved workflows by it), and the pack's module (the help pages' folder)."""
    info = client.object_info()

    for node_id, v1 in pack.nodes.NODE_CLASS_MAPPINGS.items():
        served = canonical(info[node_id])
        declared = v1_info(node_id, v1, pack.nodes.NODE_DISPLAY_NAME_MAPPINGS[node_id])
        assert served == {field: declared[field] for field in served}, node_id
        if comfy_host.is_current_comfy():  # the March-2024 server serves neither these fields nor python_module
            assert set(served) == set(COMPARED), node_id
            assert info[node_id]["python_module"] == f"custom_nodes.{comfy_host.PACK_DIRNAME}"


def test_api_workflow_runs_with_progress_and_saves_an_image(client):
    graph = small(server.load_workflow("sd15_toma_api.json"))
    steps_seen = []

    prompt_id = client.post_prompt(graph)
    run = client.wait_for(prompt_id, on_message=lambda kind, data: kind == "progress" and steps_seen.append(data))

    assert run.error is None
    sampler = next(i for i, node in graph.items() if node["class_type"] == "KSampler")
    assert [(d["value"], d["max"]) for d in steps_seen] == [(step, STEPS) for step in range(1, STEPS + 1)]
    assert {p[2] for p in run.progress} == {sampler}
    history = client.history(prompt_id)
    assert history["status"]["status_str"] == "success" and history["status"]["completed"] is True
    saved = [image for output in history["outputs"].values() for image in output.get("images", [])]
    assert len(saved) == 1 and saved[0]["filename"].startswith("toma_")
    assert png(client, saved[0]).shape == (HEIGHT, WIDTH, 3)  # the latent's size x8
    # the live stats carry the prompt's id, so this client (which groups messages by prompt) keeps them
    patch_node = next(i for i, node in graph.items() if node["class_type"] == "ToMAPatchModel")
    stats = [data for _, kind, data in run.messages if kind == "comfyui_toma.stats"]
    assert [(data["node"], data["prompt_id"]) for data in stats] == [(patch_node, prompt_id)]


def test_comparison_workflow_saves_three_distinct_images(client):
    graph = small(server.load_workflow("sd15_compare_api.json"), seed=7)

    run = client.run(graph)

    images = {image["filename"].rsplit("_", 2)[0]: png(client, image) for image in run.images()}
    assert sorted(images) == ["toma", "tomesd", "unpatched"]
    assert {image["subfolder"] for image in run.images()} == {"toma_compare"}
    assert all(image.shape == (HEIGHT, WIDTH, 3) for image in images.values())
    # Same seed, same conditioning: only the token merging differs, and it does change the result.
    assert not np.array_equal(images["toma"], images["unpatched"])
    assert not np.array_equal(images["tomesd"], images["unpatched"])


def test_methods_comparison_workflow_saves_each_method_and_its_merge_map(client):
    graph = small(server.load_workflow("sd15_compare_methods_api.json"), seed=8)

    run = client.run(graph)

    images = {image["filename"].rsplit("_", 2)[0]: png(client, image) for image in run.images()}
    assert sorted(images) == ["catome", "catome_merge_map", "toma", "toma_merge_map", "tomesd", "tomesd_merge_map",
                              "unpatched"]
    assert all(image.shape == (HEIGHT, WIDTH, 3) for image in images.values())
    assert not np.array_equal(images["toma"], images["unpatched"])
    assert not np.array_equal(images["toma_merge_map"], images["tomesd_merge_map"])


@pytest.mark.parametrize("name, value", [("ratio", 5), ("window_size", -1)])
def test_bad_value_is_refused_naming_the_input_and_server_keeps_serving(client, name, value):
    graph = small(server.load_workflow("sd15_toma_api.json"), seed=100 + value)
    patch_id = next(i for i, node in graph.items() if node["class_type"] == "ToMAPatchModel")
    bad = server.set_inputs(graph, "ToMAPatchModel", **{name: value})

    with pytest.raises(server.PromptRefused) as refused:
        client.post_prompt(bad)

    assert refused.value.status == 400
    assert patch_id in refused.value.node_errors, json.dumps(refused.value.body)
    assert name in json.dumps(refused.value.node_errors[patch_id]), json.dumps(refused.value.body)
    run = client.run(graph)  # a fresh seed: really executed, not served from ComfyUI's cache
    assert run.progress and len(run.images()) == 1

