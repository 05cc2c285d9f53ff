"""Several speed-vs-fidelity fronts in one figure, from the rows ``python -m toma_bench.curves --out DIR`` writes
(``DIR/curves_<arch>_<set>_<side>.json``): a panel per front, PSNR against the modelled GPU speed-up, ToMA,
DiTo and ToMeSD as three marked series (ToMA's rows with fixed destinations hollow), and the step caches of
``curves --set caches`` (toma_bench.step_caches): a line per cache over its thresholds, and a line per stack of
the cache with a ToMA setting (dashed; hollow where ToMA's destinations stay fixed), each point labelled by its
threshold.

    python -m toma_bench.fronts ROWS.json[+MORE.json...][:MODEL] ... --out FIGURE.png

``+`` joins the rows of several runs of one proxy setup in a panel; ``:MODEL`` picks the speed axis of a
run priced on several real-size models (``curves --also-real``); the default is the run's own ``--real``.
"""
import argparse
import json
import sys
from pathlib import Path

from . import proxy
from .step_caches import NAMES

# the three series: (name, how its rows' families begin, marker, colour)
SERIES = (("ToMA", "ToMA", "o", "C0"), ("DiTo", "DiTo", "s", "C3"), ("ToMeSD", "ToMeSD", "^", "C2"))
PSNR_TOP = 40.0  # dB: the PSNR axis ends here (a row that merges almost nothing is drawn at the top edge)


RUN = ("arch", "side", "frames", "batch", "steps", "hardware", "regime")  # what runs joined in a panel share


def joined(paths: list[str]) -> dict:
    """The rows of several runs of one proxy setup (``RUN``), each label once: a row that two runs share (the
    unpatched model, the node's default) must agree, as the runs are deterministic."""
    data = json.loads(Path(paths[0]).read_text())
    seen = {row["label"]: row for row in data["rows"]}
    for path in paths[1:]:
        more = json.loads(Path(path).read_text())
        if any(more[k] != data[k] for k in RUN) or not set(data["real"]) <= set(more["real"]):
            raise ValueError(f"{path}: another run setup than {paths[0]}'s")
        for row in more["rows"]:
            if row["label"] not in seen:
                data["rows"].append(row)
                seen[row["label"]] = row
            elif row["psnr"] != seen[row["label"]]["psnr"]:
                raise ValueError(f"{path}: {row['label']} differs from {paths[0]}'s")
    return data


def panel(spec: str) -> tuple[dict, str]:
    """``ROWS.json[+MORE.json...][:MODEL]`` -> the rows (of several runs joined) and the real-size model of
    the speed axis."""
    paths, _, model = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
    data = joined(paths.split("+"))
    model = model or next(iter(data["real"]))
    if model not in data["real"]:
        raise ValueError(f"{spec}: priced on {', '.join(data['real'])}, not {model}")
    return data, model


def is_fixed(family: str) -> bool:
    """A ToMA row whose destinations stay fixed: a --setting row that does not turn rotation on (the node's
    default rows take the kind's preset, which rotates on DiTs), or a row that turns it off."""
    return family.startswith("ToMA") and ("rotation off" in family or
                                          "node default" not in family and "rotation on" not in family)


CACHE_COLOURS = dict(zip(NAMES, ("C2", "C1", "C4", "C5")))
CACHE_MARKERS = dict(zip(NAMES, "DvPX"))
# the ToMA row of a stack, in a few words: its family's tail after "<cache> + ToMA node default"
STACKED_TOMA = {"": "ToMA default", ", rotation on": "ToMA r={ratio}", ", rotation off": "ToMA r={ratio} fixed"}


def cache_lines(data: dict, model: str) -> dict:
    """(cache, ToMA words or "") -> [(speed-up, PSNR, threshold text, fixed), ...] by speed-up: the rows of each
    step cache alone and of each of its stacks with a ToMA row (``curves.cache_front``'s families)."""
    out = {}
    for row in data["rows"]:
        cache, plus, toma = row["family"].partition(" + ")
        speed = row["speed_up"].get(model)
        if cache not in NAMES or speed is None:
            continue
        words = ""
        if plus:
            tail, _, ratio = toma.removeprefix("ToMA node default").rpartition(" r=")
            words = STACKED_TOMA.get(tail, toma).format(ratio=ratio)
        psnr = PSNR_TOP if row["psnr"] is None else min(row["psnr"], PSNR_TOP)
        out.setdefault((cache, words), []).append((speed, psnr, row["setting"].removeprefix("t="),
                                                   words.endswith("fixed")))
    return {key: sorted(points) for key, points in out.items()}


def draw_caches(ax, data: dict, model: str) -> None:
    styles = {}
    for (cache, words), points in cache_lines(data, model).items():
        ls = styles.setdefault(words, ("-", "--", ":", "-.")[len(styles) % 4])
        colour, marker = CACHE_COLOURS[cache], CACHE_MARKERS[cache]
        ax.plot([p[0] for p in points], [p[1] for p in points], color=colour, ls=ls, lw=1, marker=marker, ms=5,
                mfc="none" if words.endswith("fixed") else colour, label=cache + (f" + {words}" if words else " alone"))
        for x, y, threshold, _ in points:
            ax.annotate(threshold, (x, y), textcoords="offset points", xytext=(3, -8), fontsize=6, color=colour)


SCOPES = {"scope block": "blocks", "scope keys/values": "KV"}  # a ToMA row's scope, named where a panel has several


def scope_of(family: str) -> str | None:
    return next((short for words, short in SCOPES.items() if words in family), None)


def front(points: list) -> list:
    """The points no other point beats on both axes (faster and closer), by speed-up."""
    best, out = -float("inf"), []
    for point in sorted(points, reverse=True):
        if point[1] > best:
            out.append(point)
            best = point[1]
    return out[::-1]


def series(data: dict, model: str) -> dict:
    """name -> [(speed-up, PSNR, ratio text, fixed), ...] by speed-up; rows of no series (unpatched) left out.
    The ratio text names the scope of a ToMA row where the panel's ToMA rows have several."""
    out = {name: [] for name, *_ in SERIES}
    several = len({scope_of(row["family"]) for row in data["rows"]} - {None}) > 1
    for row in data["rows"]:
        name = next((n for n, prefix, *_ in SERIES if row["family"].startswith(prefix)), None)
        speed = row["speed_up"].get(model)
        if name is None or speed is None:
            continue
        psnr = PSNR_TOP if row["psnr"] is None else min(row["psnr"], PSNR_TOP)
        ratio = row["setting"].split("=")[-1].replace("auto", "default")
        if several and name == "ToMA" and scope_of(row["family"]):
            ratio += f" {scope_of(row['family'])}"
        out[name].append((speed, psnr, ratio, is_fixed(row["family"])))
    return {name: sorted(points) for name, points in out.items()}


def title(data: dict, model: str) -> str:
    # the DiT proxies patchify 2x2; a UNet's tokens at full resolution are its latent pixels
    side = data["side"] if proxy.spec_of(data["arch"]).model_kind == "sd15" else data["side"] // 2
    what = (f"{data['batch']} clips of {data['frames']} frames" if data.get("frames") else f"{data['batch']} pictures")
    return (f"{data['arch']} proxy, {side}x{side} tokens, {what}, {data['steps']} steps\n"
            f"speed: {data['real'][model].split(' (')[0]}, {data['hardware']} {data['regime']} (modelled)"
            + ("" if model == next(iter(data["real"])) else "; the same pictures"))


def draw(panels: list[tuple[dict, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caches = any(cache_lines(data, model) for data, model in panels)  # their legend goes beside the panel
    cols = 1 if caches else min(2, len(panels))  # two panels a row, one where a legend is beside it
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=((7.6 if caches else 5.2) * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    for ax, (data, model) in zip(axes.flat, panels):
        for (name, _, marker, colour) in SERIES:
            points = series(data, model)[name]
            if not points:
                continue
            rotating = [p for p in points if not p[3]]
            line = front(rotating) if name == "ToMA" else rotating  # ToMA's settings: the line joins its front
            ax.plot([p[0] for p in line], [p[1] for p in line], color=colour, lw=1, marker=marker, ms=5,
                    label=name + (", destinations rotating (line: its front)" if name == "ToMA" else ""))
            ax.plot([p[0] for p in rotating], [p[1] for p in rotating], ls="none", marker=marker, ms=5, color=colour)
            fixed = [p for p in points if p[3]]
            if fixed:
                ax.plot([p[0] for p in fixed], [p[1] for p in fixed], ls="none", marker=marker, ms=6, mfc="none",
                        color=colour, label=f"{name}, fixed destinations")
            for x, y, ratio, _ in points:
                ax.annotate(ratio, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6, color=colour)
        draw_caches(ax, data, model)
        ax.axvline(1.0, color="0.6", lw=0.8, ls="--")
        ax.set_xlabel("speed-up vs unpatched, modelled (x)", fontsize=8)
        ax.set_ylabel(f"PSNR vs unpatched, measured on the proxy (dB; above {PSNR_TOP:g} at the top)", fontsize=7)
        ax.set_title(title(data, model), fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if caches:
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toma_bench.fronts", description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", metavar="ROWS.json[+MORE.json...][:MODEL]",
                    help="a curves run's rows, a panel each (+: several runs' rows in one panel); :MODEL the speed "
                         "axis of a run priced on several models")
    ap.add_argument("--out", required=True, help="the figure (.png)")
    args = ap.parse_args(argv)
    try:
        panels = [panel(spec) for spec in args.rows]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"python -m toma_bench.fronts: {e}")
    draw(panels, Path(args.out))
    print(f"figure: {args.out} ({len(panels)} panels)")


if __name__ == "__main__":
    main()
