"""Live stats: after each sampling run, a token merge node shows on the canvas what merging did.

The runtime calls its run listeners with ``MergeRuntime.summary()`` when a run ends (CUR: the
OUTER_SAMPLE wrapper; older ComfyUI: ``process_latent_out``, see ``unet.install_run_hooks``). The
listener made here sends a ``comfyui_toma.stats`` websocket message to the front end, where
``web/js/toma_stats.js`` draws the lines under the node whose id it carries.
"""
import logging
import sys

log = logging.getLogger("ComfyUI-ToMA")

EVENT = "comfyui_toma.stats"


def stats_lines(summary: dict) -> list[str]:
    """Short human lines for a runtime summary: one per merged level (most tokens first), then the shares
    of the sampling wall time spent selecting destinations, merging and unmerging."""
    levels = sorted(summary["levels"].items(), key=lambda item: -item[1]["tokens"])  # as the merge map counts
    lines = [f"{name}: {v['tokens']} → {v['merged_tokens']} tokens, {v['steps']} steps merged" for name, v in levels]
    if not lines:
        lines = ["no step merged (no matching level or outside start/end percent)"]
    wall = summary.get("wall_seconds")
    if wall:
        shares = " · ".join(f"{kind} {100 * s / wall:.1f}%" for kind, s in summary["seconds"].items())
        lines.append(f"{shares} of {wall:.2f} s sampling")
    return lines


def prompt_server():
    """ComfyUI's running PromptServer, or None (tests in-process, scripts): feature-detected, never
    imported, so nothing is started as a side effect."""
    server = sys.modules.get("server")
    prompt_server_class = getattr(server, "PromptServer", None)
    return getattr(prompt_server_class, "instance", None)


def stats_sender(unique_id):
    """A run listener that sends the summary of each run, tagged with the node's ``unique_id``."""

    def send(summary: dict) -> None:
        instance = prompt_server()
        if instance is None:
            return
        lines = stats_lines(summary)
        message = {"node": str(unique_id), "text": "\n".join(lines), "lines": lines, "summary": summary}
        instance.send_sync(EVENT, message, getattr(instance, "client_id", None))

    return send
