"""The pack and its harness import each other in one direction only: no module reaches itself through
its imports (the house has no circles). Read from the source with ``ast``, every import counted, also
those inside functions (a circle closed at call time is a circle all the same); tests are left out (they
import everything and nothing imports them)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACK = "comfyui_toma"  # the name the harness imports the pack by (toma_bench.comfy_host)


def modules() -> dict[str, Path]:
    """{dotted name from the repository root ("" is the pack's own __init__): file}"""
    found = {}
    for path in REPO.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[0] == "tests" or any(p.startswith(".") or p == "__pycache__" for p in parts):
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known) -> set[str]:
    """The repository's modules that module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bases, names = [alias.name for alias in node.names], []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            bases, names = [base], [alias.name for alias in node.names]
        else:
            continue
        for base in bases:
            if base == PACK or base.startswith(PACK + "."):
                base = base[len(PACK) + 1:]
            if base not in known:
                continue
            # "from package import module" imports that module; any other name comes from the package itself
            subs = [f"{base}.{n}".lstrip(".") for n in names if f"{base}.{n}".lstrip(".") in known]
            targets.update(subs or [base])
            if len(subs) < len(names):
                targets.add(base)
    targets.discard(name)
    return targets


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    known = modules()
    assert {"toma_bench.proxy", "toma_bench.proxy_training", "nodes.runtime", "toma_core.plan"} <= set(known)
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert "toma_bench.proxy" in graph["toma_bench.proxy_training"]  # the finder sees the imports it must
    assert circles(graph) == []
