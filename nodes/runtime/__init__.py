"""The runtime layer: per patched MODEL, what happens while it samples.

- ``merge_runtime``: ``MergeRuntime``, the run, the host's wrappers and the stats of one token merge node.
- ``plans``: ``PlanStore``, its plan cache, the schedule's reuse decisions and rotation's counts.
- ``model_call``: ``ModelCall``, what one model call settled before the model ran and what it merged.
- ``levels``: ``Level`` (what plans and stats are keyed by), the plan key, ``RunReport`` (what a run
  merged, to read).
- ``steps``: sigma -> step and progress of a model call in its run.
- ``stages``: time per merging stage (select, merge, unmerge).
- ``records``: the plans a run used, as the merge map draws them.
- ``registry``: MODEL -> its runtimes.
- ``malloc_graph``: the host's Comfy Compiler: what the pack keeps is made outside its malloc graph.
"""
from . import malloc_graph
from .levels import UNET, Level, PlanKey, RunReport, unet_level
from .merge_runtime import MergeRuntime
from .registry import OPTIONS_KEY, STACK_KEY, attach_runtime, hold, holds, runtime_of, runtimes_of

malloc_graph.install()  # toma_core's cached tensors too

__all__ = ["UNET", "Level", "PlanKey", "RunReport", "unet_level", "MergeRuntime", "OPTIONS_KEY", "STACK_KEY",
           "attach_runtime", "hold", "holds", "runtime_of", "runtimes_of"]
