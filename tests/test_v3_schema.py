"""On a host with the V3 node schema (``comfy_api.latest``: v0.3.64, v0.3.75, v0.33.0) the pack registers V3
nodes through ``comfy_entrypoint``, built from the V1 declarations (nodes/v3.py); elsewhere (the pinned
March-2024 tree) V1. Each V3 node is its V1 declaration: the same node ID, display name, inputs, outputs,
category and description (node_info.py says what "the same" means), and its execute runs the V1 function,
input checks and the hidden unique_id included. tests/test_host_smoke.py checks the same through ComfyUI's
loader, tests/test_server_api.py through a server's /object_info."""
import asyncio
import inspect

import pytest

from node_info import canonical, host_has_v3_schema, v1_info
from toma_bench import models

pytestmark = pytest.mark.comfy

TINY = dict(models.SD15_SMALL, num_res_blocks=[1, 1], channel_mult=[1, 2], transformer_depth=[1, 1],
            transformer_depth_output=[1, 1, 1, 1])


def v3_nodes(pack) -> dict:
    """{node id: V3 class} of the pack's comfy_entrypoint, as ComfyUI's loader asks for them."""
    extension = asyncio.run(pack.comfy_entrypoint())
    return {cls.GET_SCHEMA().node_id: cls for cls in asyncio.run(extension.get_node_list())}


@pytest.fixture
def v3(pack):
    if not host_has_v3_schema():
        pytest.skip("this ComfyUI has no V3 node schema (comfy_api.latest): the pack registers V1 here")
    return v3_nodes(pack)


def test_the_pack_registers_v3_exactly_where_the_host_has_the_schema(pack):
    if host_has_v3_schema():
        from comfy_api.latest import io

        assert not hasattr(pack, "NODE_CLASS_MAPPINGS"), "a V3 host would take these and never call comfy_entrypoint"
        nodes = v3_nodes(pack)
        assert list(nodes) == list(pack.nodes.NODE_CLASS_MAPPINGS)
        assert all(issubclass(cls, io.ComfyNode) for cls in nodes.values())
    else:
        assert not hasattr(pack, "comfy_entrypoint")
        assert pack.NODE_CLASS_MAPPINGS is pack.nodes.NODE_CLASS_MAPPINGS
        assert pack.NODE_DISPLAY_NAME_MAPPINGS is pack.nodes.NODE_DISPLAY_NAME_MAPPINGS
    assert pack.WEB_DIRECTORY == "./web"


def test_each_v3_node_is_its_v1_declaration(pack, v3):
    names = pack.nodes.NODE_DISPLAY_NAME_MAPPINGS
    for node_id, v1 in pack.nodes.NODE_CLASS_MAPPINGS.items():
        assert canonical(v3[node_id].GET_NODE_INFO_V1()) == v1_info(node_id, v1, names[node_id]), node_id
        assert v3[node_id].v1_class is v1


def test_a_new_input_or_node_is_v3_with_no_code_of_its_own(pack, v3):
    """What other branches add (a node, a combo input on the Advanced node) is served as declared."""
    advanced = pack.nodes.toma_nodes.ToMAPatchModelAdvanced

    class WithRotation(advanced):
        @classmethod
        def INPUT_TYPES(cls):
            spec = advanced.INPUT_TYPES()
            spec["optional"]["rotation"] = (["off", "per step"], {"default": "off", "tooltip": "Rotates windows."})
            return spec

    node = pack.nodes.v3.node_class("ToMARotationProbe", WithRotation, "Probe")
    info = canonical(node.GET_NODE_INFO_V1())

    assert info == v1_info("ToMARotationProbe", WithRotation, "Probe")
    rotation = [["off", "per step"], {"default": "off", "tooltip": "Rotates windows."}]
    assert info["input"]["optional"]["rotation"] == rotation


def test_a_v1_attribute_v3_would_drop_is_refused_naming_it(pack, v3):
    class Changing(pack.nodes.toma_nodes.ToMeSDPatchModel):
        @classmethod
        def IS_CHANGED(cls, **inputs):
            return float("nan")

    with pytest.raises(TypeError, match="ChangingProbe.*IS_CHANGED"):
        pack.nodes.v3.node_class("ChangingProbe", Changing, None)


def run_v3(node, unique_id, **inputs):
    """``node`` executed as ComfyUI's executor runs a V3 node: a clone holding the hidden inputs, then
    EXECUTE_NORMALIZED with the inputs as keyword arguments."""
    from comfy_api.latest import io

    hidden = {io.Hidden.unique_id: unique_id}
    # v0.33.0 hands the clone its V3Data, which holds the hidden inputs; hosts of 2025 the hidden inputs themselves
    takes_v3_data = "v3_data" in inspect.signature(node.PREPARE_CLASS_CLONE).parameters
    return node.PREPARE_CLASS_CLONE({"hidden_inputs": hidden} if takes_v3_data else hidden).EXECUTE_NORMALIZED(**inputs)


def test_v3_execute_patches_as_v1_and_reports_to_its_node(pack, v3, sent):
    from comfy_api.latest import io

    model = models.build_unet("sd15", seed=0, config=TINY)
    inputs = {"model": model, "ratio": 0.5, "window_size": 4, "reuse_interval": 5}

    out = run_v3(v3["ToMAPatchModel"], "7", **inputs)
    (v1_out,) = pack.nodes.NODE_CLASS_MAPPINGS["ToMAPatchModel"]().patch(**inputs)

    assert isinstance(out, io.NodeOutput) and len(out.args) == 1 and out.args[0] is not model
    (runtime,) = pack.nodes.runtime.runtimes_of(out.args[0])
    assert runtime.strategy == pack.nodes.runtime.runtimes_of(v1_out)[0].strategy
    for listener in runtime.run_listeners:  # what runs when a sampling run ends: the live stats, to node 7
        listener(runtime.summary())
    assert [data["node"] for event, data, _ in sent if event == "comfyui_toma.stats"] == ["7"]


def test_v3_execute_refuses_a_bad_input_naming_it(v3):
    model = models.build_unet("sd15", seed=0, config=TINY)

    with pytest.raises(ValueError, match="sx must be an integer between 1 and 8"):
        run_v3(v3["ToMeSDPatchModel"], "3", model=model, ratio=0.5, sx=2.5)
