"""ToMeSD and CA-ToMe baselines, re-derived with plain loops."""
import pytest
import torch
import torch.nn.functional as F

from toma_core import CATOME_CONFIG3, CheckpointSchedule, catome_checkpoints, catome_plan, tomesd_plan
from toma_core.selection import seed_stream


def reference_matching(x: torch.Tensor, hw, seed: int | None, sx: int = 2, sy: int = 2):
    """tomesd's matching by loops. Returns (dst, src, best, score): dst/src raster lists (ascending),
    best[b][i] = index into dst of source i's most similar destination, score[b][i] its cosine."""
    h, w = hw
    hs, ws = h // sy, w // sx
    if seed is None:
        pick = torch.zeros(hs, ws, dtype=torch.long)
    else:  # the same single draw: one random position per sy x sx cell
        pick = torch.randint(sy * sx, (hs, ws), generator=torch.Generator().manual_seed(seed))
    dst = sorted((cy * sy + int(pick[cy, cx]) // sx) * w + cx * sx + int(pick[cy, cx]) % sx
                 for cy in range(hs) for cx in range(ws))
    src = [i for i in range(h * w) if i not in set(dst)]
    best, score = [], []
    for b in range(x.shape[0]):
        bb, ss = [], []
        for i in src:
            cos = [float(F.cosine_similarity(x[b, i].double(), x[b, j].double(), dim=0)) for j in dst]
            j = max(range(len(dst)), key=cos.__getitem__)
            bb.append(j)
            ss.append(cos[j])
        best.append(bb)
        score.append(ss)
    return dst, src, best, score


@pytest.mark.parametrize("hw", [(4, 4), (6, 4), (5, 6), (7, 7)])
@pytest.mark.parametrize("seed", [None, 0, 3])
def test_tomesd_matches_a_direct_re_derivation(hw, seed):
    h, w = hw
    B, C, ratio = 2, 6, 0.5
    x = torch.randn(B, h * w, C, generator=torch.Generator().manual_seed(h * w))
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    plan = tomesd_plan(x, hw, ratio, generator=generator)
    dst, src, best, score = reference_matching(x, hw, seed)
    r = min(int(h * w * ratio), len(src))
    assert plan.dst_index[0].tolist() == dst and plan.src_index[0].tolist() == src
    assert plan.num_merged == h * w - r

    merged = plan.merge(x)
    assert merged.shape == (B, h * w - r, C)
    y = torch.randn(B, h * w - r, C, generator=torch.Generator().manual_seed(1))
    restored = plan.unmerge(y)
    for b in range(B):
        order = sorted(range(len(src)), key=lambda i: -score[b][i])  # best-matched sources first
        moving, staying = order[:r], order[r:]
        # [unmerged sources, best-matched first | destinations averaged with the sources they took]
        expect = [x[b, src[i]] for i in staying]
        for j, d in enumerate(dst):
            group = [x[b, d]] + [x[b, src[i]] for i in moving if best[b][i] == j]
            expect.append(torch.stack(group).mean(0))
        assert torch.allclose(merged[b], torch.stack(expect), atol=1e-6)
        for pos, i in enumerate(staying):
            assert torch.equal(merged[b, pos], x[b, src[i]])  # untouched, bit for bit
        # unmerge: a destination and the sources merged into it all get the destination's output
        n_keep = len(staying)
        for j, d in enumerate(dst):
            assert torch.equal(restored[b, d], y[b, n_keep + j])
        for pos, i in enumerate(staying):
            assert torch.equal(restored[b, src[i]], y[b, pos])
        for i in moving:
            assert torch.equal(restored[b, src[i]], y[b, n_keep + best[b][i]])


def test_tomesd_cells_from_a_seed_are_uniform_and_new_in_every_stream():
    """A seed (an int64 scalar tensor, as the runtime draws before each model call) places one destination
    in every cell, at a position uniform over the cell; the same seed places it again, each stream of the
    seed elsewhere."""
    h, w, sx, sy = 60, 40, 2, 3
    x = torch.randn(1, h * w, 4, generator=torch.Generator().manual_seed(4))
    seed = torch.tensor(12345, dtype=torch.long)
    plan = tomesd_plan(x, (h, w), 0.5, sx=sx, sy=sy, seed=seed)
    rows, cols = plan.dst_index[0] // w, plan.dst_index[0] % w
    cells = ((rows // sy) * (w // sx) + cols // sx).sort().values
    assert torch.equal(cells, torch.arange((h // sy) * (w // sx)))  # one per cell
    position = (rows % sy) * sx + cols % sx
    counts = torch.bincount(position, minlength=sx * sy).float()
    assert counts.min() > 0.75 * counts.mean() and counts.max() < 1.25 * counts.mean()  # 400 cells: 6 positions
    again = tomesd_plan(x, (h, w), 0.5, sx=sx, sy=sy, seed=seed.clone())
    assert torch.equal(again.dst_index, plan.dst_index) and torch.equal(again.merged, plan.merged)
    others = {tuple(tomesd_plan(x, (h, w), 0.5, sx=sx, sy=sy, seed=seed_stream(seed, n)).dst_index[0].tolist())
              for n in range(4)}
    assert len(others) == 4 and tuple(plan.dst_index[0].tolist()) not in others


def test_tomesd_unmerge_of_merge_restores_unmerged_tokens():
    x = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(2))
    plan = tomesd_plan(x, (8, 8), 0.3, generator=torch.Generator().manual_seed(0))
    out = plan.unmerge(plan.merge(x))
    for b in range(2):
        kept = plan.src_index[0][plan.unmerged[b]]
        assert torch.equal(out[b, kept], x[b, kept])


def test_tomesd_ratio_is_capped_at_three_quarters():
    x = torch.randn(1, 64, 8, generator=torch.Generator().manual_seed(3))
    for ratio in (0.75, 0.8, 0.95):
        plan = tomesd_plan(x, (8, 8), ratio)
        assert plan.num_merged == 16  # one token per 2x2 cell is left
        assert plan.merge(x).shape == (1, 16, 8)
    assert tomesd_plan(x, (8, 8), 0.5).num_merged == 32
    assert tomesd_plan(x, (8, 8), 0.0).num_merged == 64
    with pytest.raises(ValueError, match="ratio"):
        tomesd_plan(x, (8, 8), 1.0)


def test_catome_merges_exactly_the_sources_over_threshold():
    g = torch.Generator().manual_seed(4)
    hw, thr = (6, 6), 0.5
    x = torch.randn(2, 36, 4, generator=g)  # low dimension: a good spread of best-match cosines
    x[1] = x[1] + 0.8 * x[1, :1]  # row 1 more self-similar: more sources clear the threshold there
    plan = catome_plan(x, hw, threshold=thr)
    dst, src, best, score = reference_matching(x, hw, None)
    counts = [sum(s >= thr for s in row) for row in score]
    assert counts[0] != counts[1]
    assert plan.merged.shape[1] == min(counts) > 0
    for b in range(2):
        chosen = [src.index(int(plan.src_index[0, i])) for i in plan.merged[b]]
        assert all(score[b][i] >= thr for i in chosen)
        # they are the best-scored sources of the row
        assert sorted(chosen) == sorted(sorted(range(len(src)), key=lambda i: -score[b][i])[: min(counts)])
    assert plan.num_merged == 36 - min(counts)
    assert catome_plan(x, hw, threshold=1.0).num_merged <= 36
    with pytest.raises(ValueError, match="threshold"):
        catome_plan(x, hw, threshold=1.5)


def reference_compute_steps(config, steps):
    """The 0-based steps at which the CA-ToMe reference pipeline computes matches in a run of its own
    length: it hands the blocks ``i + 1`` for step ``i`` and computes where that number is in the config,
    or when nothing is cached yet (its first step)."""
    cached, computed = False, set()
    for i in range(steps):
        if (i + 1) in config or not cached:
            computed.add(i)
            cached = True
    return computed


def test_catome_checkpoints_count_steps_from_one_as_the_reference_does():
    assert catome_checkpoints(50) == reference_compute_steps(CATOME_CONFIG3, 50)
    assert catome_checkpoints(50) == {0, 7, 10, 12, 19, 24, 29, 34, 44, 45, 46, 47, 48}
    for steps in (1, 10, 20, 30, 100):
        cps = catome_checkpoints(steps)
        assert 0 in cps
        assert all(0 <= s < steps for s in cps)
        assert len(cps) <= len(CATOME_CONFIG3)
    assert catome_checkpoints(1) == {0}
    # twice the steps: the reference's step c is step 2c counted from 1, 2c - 1 counted from 0
    assert catome_checkpoints(100) == {0} | {2 * c - 1 for c in CATOME_CONFIG3 if c}
    with pytest.raises(ValueError, match="steps"):
        catome_checkpoints(0)


def test_checkpoint_schedule_without_the_run_length_uses_the_reference_fractions():
    """A host that gives no schedule: a step is a checkpoint when its progress passes (c - 1) / 50."""
    sched = CheckpointSchedule()
    new = [s for s in range(50) if sched.decide(s, s / 50, "g").new_destinations]
    assert set(new) == catome_checkpoints(50)
    sched.reset()
    assert sched.decide(30, 0.6, "g").new_destinations  # after a reset, the first call always computes
    assert [s for s in range(50) if CheckpointSchedule().decide(s, s / 50, "g", total=50).new_destinations] == new


def test_bipartite_unmerge_refuses_tokens_it_did_not_merge():
    x = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(0))
    plan = tomesd_plan(x, (8, 8), 0.5, 2, 2, generator=torch.Generator().manual_seed(1))
    merged = plan.merge(x)
    for wrong in (merged[:, :-1], merged[:1], x):
        with pytest.raises(ValueError, match="unmerge expects"):
            plan.unmerge(wrong)
    assert plan.unmerge(merged).shape == x.shape
