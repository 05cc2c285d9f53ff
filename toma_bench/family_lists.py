"""The family lists outside the code, generated from the registry (each DiT declaration's ``names`` and
``video`` flag, nodes/adapters/families.py): the README's "Models served" and the help pages' ``model``
rows (between FAMILIES markers), and pyproject.toml's description. Adding a family changes them here, not by hand:

    python -m toma_bench.family_lists --write   # rewrite the generated spans
    python -m toma_bench.family_lists           # exit 1, naming the files that are out of date

tests/test_family_lists.py checks the files equal what this writes. The table of docs/models.md is written
by hand (each row says what merges) and checked there against the registry.
"""
import argparse
import re
import sys
from pathlib import Path

from . import comfy_host

REPO = Path(__file__).resolve().parent.parent
HELP_PAGES = [REPO / "web" / "docs" / f"{page}.md" for page in
              ("ToMAPatchModel", "ToMAPatchModel/en", "ToMAPatchModelAdvanced", "ToMAPatchModelAdvanced/en")]
PAGES = [REPO / "README.md", *HELP_PAGES]  # the pages with a FAMILIES span
PYPROJECT = REPO / "pyproject.toml"
SPAN = re.compile(r"(<!-- FAMILIES: python -m toma_bench\.family_lists --write -->).*?(<!-- /FAMILIES -->)")
DESCRIPTION = re.compile(r'^description = ".*"$', re.M)


def families_in_words(adapters, in_words) -> str:
    """The DiT families of the registry, images then videos, in words."""
    return (f"the image DiTs {in_words(adapters.family_names(video=False))}; the video DiTs "
            f"{in_words(adapters.family_names(video=True))}")


def generated(pack) -> dict[Path, str]:
    """{file: its text with the generated spans as the registry makes them}."""
    words = families_in_words(pack.nodes.adapters, pack.nodes.toma_nodes.in_words)
    out = {page: SPAN.sub(lambda m: f"{m.group(1)}{words}{m.group(2)}", page.read_text()) for page in PAGES}
    adapters = pack.nodes.adapters
    description = (f'description = "Token merging for faster diffusion sampling in ComfyUI: ToMA (ICML 2025) for '
                   f'SD1.x/SD2.x/SDXL UNets, image DiTs ({", ".join(adapters.family_names(video=False))}) and video '
                   f'DiTs ({", ".join(adapters.family_names(video=True))}), with ToMeSD and CA-ToMe baselines to '
                   f'compare."')
    out[PYPROJECT] = DESCRIPTION.sub(lambda _: description, PYPROJECT.read_text(), count=1)
    return out


def stale(pack) -> list[Path]:
    """The files whose generated spans differ from the registry's (or that lack their markers)."""
    return [path for path, text in generated(pack).items()
            if text != path.read_text() or (path in PAGES and not SPAN.search(text))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the generated spans")
    args = parser.parse_args(argv)
    comfy_host.import_comfy(extra_nodes=False)
    pack = comfy_host.load_pack()
    if args.write:
        for path, text in generated(pack).items():
            path.write_text(text)
    out_of_date = stale(pack)
    for path in out_of_date:
        print(f"{path.relative_to(REPO)}: family list out of date or markers missing; run python -m "
              f"toma_bench.family_lists --write", file=sys.stderr)
    return 1 if out_of_date else 0


if __name__ == "__main__":
    sys.exit(main())
