"""What a new user meets before sampling: every node is found by "token merge", "tome" (and the patch nodes by
"speed up", "faster sampling"), in V1 (``SEARCH_ALIASES``) and in V3 (the Schema's ``search_aliases``, where the
host's schema has it: v0.33.0 here); the DiTo node is marked experimental (V1 ``EXPERIMENTAL``, V3
``is_experimental``) and says why; a log line names the pack once ("ToMA: ToMA: ..." read twice)."""
import asyncio
import logging
import types
from pathlib import Path

import pytest

from node_info import host_has_v3_schema

REPO = Path(__file__).resolve().parent.parent
SPEED_NODES = ("MODEL", "WANVIDEOMODEL")  # what a node that makes sampling faster returns


def v3_schemas(pack) -> dict:
    if not host_has_v3_schema():
        pytest.skip("this ComfyUI has no V3 node schema (comfy_api.latest): the pack registers V1 here")
    extension = asyncio.run(pack.comfy_entrypoint())
    return {cls.GET_SCHEMA().node_id: cls for cls in asyncio.run(extension.get_node_list())}


def schema_field(name: str):
    from comfy_api.latest import io

    if name not in io.Schema.__dataclass_fields__:
        pytest.skip(f"this ComfyUI's V3 Schema has no {name} (the front end cannot show it)")


def test_every_node_is_found_by_what_users_type(pack):
    for node_id, v1 in pack.nodes.NODE_CLASS_MAPPINGS.items():
        aliases = v1.SEARCH_ALIASES
        assert {"token merge", "tome", "toma"} <= set(aliases), node_id
        if v1.RETURN_TYPES[0] in SPEED_NODES:
            assert {"speed up", "faster sampling"} <= set(aliases), node_id
        assert all(isinstance(a, str) and a == a.strip() and a for a in aliases) and len(set(aliases)) == len(aliases)


def test_v3_nodes_carry_the_search_aliases(pack):
    nodes = v3_schemas(pack)
    schema_field("search_aliases")
    for node_id, v1 in pack.nodes.NODE_CLASS_MAPPINGS.items():
        assert nodes[node_id].GET_SCHEMA().search_aliases == list(v1.SEARCH_ALIASES), node_id
        assert nodes[node_id].GET_NODE_INFO_V1()["search_aliases"] == list(v1.SEARCH_ALIASES), node_id


def test_dito_is_the_one_experimental_node_v1_and_v3(pack):
    experimental = {node_id for node_id, v1 in pack.nodes.NODE_CLASS_MAPPINGS.items()
                    if getattr(v1, "EXPERIMENTAL", False)}
    assert experimental == {"DiToPatchModel"}
    nodes = v3_schemas(pack)
    schema_field("is_experimental")
    for node_id in pack.nodes.NODE_CLASS_MAPPINGS:
        assert nodes[node_id].GET_SCHEMA().is_experimental == (node_id in experimental), node_id
        assert bool(nodes[node_id].GET_NODE_INFO_V1().get("experimental")) == (node_id in experimental), node_id


def test_dito_says_what_it_follows_and_where_its_assumptions_are(pack):
    description = pack.nodes.NODE_CLASS_MAPPINGS["DiToPatchModel"].DESCRIPTION
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    follows = "abstract and first figure"
    assert follows in description and "method text could not be read" in description
    assert "toma_core/dito.py" in description
    assert "Assumptions" in (REPO / "toma_core" / "dito.py").read_text(encoding="utf-8")
    dito_lines = [line for line in readme.splitlines() if "DiTo" in line and follows in line]
    assert dito_lines and any("toma_core/dito.py" in line for line in dito_lines)


@pytest.mark.parametrize("method, line", [("ToMA", "ToMA: something it does otherwise"),
                                          ("DiTo", "ToMA: DiTo: something it does otherwise")])
def test_a_caveat_names_the_pack_once(pack, caplog, method, line):
    strategy = types.SimpleNamespace(name=method, schedule=None)
    placement = types.SimpleNamespace(caveats=(), plan_per_block=False, shared_destinations=False, rotation=0.0)
    runtime = pack.nodes.runtime.MergeRuntime(strategy, None, placement)
    with caplog.at_level(logging.WARNING, logger="ComfyUI-ToMA"):
        runtime.caveat("something it does otherwise")
    assert [r.getMessage() for r in caplog.records] == [line]
