"""The front-end extensions (web/js) know the pack's nodes from one list, web/js/toma_nodes.js, and that
list is the server's: every token merge node the pack registers, and those with a "seed" input."""
import re
from pathlib import Path

WEB_JS = Path(__file__).resolve().parent.parent / "web" / "js"
NODE_LIST = WEB_JS / "toma_nodes.js"


def js_set(name: str) -> set[str]:
    """The strings of ``export const <name> = new Set([...])`` in toma_nodes.js."""
    found = re.search(rf"export const {name} = new Set\(\[(.*?)\]\)", NODE_LIST.read_text(), re.S)
    assert found, f"{NODE_LIST.name} exports no {name}"
    return set(re.findall(r'"([^"]+)"', found.group(1)))


def test_the_node_list_is_the_servers(pack):
    classes = pack.nodes.NODE_CLASS_MAPPINGS
    merge_nodes = {name for name, cls in classes.items() if cls.RETURN_TYPES in (("MODEL",), ("WANVIDEOMODEL",))}
    seeded = {name for name in merge_nodes if "seed" in classes[name].INPUT_TYPES()["required"]}
    assert js_set("MERGE_NODES") == merge_nodes and len(merge_nodes) == 6
    assert js_set("SEEDED_NODES") == seeded and seeded


def test_every_extension_takes_the_node_names_from_the_list():
    names = js_set("MERGE_NODES")
    for script in WEB_JS.glob("*.js"):
        if script == NODE_LIST:
            continue
        text = script.read_text()
        assert not any(f'"{name}"' in text for name in names), f"{script.name} spells out node names"
        if "_NODES" in text:
            assert 'from "./toma_nodes.js"' in text, f"{script.name} uses a node list it does not import"
