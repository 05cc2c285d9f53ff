"""The baselines sample as their references do, through ComfyUI's sampler on a small SD1.5-layout UNet:
ToMeSD draws its random cells from one generator per sampling run (as tomesd advances one generator),
new ones in every block call (hashed from a seed the generator draws before each model call); CA-ToMe
computes matches at the steps its reference pipeline does (it counts steps from 1)."""
import logging

import pytest
import torch

from toma_bench import models, sampling

pytestmark = pytest.mark.comfy

UNET_TINY = dict(models.SD15_SMALL, model_channels=32, num_heads=2)


def sample(model, steps, callback=None):
    return sampling.sample(model, models.conditioning("sd15", 1, height=128, width=128), torch.zeros(1, 4, 16, 16),
                           steps=steps, callback=callback)


def recording_builds(monkeypatch, strategy_class, record):
    """Make every plan ``strategy_class`` builds call ``record(plan)`` first."""
    build = strategy_class.build

    def recorded(self, *args, **kwargs):
        plan = build(self, *args, **kwargs)
        record(plan)
        return plan

    monkeypatch.setattr(strategy_class, "build", recorded)


def test_tomesd_draws_new_cells_in_every_block_call_and_the_same_ones_in_every_run(pack, monkeypatch):
    cells = []
    recording_builds(monkeypatch, pack.toma_core.ToMeSD, lambda plan: cells.append(tuple(plan.dst_index[0].tolist())))
    (patched,) = pack.nodes.NODE_CLASS_MAPPINGS["ToMeSDPatchModel"]().patch(models.build_unet("sd15", 0, config=UNET_TINY),
                                                                      ratio=0.5, max_downsample=2)
    first = sample(patched, steps=3)
    first_cells, cells[:] = list(cells), []
    second = sample(patched, steps=3)
    blocks_per_step = len(first_cells) // 3
    assert blocks_per_step >= 2 and len(first_cells) == 3 * blocks_per_step
    # one generator advanced through the run: (almost) every block call of every step draws other cells
    assert len(set(first_cells)) >= len(first_cells) - 1
    # seeded per run: the second run draws the same sequence and gives the same latent
    assert cells == first_cells and torch.equal(first, second)


@pytest.mark.parametrize("steps", [10, 20])
def test_catome_computes_at_the_reference_steps(pack, monkeypatch, steps):
    core = pack.toma_core
    done, built_at = [0], []
    recording_builds(monkeypatch, core.CAToMe, lambda plan: built_at.append(done[0]))
    (patched,) = pack.nodes.NODE_CLASS_MAPPINGS["CAToMePatchModel"]().patch(models.build_unet("sd15", 0, config=UNET_TINY),
                                                                      threshold=0.5)

    def count_steps(step, *args):
        done[0] = step + 1

    sample(patched, steps, callback=count_steps)
    # the reference computes at step i (from 0) when i + 1 is a checkpoint of its 50-step run, rescaled
    want = {0} | {round(c * steps / 50) - 1 for c in core.CATOME_CONFIG3 if round(c * steps / 50) >= 1}
    assert set(built_at) == want == core.catome_checkpoints(steps)
    assert len(want) < steps  # some steps reuse the matches: the test would prove nothing otherwise


@pytest.mark.parametrize("node, inputs, method", [("ToMeSDPatchModel", {"ratio": 0.5}, "ToMeSD"),
                                                  ("CAToMePatchModel", {"threshold": 0.5}, "CA-ToMe")])
def test_a_latent_too_small_for_a_plan_runs_unmerged_and_the_log_says_so_in_words(pack, caplog, node, inputs, method):
    """A 1x1 latent has one token, which no ToMeSD cell layout fits: the method, the level and the grid
    are named in words, once, and the run goes on unmerged. (64 channels: GroupNorm needs more than one
    value per group on a 1x1 latent.)"""
    model = models.build_unet("sd15", 0, config=dict(UNET_TINY, model_channels=64))
    (patched,) = pack.nodes.NODE_CLASS_MAPPINGS[node]().patch(model, **inputs)

    with caplog.at_level(logging.DEBUG, logger="ComfyUI-ToMA"):
        out = sampling.sample(patched, models.conditioning("sd15", 1, height=8, width=8), torch.zeros(1, 4, 1, 1),
                              steps=2)

    assert torch.isfinite(out).all()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"ToMA: {method} leaves 1x1 (1/1) unmerged: it could not build a merge plan for a 1x1 "
                        "token grid (1 token) (the error is in the debug log)"]
    assert any(r.exc_info for r in caplog.records if r.levelno == logging.DEBUG)
