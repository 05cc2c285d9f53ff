"""Destination selection by greedy facility location, batched over every tile of every batch row.

F(D) = sum_j max_{i in D} sim(i, j) is monotone submodular when sim >= 0, so greedy picking reaches at
least (1 - 1/e) of the best D of the same size. All sets are processed at once: one loop over the k
picks, no loop over tiles or tokens.

Stochastic greedy's random candidates come from a counter-based hash of a seed tensor (``random_keys``),
not from a ``torch.Generator``: selection runs inside the diffusion model, which ComfyUI's
TorchCompileModel traces, and dynamo cannot pass a generator to an op (a graph break at every plan
built). The seed, one int64 scalar tensor, is drawn from the run's generator before the model call
(``draw_seed``, outside the traced code); inside, the keys are a few integer ops on it and an arange, so
they trace into the graph, cost no host-device sync, and the same seed gives the same picks eagerly and
compiled. Never the global RNG: selection without a seed uses seed 0.
"""
import math

import torch

# Above this many tokens per tile the exact greedy's O(k * S^2) per set stops being cheap next to the
# attention it saves (measured: 1-3% at S <= 64, 30-80% at S = 256), so we switch to stochastic greedy.
EXACT_GREEDY_MAX_TILE = 64
STOCHASTIC_EPSILON = 0.01
# Stochastic greedy hashes the random keys of this many picks at once: in eager code a dozen integer
# kernels per chunk instead of per pick (on a GPU fed by the host the launches are the cost), at a
# transient (chunk, sets, S) int64 buffer (19 MB for 150k tokens)
KEY_CHUNK = 16

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / the golden ratio: consecutive streams land far apart
_SPREAD = 0x61C88647  # 2^32 - _GOLDEN: as far apart, odd and below 2^31 (a 32-bit counter times it fits int64)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2^32) held in int64: the xor-shift-multiply shape of the "lowbias32" hash, with
    odd multipliers below 2^31 so that no product of a 32-bit value leaves int64 (overflow would be
    undefined in C++, and kernels of other backends might not wrap alike)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def draw_seed(generator: torch.Generator) -> torch.Tensor:
    """A seed for the stochastic selection: an int64 scalar in [0, 2^32) drawn from ``generator`` on its
    device (no host-device sync)."""
    return torch.randint(1 << 32, (), generator=generator, device=generator.device)


def seed_stream(seed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n``-th seed derived from ``seed`` (the builds of one model call share the call's seed, each
    with its own stream): traceable integer ops, no draw."""
    return _mix32((seed + n * _GOLDEN) & _M32)


def random_keys(seed: torch.Tensor, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
    """``shape`` float32 keys uniform in [0, 1) (multiples of 2^-24): element j (row-major) is a hash of
    the counter ``offset + j`` (below 2^32) and ``seed`` (an int64 scalar tensor, its low 32 bits), so any
    part of a stream is computed on its own."""
    count = math.prod(shape)
    if offset + count > 1 << 32:
        raise ValueError(f"random_keys counts up to 2^32, asked for counters {offset} to {offset + count}")
    # counter * (2^32 / golden ratio) plus the hashed seed, hashed: consecutive counters enter the hash far
    # apart (one round on adjacent inputs leaves a lag-1 correlation of 1e-3, measured), and so do seeds a
    # bit apart. Two seeds' streams overlap, shifted, only where their hashes lie closer than the stream
    # runs (a chance of count / 2^32); a second round would rule it out at twice the integer ops, for
    # nothing a selection notices.
    counters = torch.arange(offset * _SPREAD, (offset + count) * _SPREAD, _SPREAD, device=seed.device)
    counters = (counters.view(shape) + _mix32(seed & _M32)) & _M32
    return (_mix32(counters) >> 8).float().mul_(2.0 ** -24)


def cosine_similarity(x: torch.Tensor) -> torch.Tensor:
    """(..., S, C) -> (..., S, S) similarity (1 + cos) / 2 in [0, 1], fp32. Zero vectors give 0.5."""
    return unit_similarity(unit_vectors(x))


def unit_vectors(x: torch.Tensor) -> torch.Tensor:
    """L2-normalise the last dim in fp32, as F.normalize(eps=1e-6) but one multiply by the reciprocal norm
    (F.normalize divides by an expanded norm, a slow path: 2.5x slower on CPU)."""
    x = x.float()
    return x * torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-6).reciprocal()


def unit_similarity(xn: torch.Tensor) -> torch.Tensor:
    """:func:`cosine_similarity` of vectors that are already unit (or zero)."""
    return (xn @ xn.transpose(-1, -2)).add_(1.0).mul_(0.5).clamp_(0.0, 1.0)


def facility_location(sim: torch.Tensor, k: int, valid: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy facility location on a batch of similarity matrices.

    sim:   (..., S, S), non-negative; sim[..., i, j] = how well i represents j.
    valid: (..., S) bool, broadcastable; False marks padding, which is never chosen and never counted.
    bias:  (..., S) float, broadcastable, added to every candidate's gain (0: none): a negative bias makes a
           token less likely to be picked (rotating destinations: ``plan.plan_tiles``'s ``rotation``).
    Returns (..., k) long indices in pick order, no duplicates. Where a set has fewer than k valid
    tokens, the slots after the last valid pick are -1.
    """
    return _greedy(sim, k, valid, sample_size=None, seed=None, bias=bias)


def stochastic_facility_location(
    sim: torch.Tensor,
    k: int,
    valid: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    epsilon: float = STOCHASTIC_EPSILON,
    seed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stochastic greedy (Mirzasoleiman et al., 2015): each pick scores only a random sample of
    ceil(S/k * ln(1/epsilon)) candidates, giving (1 - 1/e - epsilon) in expectation at O(S) per pick
    instead of O(S^2). Same arguments and result as :func:`facility_location`. The samples are drawn by
    ``random_keys`` from ``seed`` (an int64 scalar tensor on sim's device, ``draw_seed``; what traced code
    passes), else from a seed drawn from ``generator``, else from seed 0. A ``bias`` is added to the random
    keys as to the gains (one penalty serves both): with a bias of -1 per earlier pick (keys lie in [0, 1))
    the sample takes the tokens picked fewest times first, at random among equals."""
    S = sim.shape[-1]
    sample = max(1, min(S, math.ceil(S / max(k, 1) * math.log(1.0 / epsilon))))
    return _greedy(sim, k, valid, sample_size=sample, seed=_seed(sim, generator, seed), bias=bias)


def _seed(sim: torch.Tensor, generator: torch.Generator | None, seed: torch.Tensor | None) -> torch.Tensor:
    if seed is not None:
        return seed
    if generator is not None:
        # a CPU generator may serve a meta-device plan (the cost model's recordings): moving a scalar from
        # the CPU there reads nothing; an accelerator's plans get a generator of their own device
        return draw_seed(generator).to(sim.device)
    return torch.zeros((), dtype=torch.long, device=sim.device)


def select_destinations(
    features: torch.Tensor, k: int, valid: torch.Tensor | None = None, generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """(..., S, C) tile features -> (..., k) destination indices; exact greedy for small tiles,
    stochastic greedy above ``EXACT_GREEDY_MAX_TILE`` tokens per tile (random from ``seed`` or
    ``generator``: see :func:`stochastic_facility_location`); ``bias`` added to each token's gain in both."""
    return select_by_similarity(cosine_similarity(features), k, valid, generator, seed, bias)


def select_by_similarity(sim, k, valid=None, generator=None, seed=None, bias=None) -> torch.Tensor:
    """:func:`select_destinations` from a ready (..., S, S) similarity."""
    if sim.shape[-1] <= EXACT_GREEDY_MAX_TILE:
        return facility_location(sim, k, valid, bias)
    return stochastic_facility_location(sim, k, valid, generator=generator, seed=seed, bias=bias)


def _greedy(sim, k, valid, sample_size, seed, bias=None):
    """Every set's k picks at once. A pick costs a handful of kernels (the loop runs k times per plan, and
    on a fast GPU the host's launches, not the arithmetic, are the cost): non-candidates carry a -inf
    penalty instead of a mask, the running best (value and index) comes from one max, and a set whose
    valid tokens are all picked is told apart after the loop by its -inf gains. Stochastic picks take
    their random keys from ``seed``, ``KEY_CHUNK`` picks' worth at a time: pick i's key of slot j in set p
    is counter (i * P + p) * S + j of the seed's stream. A ``bias`` seeds the penalty: added to every
    candidate's gain (and, stochastic, to its random key)."""
    *batch, S, S2 = sim.shape
    if S != S2:
        raise ValueError(f"sim must be square in its last two dims, got {tuple(sim.shape)}")
    if not 1 <= k <= S:
        raise ValueError(f"k must be in [1, {S}], got {k}")
    sim = sim.reshape(-1, S, S)
    P = sim.shape[0]
    if bias is None:
        penalty = sim.new_zeros(P, S)
    else:  # a copy of its own: picks are marked in it
        penalty = bias.to(device=sim.device, dtype=sim.dtype).expand(*batch, S).reshape(P, S).clone()
    if valid is not None:
        candidate = valid.to(device=sim.device, dtype=torch.bool).expand(*batch, S).reshape(P, S)
        sim = sim * candidate[:, None, :]  # padding needs no covering
        penalty.masked_fill_(~candidate, float("-inf"))
    cover = sim.new_zeros(P, S)
    rows = sim.view(P * S, S)
    row_of_set = torch.arange(0, P * S, S, device=sim.device) if sample_size is not None else None
    gains, picks = [], []
    for i in range(k):
        if sample_size is None:
            gain, best = ((sim - cover[:, None, :]).clamp_min_(0.0).sum(-1) + penalty).max(-1)
        else:
            if i % KEY_CHUNK == 0:
                chunk = random_keys(seed, (min(KEY_CHUNK, k - i), P, S), offset=i * P * S)
            keys = chunk[i % KEY_CHUNK] + penalty
            cand = keys.topk(sample_size, dim=-1).indices  # (P, R)
            cand_rows = rows.index_select(0, (cand + row_of_set[:, None]).view(-1)).view(P, sample_size, S)
            gain = (cand_rows - cover[:, None, :]).clamp_min_(0.0).sum(-1) + penalty.gather(1, cand)
            gain, at = gain.max(-1)
            best = cand.gather(1, at[:, None]).squeeze(1)
        gains.append(gain)
        picks.append(best)
        penalty.scatter_(1, best[:, None], float("-inf"))
        # a set with no candidate left picks a token it holds already (or padding, whose similarities
        # add nothing to a cover that is complete): the cover stays as it is
        cover = torch.maximum(cover, sim.gather(1, best.view(P, 1, 1).expand(P, 1, S)).view(P, S))
    picks = torch.stack(picks, 1)
    if valid is not None:  # without padding every set has S >= k candidates: no pick runs out
        picks.masked_fill_(torch.stack(gains, 1) == float("-inf"), -1)
    return picks.view(*batch, k)
