"""ToMA merge plans: M = row-normalised softmax(tau * cos) over destinations, U = A^T (or pinv(M))."""
import math

import pytest
import torch
import torch.nn.functional as F

from toma_core import (DEFAULT_TAU, IdentityPlan, MergePlan, destinations_per_tile, plan_tiles, tile_tokens,
                       token_grid)

# (token grid, tile, temporal_window). Tile 16 and the 2x8x8 windows of 10x9 frames: stochastic greedy.
# Video windows: divisible, padded on every axis, one frame per window, more frames per window than frames.
IMAGE_CASES = [((8, 8), 4, 1), ((6, 10), 4, 1), ((12, 12), 8, 1), ((7, 9), 3, 1), ((10, 9), 16, 1)]
VIDEO_CASES = [((4, 8, 8), 4, 2), ((5, 7, 9), 3, 2), ((3, 6, 10), 4, 1), ((2, 6, 6), 3, 4), ((3, 10, 9), 8, 2)]
CASES = IMAGE_CASES + VIDEO_CASES


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def live_mask(plan: MergePlan) -> torch.Tensor:
    """(T, D) bool: the destination slots that hold a real merged token."""
    D = plan.destinations.shape[-1]
    live = torch.zeros(plan.grid.num_tiles * D, dtype=torch.bool)
    live[plan.live if plan.live is not None else slice(None)] = True
    return live.view(plan.grid.num_tiles, D)


def reference_weights(x: torch.Tensor, plan: MergePlan, tau: float):
    """The method as stated (module docstring of toma_core/plan.py), one tile at a time: (M, U) as (B, T, D, S) and (B, T, S, D), dead slots zero."""
    grid = plan.grid
    tiles = F.normalize(tile_tokens(x.double(), grid), dim=-1, eps=1e-6)
    B, T, S, _ = tiles.shape
    D = plan.destinations.shape[-1]
    M = torch.zeros(B, T, D, S, dtype=torch.float64)
    U = torch.zeros(B, T, S, D, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            dests = [int(d) for d in plan.destinations[b, t] if d >= 0]
            Xn = tiles[b, t]
            A = (tau * Xn[dests] @ Xn.T).softmax(dim=0) * grid.valid[t]
            M[b, t, : len(dests)] = A / A.sum(1, keepdim=True)
            U[b, t, :, : len(dests)] = A.T
    return M, U


def weight_atol(tau: float) -> float:
    """The engine's logits tau * cos are fp32: an absolute error of about tau * 1e-7 reaches the weights."""
    return 1e-5 + 2e-7 * tau


def top2_gap(x: torch.Tensor, plan: MergePlan) -> torch.Tensor:
    """(B, T): over the tile's real tokens, the smallest gap between the best and second-best cosine to a
    destination. tau * gap large means the softmax is hard for every token of the tile."""
    feats = F.normalize(tile_tokens(x.double(), plan.grid), dim=-1, eps=1e-6)
    dst = feats.gather(2, plan.destinations.clamp(min=0)[..., None].expand(-1, -1, -1, feats.shape[-1]))
    cos = (dst @ feats.transpose(-1, -2)).masked_fill(plan.destinations[..., None] < 0, float("-inf"))
    if cos.shape[2] == 1:
        return torch.full(cos.shape[:2], float("inf"), dtype=torch.float64)
    top = cos.topk(2, dim=2).values
    gap = (top[:, :, 0] - top[:, :, 1]).masked_fill(~plan.grid.valid, float("inf"))
    return gap.nan_to_num(nan=float("inf"), posinf=float("inf")).amin(-1)


def palette_tokens(hw, tile, ratio, temporal_window=1, C=32, seed=0):
    """Tokens drawn from a few random vectors, no more per tile than the tile keeps destinations."""
    g = gen(seed)
    P = min(4, int(destinations_per_tile(token_grid(hw, tile, temporal_window), ratio).min()))
    palette = torch.randn(P, C, generator=g) * torch.rand(P, 1, generator=g).add(0.5)
    return palette[torch.randint(P, (2, math.prod(hw)), generator=g)]


@pytest.mark.parametrize("ratio", [0.5, 0.75])
@pytest.mark.parametrize("hw,tile,temporal_window", CASES)
def test_unmerge_of_merge_recovers_tokens_that_are_equal_within_each_group(hw, tile, temporal_window, ratio):
    x = palette_tokens(hw, tile, ratio, temporal_window)
    plan = plan_tiles(x, hw, tile, ratio, generator=gen(1), temporal_window=temporal_window)
    merged = plan.merge(x)
    assert merged.shape == (2, plan.num_merged, x.shape[-1])
    assert torch.allclose(plan.unmerge(merged), x, atol=1e-5)


@pytest.mark.parametrize("hw,tile,temporal_window", [((8, 8), 4, 1), ((6, 10), 4, 1), ((7, 9), 3, 1), ((16, 16), 4, 1),
                                                 ((12, 12), 8, 1), ((4, 8, 8), 4, 2), ((3, 7, 9), 3, 2)])
def test_unmerge_is_the_pseudo_inverse_where_the_softmax_is_hard(hw, tile, temporal_window):
    # U = A^T equals pinv(M) only when A is hard. On random tokens at tau = 1000 that holds tile by tile
    # where every token's best destination beats its runner-up by a cosine margin of ~0.01 or more; with
    # high-dimensional random tokens (cosines all near 0) many tiles miss that margin and the transpose is
    # only close (see test_soft_ties_split_weight). Low-dimensional tokens keep most tiles hard.
    tau = DEFAULT_TAU
    x = torch.randn(2, math.prod(hw), 8, generator=gen(hw[0] + tile))
    plan = plan_tiles(x, hw, tile, 0.5, tau=tau, generator=gen(2), temporal_window=temporal_window)
    M, U = plan.merge_weights.double(), plan.unmerge_weights.double()
    pinv = torch.linalg.pinv(M)
    rel = torch.linalg.matrix_norm(U - pinv) / torch.linalg.matrix_norm(pinv)  # (B, T)
    hard = top2_gap(x, plan) * tau > 12  # every token's runner-up destination gets < exp(-12) of its weight
    assert hard.float().mean() >= 0.6, "too few hard tiles for the test to mean anything"
    assert rel[hard].max() < 1e-3
    # and on hard tiles merge . unmerge is the identity on the merged tokens (M A^T = I)
    MU = M @ U
    eye = torch.diag_embed(live_mask(plan).double()).expand_as(MU)
    assert (MU - eye).abs()[hard].max() < 1e-5


def test_soft_ties_split_weight():
    # A token equally close to two destinations is shared between them, so there A^T is not pinv(M).
    g = gen(12)
    a, b = torch.randn(2, 16, generator=g)
    tie = F.normalize(a, dim=0) + F.normalize(b, dim=0)  # exactly as close to a as to b
    x = torch.stack([a, b, a + 1e-3 * b, tie]).view(1, 4, 16)  # a 2x2 grid: one tile, keeps 2
    plan = plan_tiles(x, (2, 2), 2, 0.5, destinations=torch.tensor([[[0, 1]]]))
    A = plan.unmerge_weights[0, 0]  # (S, D) = A^T
    assert torch.allclose(A[:3], torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), atol=1e-6)
    assert torch.allclose(A[3], torch.tensor([0.5, 0.5]), atol=1e-3)
    pinv = torch.linalg.pinv(plan.merge_weights[0, 0].double())
    assert float((A.double() - pinv).norm() / pinv.norm()) > 0.05


def test_pseudo_inverse_on_well_separated_tokens_everywhere():
    hw, tile = (12, 12), 4
    x = palette_tokens(hw, tile, 0.5, C=64, seed=3)
    plan = plan_tiles(x, hw, tile, 0.5)
    pinv = torch.linalg.pinv(plan.merge_weights.double())
    U = plan.unmerge_weights.double()
    assert float(torch.linalg.vector_norm(U - pinv) / torch.linalg.vector_norm(pinv)) < 1e-3


@pytest.mark.parametrize("hw,tile,temporal_window", [((8, 8), 4, 1), ((6, 10), 4, 1), ((3, 6, 5), 2, 2)])
def test_exact_unmerge_at_soft_tau(hw, tile, temporal_window):
    x = torch.randn(2, math.prod(hw), 16, generator=gen(4))
    soft = plan_tiles(x, hw, tile, 0.5, tau=5.0, temporal_window=temporal_window)
    exact = plan_tiles(x, hw, tile, 0.5, tau=5.0, exact=True, temporal_window=temporal_window)
    assert torch.equal(exact.destinations, soft.destinations)
    assert torch.equal(exact.merge_weights, soft.merge_weights)
    pinv = torch.linalg.pinv(exact.merge_weights)
    assert torch.allclose(exact.unmerge_weights, pinv, atol=1e-5)
    # at tau = 5 the transpose is far from the pseudo-inverse: exact=True is what makes the difference
    rel = torch.linalg.vector_norm(soft.unmerge_weights - pinv) / torch.linalg.vector_norm(pinv)
    assert rel > 0.05
    y = torch.randn(2, exact.num_merged, 16, generator=gen(5))
    assert torch.allclose(exact.merge(exact.unmerge(y)), y, atol=1e-4)
    assert not torch.allclose(soft.merge(soft.unmerge(y)), y, atol=1e-2)


def test_weights_match_the_formula_tile_by_tile():
    for hw, tile, temporal_window, tau in [((6, 10), 4, 1, DEFAULT_TAU), ((7, 9), 3, 1, 20.0), ((8, 8), 4, 1, 5.0),
                                       ((3, 6, 10), 4, 2, DEFAULT_TAU), ((5, 7, 9), 3, 3, 20.0)]:
        x = torch.randn(2, math.prod(hw), 12, generator=gen(tile))
        plan = plan_tiles(x, hw, tile, 0.5, tau=tau, temporal_window=temporal_window)
        M, U = reference_weights(x, plan, tau)
        assert torch.allclose(plan.merge_weights.double(), M, atol=weight_atol(tau))
        assert torch.allclose(plan.unmerge_weights.double(), U, atol=weight_atol(tau))


@pytest.mark.parametrize("hw,tile,temporal_window", CASES)
def test_ratio_zero_is_the_identity(hw, tile, temporal_window):
    x = torch.randn(2, math.prod(hw), 8, generator=gen(0))
    plan = plan_tiles(x, hw, tile, 0.0, temporal_window=temporal_window)
    assert isinstance(plan, IdentityPlan)
    assert plan.num_merged == x.shape[1]
    assert torch.equal(plan.merge(x), x)
    assert torch.equal(plan.unmerge(x), x)
    assert torch.equal(plan.destination_tokens(), torch.arange(x.shape[1]).expand(2, -1))


@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5, 0.6, 0.75, 0.9])
@pytest.mark.parametrize("hw,tile,temporal_window", CASES + [((5, 5), 4, 1), ((3, 17), 8, 1), ((3, 3, 5), 4, 2)])
def test_token_counts(hw, tile, temporal_window, ratio):
    grid = token_grid(hw, tile, temporal_window)
    keep = destinations_per_tile(grid, ratio)
    real = grid.valid.sum(-1)
    assert ((keep - real * (1 - ratio)).abs() <= 0.5 + 1e-6).logical_or(keep == 1).all()
    assert (keep >= 1).all() and (keep <= real).all()
    x = torch.randn(1, grid.num_tokens, 4, generator=gen(1))
    plan = plan_tiles(x, hw, tile, ratio, generator=gen(0), temporal_window=temporal_window)
    assert plan.num_merged == int(keep.sum())
    assert plan.merge(x).shape == (1, int(keep.sum()), 4)
    assert plan.destination_tokens().shape == (1, int(keep.sum()))
    assert plan.unmerge(plan.merge(x)).shape == x.shape
    assert ((plan.destinations >= 0).sum(-1) == keep).all()  # each tile uses exactly its quota


@pytest.mark.parametrize("tau", [DEFAULT_TAU, 5.0])
@pytest.mark.parametrize("hw,tile,temporal_window", CASES)
def test_rows_of_merge_and_unmerge_sum_to_one(hw, tile, temporal_window, tau):
    x = torch.randn(2, math.prod(hw), 16, generator=gen(7))
    plan = plan_tiles(x, hw, tile, 0.5, tau=tau, generator=gen(0), temporal_window=temporal_window)
    live = live_mask(plan).expand(2, -1, -1)
    rows_m = plan.merge_weights.sum(-1)
    assert torch.allclose(rows_m[live], torch.ones(()), atol=1e-5)
    assert (rows_m[~live] == 0).all()
    rows_u = plan.unmerge_weights.sum(-1)
    valid = plan.grid.valid.expand(2, -1, -1)
    assert torch.allclose(rows_u[valid], torch.ones(()), atol=1e-5)
    assert (rows_u[~valid] == 0).all()
    assert (plan.merge_weights >= 0).all() and (plan.unmerge_weights >= 0).all()


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 1e-2), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("hw,tile,temporal_window",
                         [((8, 8), 4, 1), ((6, 10), 4, 1), ((10, 9), 16, 1), ((3, 6, 10), 4, 2)])
def test_half_precision(hw, tile, temporal_window, dtype, atol):
    x = torch.randn(2, math.prod(hw), 32, generator=gen(8)).to(dtype)
    plan = plan_tiles(x, hw, tile, 0.5, generator=gen(3), temporal_window=temporal_window)
    # same values, fp32 weights
    ref = plan_tiles(x.float(), hw, tile, 0.5, generator=gen(3), temporal_window=temporal_window)
    assert torch.equal(plan.destinations, ref.destinations)
    assert plan.merge_weights.dtype == dtype and plan.unmerge_weights.dtype == dtype
    assert torch.equal(plan.merge_weights, ref.merge_weights.to(dtype))
    merged = plan.merge(x)
    out = plan.unmerge(merged)
    assert merged.dtype == dtype and out.dtype == dtype
    assert torch.isfinite(merged).all() and torch.isfinite(out).all()
    ref_merged = ref.merge(x.float())
    assert torch.allclose(merged.float(), ref_merged, atol=atol, rtol=atol)
    assert torch.allclose(out.float(), ref.unmerge(ref_merged), atol=2 * atol, rtol=2 * atol)


@pytest.mark.parametrize("hw,tile,temporal_window", CASES)
def test_given_destinations_are_kept_and_weights_refreshed(hw, tile, temporal_window):
    g = gen(9)
    x1 = torch.randn(2, math.prod(hw), 16, generator=g)
    x2 = torch.randn(2, math.prod(hw), 16, generator=g)
    first = plan_tiles(x1, hw, tile, 0.5, generator=gen(0), temporal_window=temporal_window)
    again = plan_tiles(x1, hw, tile, 0.5, destinations=first.destinations, temporal_window=temporal_window)
    assert torch.equal(again.destinations, first.destinations)
    assert torch.equal(again.merge_weights, first.merge_weights)
    assert torch.equal(again.unmerge_weights, first.unmerge_weights)
    reused = plan_tiles(x2, hw, tile, 0.5, destinations=first.destinations, temporal_window=temporal_window)
    assert torch.equal(reused.destinations, first.destinations)
    assert not torch.allclose(reused.merge_weights, first.merge_weights)
    M, U = reference_weights(x2, reused, DEFAULT_TAU)
    assert torch.allclose(reused.merge_weights.double(), M, atol=weight_atol(DEFAULT_TAU))
    assert torch.allclose(reused.unmerge_weights.double(), U, atol=weight_atol(DEFAULT_TAU))


def test_given_destinations_of_the_wrong_shape_raise():
    x = torch.randn(2, 64, 8, generator=gen(0))
    plan = plan_tiles(x, (8, 8), 4, 0.5)
    with pytest.raises(ValueError, match="destinations"):
        plan_tiles(x[:1], (8, 8), 4, 0.5, destinations=plan.destinations)
    with pytest.raises(ValueError, match="destinations"):
        plan_tiles(x, (8, 8), 2, 0.5, destinations=plan.destinations)
    with pytest.raises(ValueError, match="ratio"):
        plan_tiles(x, (8, 8), 4, 1.0)
    video = torch.randn(1, 4 * 64, 8, generator=gen(1))
    plan = plan_tiles(video, (4, 8, 8), 4, 0.5, temporal_window=2)
    with pytest.raises(ValueError, match="destinations"):
        plan_tiles(video, (4, 8, 8), 4, 0.5, destinations=plan.destinations, temporal_window=1)
    with pytest.raises(ValueError, match="temporal_window must be >= 1"):
        plan_tiles(video, (4, 8, 8), 4, 0.0, temporal_window=0)
    with pytest.raises(ValueError, match="tokens"):
        plan_tiles(video, (3, 8, 8), 4, 0.5)


def test_unmerge_refuses_tokens_it_did_not_merge():
    x = torch.randn(2, 64, 8, generator=gen(0))
    plan = plan_tiles(x, (8, 8), 4, 0.5)
    merged = plan.merge(x)
    for wrong in (merged[:, :-1], merged[:1], merged.reshape(4, -1, 8), x):
        with pytest.raises(ValueError, match="unmerge expects"):
            plan.unmerge(wrong)
    assert plan.unmerge(merged).shape == x.shape


@pytest.mark.parametrize("hw,tile,temporal_window", CASES)
def test_destination_tokens_name_the_destinations(hw, tile, temporal_window):
    x = torch.randn(2, math.prod(hw), 8, generator=gen(10))
    plan = plan_tiles(x, hw, tile, 0.5, generator=gen(0), temporal_window=temporal_window)
    raster = plan.destination_tokens()
    assert raster.shape == (2, plan.num_merged)
    tiles = tile_tokens(x, plan.grid)
    T, D = plan.destinations.shape[1:]
    live = live_mask(plan)
    for b in range(2):
        assert len(set(raster[b].tolist())) == plan.num_merged
        expected = torch.stack([tiles[b, t, plan.destinations[b, t, d]]
                                for t in range(T) for d in range(D) if live[t, d]])
        assert torch.equal(x[b, raster[b]], expected)


def test_stochastic_selector_on_large_tiles_is_seeded():
    x = torch.randn(1, 20 * 24, 16, generator=gen(11))
    a = plan_tiles(x, (20, 24), 16, 0.75, generator=gen(1))
    b = plan_tiles(x, (20, 24), 16, 0.75, generator=gen(1))
    c = plan_tiles(x, (20, 24), 16, 0.75, generator=gen(2))
    assert torch.equal(a.destinations, b.destinations)
    assert not torch.equal(a.destinations, c.destinations)


@pytest.mark.parametrize("hw,tile,temporal_window", CASES)
def test_padding_is_never_a_destination_and_gets_no_weight(hw, tile, temporal_window):
    x = torch.randn(2, math.prod(hw), 8, generator=gen(13))
    plan = plan_tiles(x, hw, tile, 0.5, generator=gen(0), temporal_window=temporal_window)
    valid = plan.grid.valid.expand(2, -1, -1)  # (B, T, S)
    used = plan.destinations >= 0
    assert valid.gather(2, plan.destinations.clamp(min=0))[used].all()
    assert (plan.merge_weights.transpose(-1, -2)[~valid] == 0).all()  # padding adds nothing to a merged token
    assert (plan.unmerge_weights[~valid] == 0).all()  # and receives nothing back


@pytest.mark.parametrize("hw,tile,temporal_window", IMAGE_CASES)
def test_a_one_frame_video_is_planned_exactly_as_the_image(hw, tile, temporal_window):
    x = torch.randn(2, math.prod(hw), 16, generator=gen(14))
    image = plan_tiles(x, hw, tile, 0.5, generator=gen(0))
    video = plan_tiles(x, (1, *hw), tile, 0.5, generator=gen(0), temporal_window=temporal_window)
    assert video.grid == image.grid
    for a, b in [(video.destinations, image.destinations), (video.merge_weights, image.merge_weights),
                 (video.unmerge_weights, image.unmerge_weights), (video.merge(x), image.merge(x)),
                 (video.destination_tokens(), image.destination_tokens())]:
        assert torch.equal(a, b)


@pytest.mark.parametrize("thw,tile", [((3, 8, 8), 4), ((2, 7, 9), 3)])
def test_one_frame_per_window_plans_each_frame_as_an_image(thw, tile):
    frames, h, w = thw
    x = torch.randn(2, frames * h * w, 16, generator=gen(15))
    video = plan_tiles(x, thw, tile, 0.5, temporal_window=1)
    images = [plan_tiles(f, (h, w), tile, 0.5) for f in x.split(h * w, dim=1)]
    assert torch.equal(video.destinations, torch.cat([p.destinations for p in images], dim=1))
    assert torch.allclose(video.merge_weights, torch.cat([p.merge_weights for p in images], dim=1), atol=1e-6)
    merged = video.merge(x)
    assert torch.allclose(merged, torch.cat([p.merge(f) for p, f in zip(images, x.split(h * w, dim=1))], 1), atol=1e-5)
    offsets = [k * h * w for k in range(frames)]
    expected = torch.cat([p.destination_tokens() + o for p, o in zip(images, offsets)], dim=1)
    assert torch.equal(video.destination_tokens(), expected)


def test_windows_over_two_frames_merge_a_still_frame_into_the_other():
    # A still video: frame 2 repeats frame 1. A window over both frames keeps half its tokens and loses
    # nothing (each token merges into its twin); windows of one frame must merge different random tokens.
    h, w, tile = 8, 8, 4
    frame = torch.randn(2, h * w, 16, generator=gen(16))
    x = torch.cat([frame, frame], dim=1)
    across = plan_tiles(x, (2, h, w), tile, 0.5, temporal_window=2)
    within = plan_tiles(x, (2, h, w), tile, 0.5, temporal_window=1)
    assert across.num_merged == within.num_merged == h * w
    assert torch.allclose(across.unmerge(across.merge(x)), x, atol=1e-5)
    assert float((within.unmerge(within.merge(x)) - x).norm() / x.norm()) > 0.3


@pytest.mark.parametrize("hw,tile,temporal_window", CASES)
@pytest.mark.parametrize("exact", [False, True])
def test_dense_operators_merge_and_unmerge_as_the_windows_do(hw, tile, temporal_window, exact):
    # one GEMM each way with the windows folded in, padded grids and edge tiles that keep fewer
    # destinations included; the same plan otherwise
    x = torch.randn(2, math.prod(hw), 8, generator=gen(16))
    windowed = plan_tiles(x, hw, tile, 0.6, generator=gen(0), temporal_window=temporal_window, exact=exact, dense=False)
    dense = plan_tiles(x, hw, tile, 0.6, generator=gen(0), temporal_window=temporal_window, exact=exact, dense=True)
    assert windowed.dense is None
    assert [t.shape for t in dense.dense] == [(2, windowed.num_merged, math.prod(hw)), (2, math.prod(hw), windowed.num_merged)]
    assert torch.equal(dense.destinations, windowed.destinations)
    merged = dense.merge(x)
    assert torch.allclose(merged, windowed.merge(x), atol=1e-5)
    y = torch.randn(merged.shape, generator=gen(17))
    assert torch.allclose(dense.unmerge(y), windowed.unmerge(y), atol=1e-5)
    assert torch.allclose(dense.unmerge_update(x, merged, y), windowed.unmerge_update(x, merged, y), atol=1e-5)


def test_dense_operators_where_launches_cost_more_than_the_arithmetic():
    from toma_core.plan import DENSE_MAX_MERGED, dense_operators

    meta, cpu = torch.device("meta"), torch.device("cpu")
    assert dense_operators(meta, 1024, 4096) and dense_operators(torch.device("cuda"), 256, 1024)
    assert not dense_operators(cpu, 256, 1024)  # a CPU pays arithmetic, not launches
    assert not dense_operators(meta, DENSE_MAX_MERGED + 1, 4 * DENSE_MAX_MERGED)
    assert not dense_operators(meta, 1024, 75_600)  # a video grid: the dense matrices would not fit
    x = torch.randn(1, 64, 8, dtype=torch.bfloat16, device="meta")
    plan = plan_tiles(x, (8, 8), 4, 0.5)
    assert plan.dense is not None and plan.merge(x).shape == (1, 32, 8)
    assert plan_tiles(torch.randn(1, 64, 8), (8, 8), 4, 0.5).dense is None


def test_destination_tokens_are_made_once_per_plan():
    # every block of a DiT group asks for them to cut its positional table: one set of kernels per plan
    x = torch.randn(2, 48, 8, generator=gen(18))
    plan = plan_tiles(x, (6, 8), 4, 0.5)
    first = plan.destination_tokens()
    assert plan.destination_tokens() is first
    assert first.shape == (2, plan.num_merged)


def test_what_a_group_derives_from_the_same_tensors_is_made_once_per_plan():
    x = torch.randn(1, 16, 8, generator=gen(19))
    plan = plan_tiles(x, (4, 4), 2, 0.5)
    pe, made = torch.randn(16, 4), []

    def make():
        made.append(1)
        return pe[:8] * 2

    first = plan.derived("positions", (0, "layout"), (pe, None), make)
    assert plan.derived("positions", (0, "layout"), (pe, None), make) is first and len(made) == 1
    plan.derived("positions", (0, "layout"), (pe.clone(), None), make)  # another call's table: made again
    plan.derived("positions", (1, "layout"), (pe, None), make)  # another text length
    assert len(made) == 3


def test_traced_code_keeps_the_windowed_form_and_caches_nothing(monkeypatch):
    import toma_core.plan as plan_module

    x = torch.randn(1, 64, 8, dtype=torch.bfloat16, device="meta")
    assert plan_tiles(x, (8, 8), 4, 0.5).dense is not None
    monkeypatch.setattr(plan_module, "is_compiling", lambda: True)  # as inside torch.compile
    plan = plan_tiles(x, (8, 8), 4, 0.5)
    assert plan.dense is None
    made = []
    for _ in range(2):
        plan.derived("positions", 0, (x,), lambda: made.append(1))
    assert len(made) == 2


def test_a_plan_built_merged_and_unmerged_compiles_with_inductor_as_one_graph():
    """The tiny inductor case of issue 27: a plan built from the tokens (the stochastic selection of
    256-token windows, its keys hashed from a seed tensor), tokens merged, changed and unmerged, compiled
    whole by inductor (C++ generated on the CPU; fullgraph, so any graph break is an error) gives eager's
    picks and result, and a new seed compiles nothing new. Ratio 0.875 keeps 32 destinations a window: two of
    the selector's key chunks (KEY_CHUNK picks each), so the chunked keys are compiled, and the graph (which
    unrolls a pick at a time) is a quarter of ratio 0.5's; the other compile tests use dynamo's eager backends."""
    from torch._dynamo.utils import counters
    from toma_core.selection import KEY_CHUNK

    def merged_then_unmerged(x, seed):
        plan = plan_tiles(x, (16, 16), 16, 0.875, seed=seed)
        return plan.destinations, plan.unmerge(plan.merge(x) * 2.0)

    x = torch.randn(2, 256, 32, generator=gen(0))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(merged_then_unmerged, backend="inductor", fullgraph=True)
    for seed in (3, 4):
        seed = torch.tensor(seed, dtype=torch.int64)
        picks, out = compiled(x, seed)
        eager_picks, eager_out = merged_then_unmerged(x, seed)
        assert picks.shape[-1] == 2 * KEY_CHUNK and torch.equal(picks, eager_picks)
        torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1  # the second seed recompiles nothing
    torch._dynamo.reset()


# Slabs of a 5 x 7 x 10 grid as raylight cuts 350 tokens over 3 ranks (117 a rank, the last short), and the
# slabs of a 4 x 6 x 8 grid over 2 ranks: two whole frames each, the 2-frame windows whole
CUT_SLABS = ((5, 7, 10), ((0, 117), (117, 234), (234, 350)))
WHOLE_SLABS = ((4, 6, 8), ((0, 96), (96, 192)))


def test_slabs_of_whole_windows_plan_as_the_whole_grid():
    """Slabs whose bounds fall between windows merge exactly as the whole grid's plan does on their tokens."""
    from toma_core.tiles import Slab

    shape, bounds = WHOLE_SLABS
    x = torch.randn(2, math.prod(shape), 16, generator=gen(5))
    whole = plan_tiles(x, shape, 4, 0.5, temporal_window=2)
    parts = [plan_tiles(x[:, b:e], Slab(shape, b, e), 4, 0.5, temporal_window=2) for b, e in bounds]
    assert torch.equal(torch.cat([p.merge(x[:, b:e]) for p, (b, e) in zip(parts, bounds)], 1), whole.merge(x))
    assert torch.equal(torch.cat([p.destination_tokens() + b for p, (b, _) in zip(parts, bounds)], 1),
                       whole.destination_tokens())


@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_slabs_that_cut_windows_merge_their_own_tokens_to_equal_lengths(ratio):
    """Each slab's windows are the grid's cut to it: every token of the slab in one window, destinations only
    among the slab's tokens, the unmerge of a merge of equal tokens the tokens themselves; with the extra
    destinations slab_extras gives them, every slab merges to as many tokens (the longest at the ratio)."""
    from toma_core.plan import kept_per_tile, slab_extras
    from toma_core.tiles import Slab

    shape, bounds = CUT_SLABS
    grids = [token_grid(Slab(shape, b, e), 4, 2) for b, e in bounds]
    for grid, (b, e) in zip(grids, bounds):
        ids = torch.arange(b, e, dtype=torch.float32).view(1, -1, 1)
        tiles = tile_tokens(ids, grid)[0, ..., 0]
        assert sorted(tiles[grid.valid].tolist()) == list(range(b, e))  # each token in one slot
        assert (tiles[~grid.valid] == 0).all()
    fixed = (0, 0, 1)  # the last rank's padding token stays a token of its own
    extras = slab_extras(tuple(grids), fixed, ratio)
    kept = [sum(kept_per_tile(g, ratio)) for g in grids]
    assert [f + k + x for f, k, x in zip(fixed, kept, extras)] == [max(f + k for f, k in zip(fixed, kept))] * 3
    for (b, e), extra in zip(bounds, extras):
        x = torch.randn(1, e - b, 8, generator=gen(b))
        plan = plan_tiles(x, Slab(shape, b, e, extra), 4, ratio, temporal_window=2)
        assert plan.num_merged == max(f + k for f, k in zip(fixed, kept)) - fixed[bounds.index((b, e))]
        destinations = plan.destination_tokens()
        assert destinations.min() >= 0 and destinations.max() < e - b
        same = x.mean(1, keepdim=True).expand_as(x)  # equal tokens: merging loses nothing
        assert torch.allclose(plan.unmerge(plan.merge(same)), same, atol=1e-5)


def test_slab_extras_say_when_a_slab_cannot_keep_as_many():
    from toma_core.plan import slab_extras
    from toma_core.tiles import Slab

    shape, bounds = CUT_SLABS
    grids = tuple(token_grid(Slab(shape, b, e), 4, 2) for b, e in bounds)
    with pytest.raises(ValueError, match="cannot keep"):
        slab_extras(grids, (100, 0, 0), 0.5)


@pytest.mark.parametrize("hw,tile,temporal_window", CASES)
def test_rotation_counts_each_builds_destinations_and_steers_the_next(hw, tile, temporal_window):
    """With rotation a plan carries how often each window slot was a destination, its own included (0 and 1
    at the first build, padding and unused slots never counted); given those counts the next build on the
    same tokens keeps fewer of the destinations than a build without them, and adds its own to the counts.
    A weight refresh of given destinations carries no counts; without rotation a plan carries none."""
    x = torch.randn(2, math.prod(hw), 16, generator=gen(5))
    first = plan_tiles(x, hw, tile, 0.5, temporal_window=temporal_window, seed=torch.tensor(1), rotation=1.0)
    assert plan_tiles(x, hw, tile, 0.5, temporal_window=temporal_window, seed=torch.tensor(1)).chosen is None
    mask = torch.zeros_like(first.chosen)
    for b, t, d in (first.destinations >= 0).nonzero().tolist():
        mask[b, t, first.destinations[b, t, d]] = 1.0
    assert torch.equal(first.chosen, mask)
    assert first.chosen.dtype == torch.float32 and not first.chosen[:, ~first.grid.valid].any()
    again = plan_tiles(x, hw, tile, 0.5, temporal_window=temporal_window, seed=torch.tensor(2), rotation=1.0)
    rotated = plan_tiles(x, hw, tile, 0.5, temporal_window=temporal_window, seed=torch.tensor(2), rotation=1.0,
                         chosen=first.chosen)
    new = rotated.chosen - first.chosen
    assert set(new.unique().tolist()) <= {0.0, 1.0} and torch.equal(new.sum(-1), mask.sum(-1))
    assert (new * mask).sum() < (again.chosen * mask).sum()
    refreshed = plan_tiles(x, hw, tile, 0.5, temporal_window=temporal_window, destinations=rotated.destinations,
                           rotation=1.0, chosen=rotated.chosen)
    assert refreshed.chosen is None and torch.equal(refreshed.destinations, rotated.destinations)
    with pytest.raises(ValueError, match="chosen"):
        plan_tiles(x, hw, tile, 0.5, temporal_window=temporal_window, rotation=1.0, chosen=first.chosen[:1])
