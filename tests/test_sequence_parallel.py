"""Sequence-parallel slabs (raylight, komikndr/raylight: xDiT's USP over several GPUs): each rank's blocks see one
contiguous slab of the model call's tokens, the last one padded, and Ulysses attention needs every rank to
hold as many tokens as the others. On Wan at scope block each rank merges its own slab: the call's windows cut
to the slab, one plan per slab, as many tokens kept on every rank. At the video default's scope (keys/values,
which xfuser's attention, taking no override, cannot run), other families' slabs and slabs whose rank no
xfuser group names, the model call steps aside, counted and said once.

Simulated on the CPU as raylight runs it, one process per rank: the tiny Wan, patched by ToMA (or not), is
forked into ``WORLD`` processes joined by a gloo process group; in each, raylight's own USP injection
(``USPInjectRegistry.inject``: ``usp_dit_forward`` as ``forward_orig``, its self- and cross-attention
forwards on every block), read from a mirror of its repository (toma_bench/pack_source.py; skipped with the
reason where there is none), runs against stand-ins for xfuser: the sequence-parallel rank and world from the
process group, its all-gather as gloo's, and for xfuser's Ulysses attention an exchange that gives each rank's
queries every rank's keys and values (what Ulysses' all-to-alls compute: every head attends over the whole
sequence), which fails where the ranks' slabs differ in length. A small stand-in, the block patch called per
rank on the padded slabs of one call, always runs.
"""
import logging
import math
import multiprocessing
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

import dit_checks
from test_family_conformance import ROWS
from toma_bench import comfy_host, pack_source, sampling
from toma_bench.metrics import relative_l2

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

WORLD = 3  # ranks: the odd Wan latent's 5 x 7 x 10 = 350 tokens pad to 351, 117 a rank
RANK_SECONDS = 300  # a rank process that has not finished by then has hung (a collective no other rank joined)
# How close the simulated ranks' output lies to one GPU's with the same node (relative L2, as a share of what
# ToMA changes on one GPU). Slabs that fall between windows plan as one GPU does, but for destinations a float
# rounding flips (the ranks' attention adds up in another order): a near-tie of the greedy picks the other token.
# Measured 0.016 of ToMA's change on 2026-12-04; 0.153 on 2026-12-07 (ComfyUI v0.3.64 and v0.33.0, torch 2.14.1),
# where one of a slab's 48 destinations flipped (ALIGNED_PICKS: the share of each slab's destinations that must
# be one GPU's). Slabs that cut windows merge their parts apart, so the merges differ (measured 0.74 of ToMA's
# change from one-GPU ToMA), at the same fidelity: the distance to the unpatched output, 1.02 times one GPU's
# (1.00 aligned).
ALIGNED_SHARE = 0.3
ALIGNED_PICKS = 0.95
FIDELITY_SHARE = 1.1


class SequenceParallel:
    """xfuser as one rank of a torch.distributed (gloo) group sees it: its rank and world size, its
    all-gather, and Ulysses attention, whose calls it records as (queries, keys) per rank."""

    def __init__(self):
        self.attention_calls = []

    @staticmethod
    def gathered(x: torch.Tensor) -> list:
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return parts

    def all_gather(self, x, dim):
        return torch.cat(self.gathered(x), dim=dim)

    def attention(self, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                  skip_output_reshape=False, **kwargs):
        """q, k, v (B, L, heads * d) of this rank's slab: the output of its queries over every rank's keys and
        values, in rank order (the sequence Ulysses' all-to-all hands each head)."""
        from comfy.ldm.modules.attention import optimized_attention

        assert mask is None and not skip_reshape and not skip_output_reshape
        self.attention_calls.append((q.shape[1], k.shape[1]))
        keys, values = torch.cat(self.gathered(k), 1), torch.cat(self.gathered(v), 1)
        return optimized_attention(q, keys, values, heads)


def inject_raylight(model, sp: SequenceParallel) -> None:
    """raylight's USP injection of ``model`` (a ModelPatcher) from the mirror, against ``sp`` for xfuser: its
    diffusion model's forward_orig and attention forwards replaced by raylight's, the stand-ins left in
    sys.modules (the rank process's own: ToMA reads the rank from xfuser's module)."""
    import torch.distributed as dist

    modules = pack_source.raylight_usp(dist.get_rank, dist.get_world_size, sp, sp.attention)
    sys.modules.update(modules)  # the injection imports raylight's modules when called
    modules["raylight.distributed_modules.usp"].USPInjectRegistry.inject(model, None, 0, False, True)


def block_lengths(model) -> tuple[dict, list]:
    """({block index: [tokens of each call]}, hooks) for the Wan blocks of ``model``."""
    seen, hooks = {}, []
    for i, block in enumerate(model.model.diffusion_model.blocks):
        hooks.append(block.register_forward_hook(
            lambda mod, args, out, i=i: seen.setdefault(i, []).append(args[0].shape[1])))
    return seen, hooks


def sample(model, frames: int, size: str, steps: int = 2) -> torch.Tensor:
    row = ROWS["wan"]
    return sampling.sample(model, row.text(1, row.texts[0], 0), torch.zeros(1, row.channels, frames, *row.sizes[size]),
                           steps=steps, scheduler="simple")


def rank_process(rank: int, world: int, rendezvous: str, out: str, models: dict, frames: int, size: str) -> None:
    """One rank: each of ``models`` ({name: (ModelPatcher, runtime or None)}) sampled under raylight's USP;
    what it ran and printed written to ``out`` (torch.save)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(dit_checks.LOGGER).addHandler(handler)
    sp = SequenceParallel()
    inject_raylight(next(iter(models.values()))[0], sp)  # on the diffusion model every clone shares
    result = {}
    for name, (model, runtime) in models.items():
        sp.attention_calls = []
        lengths, hooks = block_lengths(model)
        latent = sample(model, frames, size)
        for hook in hooks:
            hook.remove()
        result[name] = {"latent": latent, "blocks": lengths, "attention": sp.attention_calls,
                        "summary": None if runtime is None else runtime.summary(),
                        "destinations": None if runtime is None else
                        {str(key.level): plan.destination_tokens() for key, plan in runtime.report().plans.items()}}
    result["said"] = said
    dist.barrier()
    dist.destroy_process_group()
    torch.save(result, out)


def run_ranks(models: dict, frames: int, size: str, world: int = WORLD) -> list:
    """Every rank's result of rank_process, the ranks forked from this process (each with its copy of
    ``models``, as each GPU of raylight holds its own)."""
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="toma_ranks_") as folder:
        outs = [str(Path(folder) / f"rank{r}.pt") for r in range(world)]
        ranks = [context.Process(target=rank_process, args=(r, world, str(Path(folder) / "rendezvous"), outs[r],
                                                             models, frames, size)) for r in range(world)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(RANK_SECONDS)
        hung = [r for r, p in enumerate(ranks) if p.is_alive()]
        for p in ranks:
            if p.is_alive():
                p.kill()
        assert not hung, f"ranks {hung} did not finish in {RANK_SECONDS} s"
        assert [p.exitcode for p in ranks] == [0] * world, "a rank process failed (its traceback is above)"
        return [torch.load(o, weights_only=False) for o in outs]


@pytest.fixture(scope="module")
def wan(pack):
    return ROWS["wan"].build()


def needs_raylight():
    reason = pack_source.missing("raylight")
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("frames, size, world, aligned", [(4, "square", 2, True), (5, "odd", WORLD, False)],
                         ids=["aligned", "odd"])
def test_raylight_ranks_merge_their_slabs_to_equal_lengths(pack, wan, frames, size, world, aligned):
    """Under raylight's USP (its own code, ``world`` ranks), every merged block of every rank runs on as many
    tokens, fewer than its slab, the attention exchanging those (what the all-to-all moves), and the ranks'
    output is as close to the unpatched one as one-GPU ToMA's with the same node (FIDELITY_SHARE); where the
    slabs fall between windows (4 frames over 2 ranks: each slab two whole frames, one window deep) it is
    one-GPU ToMA's merge but for destinations a float rounding flips (ALIGNED_PICKS, ALIGNED_SHARE); the odd
    latent over 3 ranks (the last padded) cuts windows. Without ToMA the ranks reproduce one GPU (the simulation is faithful), and every
    rank's stats show its slab merged, nothing unmerged."""
    needs_raylight()
    patched, runtime = dit_checks.toma_patched(pack, wan, ratio=0.5, scope="block")
    one_gpu = {"plain": sample(wan, frames, size), "toma": sample(patched, frames, size)}
    (one_gpu_picks,) = [plan.destination_tokens() for plan in runtime.report().plans.values()]
    ranks = run_ranks({"plain": (wan, None), "toma": (patched, runtime)}, frames, size, world)
    row = ROWS["wan"]
    total = frames * math.prod(-(-s // row.patch) for s in row.sizes[size])
    slab = -(-total // world)
    merged_blocks = set(pack.nodes.adapters.layout.merged_blocks(len(wan.model.diffusion_model.blocks), "video"))
    slab_picks = []  # (begin, end, the destinations of the slab's plan) of every rank

    for r in ranks:
        plain, toma = r["plain"], r["toma"]
        assert all(n == [slab] * len(n) for n in plain["blocks"].values())
        assert {(slab, slab)} == set(plain["attention"][::2])  # self-attention: the slab's queries, keys, values
        lengths = {i: set(n) for i, n in toma["blocks"].items()}
        assert all(lengths[i] == {slab} for i in lengths if i not in merged_blocks)
        merged = {n for i in merged_blocks for n in lengths[i]}
        assert len(merged) == 1 and 0 < merged.pop() < slab
        summary = toma["summary"]
        assert not summary["unmerged"] and not summary["caveats"]
        (level,) = summary["levels"].values()  # one plan per slab (the group's blocks share it)
        begin, end = level["slab"]
        assert level["tokens"] == end - begin and level["merged_tokens"] < level["tokens"]
        for destinations in toma["destinations"].values():  # inside the slab's grid tokens: never padding
            assert 0 <= int(destinations.min()) and int(destinations.max()) < end - begin
            slab_picks.append((begin, end, destinations))
    # equal merged lengths on every rank: the exchange of keys and values needs them (gloo fails otherwise)
    assert len({n for r in ranks for i in merged_blocks for n in r["toma"]["blocks"][i]}) == 1
    self_attention = {q for r in ranks for q, _ in r["toma"]["attention"][::2]}
    assert min(self_attention) < slab
    slabs = sorted(tuple(r["toma"]["summary"]["levels"].popitem()[1]["slab"]) for r in ranks)
    assert slabs[0][0] == 0 and slabs[-1][1] == total and all(a[1] == b[0] for a, b in zip(slabs, slabs[1:]))

    for r in ranks:
        assert torch.equal(r["plain"]["latent"], ranks[0]["plain"]["latent"])
        assert torch.equal(r["toma"]["latent"], ranks[0]["toma"]["latent"])
    plain, toma = ranks[0]["plain"]["latent"], ranks[0]["toma"]["latent"]
    change = relative_l2(one_gpu["toma"], one_gpu["plain"])
    print(f"{frames} frames {size} over {world} ranks: USP unpatched vs one GPU {relative_l2(plain, one_gpu['plain']):.2e}; "
          f"USP + ToMA vs one-GPU ToMA {relative_l2(toma, one_gpu['toma']):.4f}, ToMA vs unpatched {change:.4f}, "
          f"USP + ToMA vs unpatched {relative_l2(toma, one_gpu['plain']):.4f}, vs USP unpatched {relative_l2(toma, plain):.4f}")
    padded = total % world != 0  # raylight's padding token is a key of its attention (measured: 6e-5)
    assert relative_l2(plain, one_gpu["plain"]) < (1e-3 if padded else 1e-5)
    assert relative_l2(toma, one_gpu["plain"]) < FIDELITY_SHARE * change
    if aligned:  # each slab two whole frames: the windows (2 frames deep) of one GPU
        for begin, end, picks in slab_picks:
            ones = {int(t) - begin for t in one_gpu_picks.flatten() if begin <= t < end}
            assert len(ones) == picks.numel() and len(ones & set(picks.flatten().tolist())) >= ALIGNED_PICKS * len(ones)
        assert relative_l2(toma, one_gpu["toma"]) < ALIGNED_SHARE * change


def test_a_block_called_on_padded_slabs_merges_each_to_equal_lengths(pack, wan, monkeypatch, caplog):
    """The stand-in: one Wan block call's tokens and RoPE rows padded to a multiple of the ranks and cut into
    contiguous slabs, as raylight does, each rank's call through ToMA's patch with xfuser's group naming the
    rank: at scope block the block runs on as many merged tokens on every rank, fewer than its slab, and the
    stats name each rank's slab. The basic node's video default (keys/values, which cannot reach xfuser's
    attention) steps aside on every rank, counted, and the log says to use scope block."""
    dit, wan_adapter = pack.nodes.adapters.dit, pack.nodes.adapters.wan
    layouts = pack.nodes.adapters.layout
    dm = wan.model.diffusion_model
    layout = layouts.ImageLayout(h=7, w=10, frames=5)
    pe = dm.rope_encode(5, 14, 20)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, layout.total, dm.dim, generator=g)
    e0 = torch.randn(1, 1, 6, dm.dim, generator=g)
    context = torch.randn(1, 9, dm.dim, generator=g)
    pad = -layout.total % WORLD
    xs = torch.cat([x, x.new_zeros(1, pad, dm.dim)], 1).chunk(WORLD, 1)
    pes = torch.cat([pe, pe.new_zeros(1, pad, *pe.shape[2:])], 1).chunk(WORLD, 1)
    group = types.SimpleNamespace(rank=0)
    monkeypatch.setitem(sys.modules, "xfuser.core.distributed", pack_source.stand_in_module(
        "xfuser.core.distributed", get_sequence_parallel_rank=lambda: group.rank,
        get_sequence_parallel_world_size=lambda: WORLD))
    block, lengths = dm.blocks[3], []

    def run(args):
        lengths.append(args["img"].shape[1])
        return {"img": block(args["img"], e=args["vec"], freqs=args["pe"], context=args["txt"],
                             transformer_options=args["transformer_options"])}

    def ranks(patch):
        outs = []
        for rank, (xr, per) in enumerate(zip(xs, pes)):
            group.rank = rank
            args = {"img": xr, "txt": context, "vec": e0, "pe": per,
                    "transformer_options": {"sigmas": torch.tensor([1.0]), layouts.LAYOUT_KEY: layout}}
            outs.append((patch.block(args, {"original_block": run})["img"], run(args)["img"]))
        return outs

    _, runtime = dit_checks.toma_patched(pack, wan, scope="block")
    runtime.begin_run()
    lengths.clear()
    for out, unmerged in ranks(wan_adapter.WanPatch(runtime)):
        assert out.shape == unmerged.shape and torch.isfinite(out).all() and not torch.equal(out, unmerged)
    merged = lengths[::2]  # each rank: the patched call, then the block alone
    assert len(set(merged)) == 1 and merged[0] < xs[0].shape[1]
    report = runtime.report()
    assert not report.unmerged and not report.caveats
    assert sorted(level.slab[:2] for level in report.levels) == [(0, 117), (117, 234), (234, 350)]

    (default,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(wan, -1, 0, 5)
    runtime = pack.nodes.runtime.runtime_of(default)
    runtime.begin_run()
    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        outs = ranks(wan_adapter.WanPatch(runtime, "keys/values", proportional=True))
    assert all(torch.equal(out, unmerged) for out, unmerged in outs)
    assert runtime.report().unmerged == {dit.SLAB: WORLD} and not runtime.report().plans
    said = [r.getMessage() for r in caplog.records if "sequence parallelism" in r.getMessage()]
    assert len(said) == 1 and "steps aside" in said[0] and "scope block" in said[0]


def test_without_a_sequence_parallel_group_slabs_step_aside(pack, wan, caplog):
    """Slabs whose rank no xfuser group names (ToMA cannot tell which slab a call holds) run unmerged,
    counted, and the log says why, once."""
    dit, wan_adapter = pack.nodes.adapters.dit, pack.nodes.adapters.wan
    layouts = pack.nodes.adapters.layout
    assert layouts.sequence_parallel_group() is None
    dm = wan.model.diffusion_model
    layout = layouts.ImageLayout(h=7, w=10, frames=5)
    g = torch.Generator().manual_seed(3)
    slab = -(-layout.total // WORLD)
    x = torch.randn(1, slab, dm.dim, generator=g)
    pe = dm.rope_encode(5, 14, 20)[:, :slab]
    _, runtime = dit_checks.toma_patched(pack, wan)
    runtime.begin_run()
    patch = wan_adapter.WanPatch(runtime)
    block = dm.blocks[3]

    def run(args):
        return {"img": block(args["img"], e=args["vec"], freqs=args["pe"], context=args["txt"],
                             transformer_options=args["transformer_options"])}

    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        for _ in range(2):
            options = {"sigmas": torch.tensor([1.0]), layouts.LAYOUT_KEY: layout}
            args = {"img": x, "txt": torch.randn(1, 9, dm.dim, generator=g), "vec": torch.randn(1, 1, 6, dm.dim),
                    "pe": pe, "transformer_options": options}
            assert torch.equal(patch.block(args, {"original_block": run})["img"], run(args)["img"])
    assert runtime.report().unmerged == {dit.SLAB: 2} and not runtime.report().plans
    said = [r.getMessage() for r in caplog.records if "sequence parallelism" in r.getMessage()]
    assert len(said) == 1 and "steps aside" in said[0] and "names the rank" in said[0]
