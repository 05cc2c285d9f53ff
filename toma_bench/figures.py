"""The headline figures outside the code, rendered from one data file, docs/figures.json (per kind of model:
its ratio and placement, the modelled speed-ups and the proxy PSNR, each with its date and the command that
printed it): the README's "What to expect" table, the help pages' figures and default ratios, and the table
at the top of docs/benchmarks.md, each between FIGURES markers. A new figure or default goes into the data
file, not into the pages:

    python -m toma_bench.figures --write   # rewrite the rendered spans from docs/figures.json
    python -m toma_bench.figures           # exit 1, naming the files that are out of date

tests/test_figures.py checks the files equal what this writes, and the data file's ratios and scopes equal
nodes/placement.py's PRESETS (whose comments point here instead of restating figures).
"""
import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "docs" / "figures.json"
NOTEBOOK = "docs/notebook.md"


def span(block: str) -> re.Pattern:
    """The rendered span of ``block`` in a page, its markers kept (groups 1 and 2)."""
    return re.compile(rf"(<!-- FIGURES {block}: python -m toma_bench\.figures --write -->).*?(<!-- /FIGURES {block} -->)",
                      re.S)


def load(path: Path = DATA) -> dict:
    return json.loads(path.read_text())


def kinds(data: dict) -> list[tuple[str, dict]]:
    return list(data["kinds"].items())


def headline(kind: dict, which: str) -> list[dict]:
    return [f for f in kind["figures"] if f["kind"] == which and f["headline"]]


def speed_words(kind: dict) -> str:
    """"FLUX.1-dev 1024x1024: 1.48x H200 eager, 1.64x H200 compiled", one model after another."""
    by_model: dict[str, list[str]] = {}
    for f in headline(kind, "modelled"):
        by_model.setdefault(f["model"], []).append(f"{f['value']} {f['regime']}")
    return "; ".join(f"{model}: {', '.join(values)}" for model, values in by_model.items())


def picture_words(kind: dict) -> str:
    """"20.99 dB (Wan proxy, 4 clips of 4 frames); 24.26 dB (...)"."""
    return "; ".join(f"{f['value']} ({f['proxy']})" for f in headline(kind, "measured"))


def ratio_words(data: dict) -> str:
    return ", ".join(f"{kind['ratio']:g} on {kind['short']}" for _, kind in kinds(data))


def expect_table(data: dict) -> str:
    rows = ["| model kind | ratio (the default) | what merges | speed-up, **modelled** (GPU cost model) | picture, "
            "**measured** (proxy PSNR against unpatched) | to change it |",
            "| --- | ---: | --- | --- | --- | --- |"]
    rows += [f"| {kind['name']} | {kind['ratio']:g} | {kind['merges']} | {speed_words(kind)} | {picture_words(kind)} "
             f"| {kind['tune']} |" for _, kind in kinds(data)]
    return "\n" + "\n".join(rows) + "\n"


def first_list(data: dict) -> str:
    """Per kind of model with a "first" entry: what to turn on first (a core step cache, ToMA, or the two
    together), then each option's modelled speed-up and proxy PSNR, linked to the notebook entry that printed
    them."""
    lines = []
    for _, kind in kinds(data):
        first = kind.get("first")
        if first is None:
            continue
        options = "".join(f" {o['what']}: {o['speed']}, {o['picture']}." for o in first["options"])
        source = f" ([{first['date']}](docs/notebook.md#{first['notebook']}))" if first["options"] else ""
        lines.append(f"- **{kind['short']}** ({first['setup']}): {first['advice']}{options}{source}")
    return "\n" + "\n".join(lines) + "\n"


def stack_table(data: dict) -> str:
    """The "with a step cache" rows of the README's What to expect: per kind with a "stack" entry, what the node
    does beside a cache and what the stack gives against the cache alone."""
    rows = ["| with a step cache | ratio | what merges | speed-up, **modelled** | picture, **measured** | to change it |",
            "| --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {s['name']} | {s['ratio']} | {s['merges']} | {s['speed']} | {s['picture']} | {s['tune']} |"
             for s in (kind["stack"] for _, kind in kinds(data) if "stack" in kind)]
    return "\n" + "\n".join(rows) + "\n"


def help_list(data: dict) -> str:
    lines = [f"- **{kind['short']}**, ratio {kind['ratio']:g}: {kind['merges']}. Modelled {speed_words(kind)}; "
             f"measured on a trained stand-in {picture_words(kind)}." for _, kind in kinds(data)]
    return "\n" + "\n".join(lines) + "\n"


def results_table(data: dict) -> str:
    """Every figure of the data file, each with its date (a link to its notebook entry) and the number of the
    command that printed it, listed under the table."""
    commands: list[str] = []
    rows = ["| kind | figure | value | | date | command |", "| --- | --- | ---: | --- | --- | ---: |"]
    for _, kind in kinds(data):
        for f in kind["figures"]:
            if f["command"] not in commands:
                commands.append(f["command"])
            what = (f"{f['model']}, {f['regime']}" if f["kind"] == "modelled"
                    else f"{f['proxy']}" + (f"; {f['note']}" if f.get("note") else ""))
            rows.append(f"| {kind['short']} | {what} | {f['value']} | {f['kind']} | "
                        f"[{f['date']}](notebook.md#{f['notebook']}) | {commands.index(f['command']) + 1} |")
    listed = [f"{n}. `{command}`" for n, command in enumerate(commands, 1)]
    return "\n" + "\n".join(rows) + "\n\nPrinted by:\n\n" + "\n".join(listed) + "\n"


# page -> {block: how it renders}
RENDERERS = {
    "README.md": {"ratios": ratio_words, "expect": expect_table, "stack": stack_table, "first": first_list},
    "web/docs/ToMAPatchModel.md": {"ratios": ratio_words, "help": help_list},
    "web/docs/ToMAPatchModel/en.md": {"ratios": ratio_words, "help": help_list},
    "web/docs/ToMAPatchModelAdvanced.md": {"ratios": ratio_words},
    "web/docs/ToMAPatchModelAdvanced/en.md": {"ratios": ratio_words},
    "docs/nodes.md": {"ratios": ratio_words},
    "docs/benchmarks.md": {"results": results_table},
}


def generated(data: dict | None = None) -> dict[Path, str]:
    """{page: its text with every FIGURES span rendered from the data file}."""
    data = load() if data is None else data
    out = {}
    for page, blocks in RENDERERS.items():
        text = (REPO / page).read_text()
        for block, render in blocks.items():
            body = render(data)
            text = span(block).sub(lambda m: f"{m.group(1)}{body}{m.group(2)}", text)
        out[REPO / page] = text
    return out


def missing_markers() -> list[str]:
    """'page: block' for each span a page lacks."""
    return [f"{page}: {block}" for page, blocks in RENDERERS.items() for block in blocks
            if not span(block).search((REPO / page).read_text())]


def stale(data: dict | None = None) -> list[Path]:
    """The pages whose rendered spans differ from the data file's."""
    return [path for path, text in generated(data).items() if text != path.read_text()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the rendered spans")
    args = parser.parse_args(argv)
    if args.write:
        for path, text in generated().items():
            path.write_text(text)
    problems = [f"{path.relative_to(REPO)}: figures out of date" for path in stale()]
    problems += [f"{where}: FIGURES markers missing" for where in missing_markers()]
    for problem in problems:
        print(f"{problem}; run python -m toma_bench.figures --write", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
