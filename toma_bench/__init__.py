"""The development harness: benchmarks, the main job, and what they share with the tests (a ComfyUI host,
a headless server, random-weight models, sampling, metrics, tables, the benchmarks' runner).

Imports point one way: tests -> toma_bench -> the pack. The harness is the top-level package
``toma_bench`` (the repo root on ``sys.path``: conftest.py, or ``python -m`` from the root); it sees the
pack only as ``comfyui_toma``, through ``comfy_host.load_pack()``. Since the repo root is also the pack's
folder, ``comfyui_toma.toma_bench`` would load every harness module a second time, as other objects.
"""
if __name__ != "toma_bench":
    raise ImportError(f"the harness is the top-level package toma_bench, not {__name__} "
                      "(put the repo root on sys.path)")
