"""Live stats: after each sampling run, a token merge node shows on the canvas what merging did.

The runtime calls its run listeners with ``MergeRuntime.summary()`` when a run ends (current ComfyUI: the
OUTER_SAMPLE wrapper; older ComfyUI: ``process_latent_out``, see ``host.install_run_hooks``). The
listener made here sends the lines twice, to the client that queued the prompt:

- as the node's progress text (``PromptServer.send_progress_text``, current ComfyUI), which current
  front ends render themselves, in the classic canvas and in Nodes 2.0 alike;
- as a ``comfyui_toma.stats`` websocket message {node, prompt_id, text, lines, summary} (the prompt_id of
  the run, as ComfyUI's own messages carry it, so API clients that group messages by prompt keep it), which
  ``web/js/toma_stats.js`` turns into the same text where the front end shows no progress text (the
  front end of the March-2024 server, which lacks it, and front ends that clear it when the prompt ends).
"""
import logging
import sys

log = logging.getLogger("ComfyUI-ToMA")

EVENT = "comfyui_toma.stats"


def stats_lines(summary: dict) -> list[str]:
    """Short human lines for a runtime summary: one per merged level (most tokens first), one per level
    left to another node (the node named, and what it did), one per reason block calls ran unmerged
    (``MergeRuntime.unmerged``: the calls counted), one where the host set the pace and the run stopped
    merging (``host_paced``: the model calls before and after), or why nothing merges, then the shares
    of the sampling wall time spent selecting destinations, merging and unmerging (device time from CUDA
    events on CUDA, host time elsewhere: the summary's ``clock``); before those shares, whether destinations
    rotate where a level merged (and how many a rebuilt plan kept from its key's previous build), the step
    cache found on the model and the setting taken beside it (``step_cache``), and what the patched model does
    otherwise than its node asks (``caveats``)."""
    levels = sorted(summary["levels"].items(), key=lambda item: -item[1]["tokens"])  # as the merge map counts
    lines = [f"{name}: {v['tokens']} -> {v['merged_tokens']} tokens, {v['steps']} steps merged" for name, v in levels]
    lines += [f"{name}: left to {left['node']}, which {left['why']}"
              for name, left in summary.get("left_to", {}).items()]
    lines += [f"ran unmerged: {reason} ({calls} block call{'s' if calls != 1 else ''})"
              for reason, calls in summary.get("unmerged", {}).items()]
    paced = summary.get("host_paced")
    if paced:
        after = paced["unmerged_calls"]
        lines.append(f"ran unmerged: {paced['reason']} (merging stopped after {paced['after_calls']} model calls; "
                     f"{after} model call{'s' if after != 1 else ''} unmerged)")
    if not lines:
        lines = [f"nothing merges: {why}" for why in summary.get("nothing_merges", ())] or \
                ["no step merged (no matching level or outside start/end percent)"]
    rotation = summary.get("rotation")
    if rotation and summary["levels"]:
        kept = rotation["destinations_kept"]
        lines.append(f"rotation on (strength {rotation['strength']:g}): " + (
            "no plan rebuilt" if kept is None else
            f"{100 * kept:.0f}% of destinations kept from the previous build of the same plan"))
    if summary.get("step_cache"):
        lines.append(summary["step_cache"]["in_words"])
    lines += summary.get("caveats", ())
    wall = summary.get("wall_seconds")
    if wall:
        shares = " · ".join(f"{kind} {100 * s / wall:.1f}%" for kind, s in summary["seconds"].items())
        untimed = " (stages inside a torch.compile graph untimed)" if summary.get("untimed") else ""
        lines.append(f"{shares} of {wall:.2f} s sampling{untimed}")
    return lines


def progress_text(lines: list[str]) -> str:
    """The lines as one progress text: Nodes 2.0 renders it as Markdown, where a line break needs two
    trailing spaces; the classic canvas shows it as plain text, where the spaces do not show."""
    return "  \n".join(lines)


def prompt_server():
    """ComfyUI's running PromptServer, or None (tests in-process, scripts): feature-detected, never
    imported, so nothing is started as a side effect."""
    server = sys.modules.get("server")
    prompt_server_class = getattr(server, "PromptServer", None)
    return getattr(prompt_server_class, "instance", None)


def running_prompt_id(instance):
    """The id of the prompt being executed: current ComfyUI's execution context where it has one, else
    the server's ``last_prompt_id``, which the prompt worker of both trees' main.py sets before it
    executes a prompt (None outside a server)."""
    execution_utils = sys.modules.get("comfy_execution.utils")
    context = getattr(execution_utils, "get_executing_context", lambda: None)()
    prompt_id = getattr(context, "prompt_id", None)
    return prompt_id if prompt_id is not None else getattr(instance, "last_prompt_id", None)


def stats_sender(unique_id):
    """A run listener that sends the summary of each run, tagged with the node's ``unique_id``."""

    def send(summary: dict) -> None:
        instance = prompt_server()
        if instance is None:
            return
        lines = stats_lines(summary)
        client = getattr(instance, "client_id", None)
        if hasattr(instance, "send_progress_text"):
            instance.send_progress_text(progress_text(lines), str(unique_id), client)
        message = {"node": str(unique_id), "prompt_id": running_prompt_id(instance), "text": "\n".join(lines),
                   "lines": lines, "summary": summary}
        instance.send_sync(EVENT, message, client)

    return send
