"""Sequence-parallel slabs (raylight, komikndr/raylight: xDiT's USP over several GPUs): each rank's blocks see one
contiguous slab of the model call's tokens, the last one padded, and Ulysses attention needs every rank to
hold as many tokens as the others. ToMA does not merge within slabs: it steps aside for such a model call
(its blocks run unmerged), counts it in the run report ("sequence-parallel slab") and says so once.

Simulated on the CPU in one process: the tiny Wan's ``forward_orig`` replaced, as raylight does, by
raylight's own ``usp_dit_forward`` read from a mirror of its repository (toma_bench/pack_source.py; skipped
with the reason where there is none), the model sampled once per rank with that rank's number. xfuser's
process group is a stand-in: the rank and world size, and an all-gather that repeats the rank's own slab
(the blocks, which this checks, never see it). A small stand-in, the block patch called per rank on the
padded slabs of one call, always runs.
"""
import logging
import types

import pytest
import torch

import dit_checks
from test_family_conformance import ROWS
from toma_bench import comfy_host, pack_source, sampling

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

WORLD = 3  # ranks: the odd Wan latent's 5 x 7 x 10 = 350 tokens pad to 351, 117 a rank


class ProcessGroup:
    """xfuser's sequence-parallel group as one rank of ``world`` sees it, in one process."""

    def __init__(self, world: int):
        self.world, self.rank = world, 0

    def all_gather(self, x, dim):
        return torch.cat([x] * self.world, dim=dim)


def module(name: str, **attributes) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []
    m.__dict__.update(attributes)
    return m


def raylight_wan(group: ProcessGroup):
    """raylight's diffusion_models/wan/xdit_context_parallel.py, imported from the mirror against stand-ins
    for xfuser and raylight's attention module (the blocks keep ComfyUI's attention, over their slab)."""
    distributed = module("xfuser.core.distributed", get_sequence_parallel_rank=lambda: group.rank,
                         get_sequence_parallel_world_size=lambda: group.world, get_sp_group=lambda: group)
    attention = module("raylight.distributed_modules.attention", get_attn_type=lambda: None,
                       get_sync_ulysses=lambda: False, make_xfuser_attention=lambda *a: None)
    stand_ins = {"xfuser": module("xfuser"), "xfuser.core": module("xfuser.core"),
                 "xfuser.core.distributed": distributed, "raylight": module("raylight"),
                 "raylight.distributed_modules": module("raylight.distributed_modules", attention=attention),
                 "raylight.distributed_modules.attention": attention,
                 "raylight.diffusion_models": module("raylight.diffusion_models"),
                 "raylight.diffusion_models.wan": module("raylight.diffusion_models.wan")}
    src = "src/raylight/diffusion_models"
    stand_ins["raylight.diffusion_models.utils"] = pack_source.load(
        "raylight", f"{src}/utils.py", stand_ins, "raylight.diffusion_models.utils")
    return pack_source.load("raylight", f"{src}/wan/xdit_context_parallel.py", stand_ins,
                            "raylight.diffusion_models.wan.xdit_context_parallel")


@pytest.fixture(scope="module")
def wan(pack):
    return ROWS["wan"].build()


def block_io(model):
    """{block index: [(input, output)]} of every call of the Wan blocks while it is open (forward hooks)."""
    seen, hooks = {}, []
    for i, block in enumerate(model.model.diffusion_model.blocks):
        hooks.append(block.register_forward_hook(
            lambda mod, args, out, i=i: seen.setdefault(i, []).append((args[0].clone(), out.clone()))))
    return seen, hooks


def sample_rank(model, usp_dit_forward, group, rank):
    """One step of the odd Wan latent on rank ``rank``: (block calls, output)."""
    group.rank = rank
    m = model.clone()
    m.add_object_patch("diffusion_model.forward_orig", types.MethodType(usp_dit_forward, m.model.diffusion_model))
    row = ROWS["wan"]
    seen, hooks = block_io(m)
    try:
        out = sampling.sample(m, row.text(1, row.texts[0], 0), torch.zeros(1, row.channels, 5, *row.sizes["odd"]),
                              steps=1, scheduler="simple")
    finally:
        for hook in hooks:
            hook.remove()
    return seen, out


def test_under_raylight_usp_toma_steps_aside_on_every_rank(pack, wan, caplog):
    """Each rank's blocks, merged ones included, run on the rank's slab exactly as without ToMA (every rank
    as many tokens, the last one padded), each rank's run reports its slab calls, and the log says it once."""
    reason = pack_source.missing("raylight")
    if reason:
        pytest.skip(reason)
    group = ProcessGroup(WORLD)
    usp = raylight_wan(group).usp_dit_forward
    patched, runtime = dit_checks.toma_patched(pack, wan)
    slab = -(-350 // WORLD)
    for rank in range(WORLD):
        expected, plain_out = sample_rank(wan, usp, group, rank)
        with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
            seen, out = sample_rank(patched, usp, group, rank)
        assert seen.keys() == expected.keys()
        for i, calls in seen.items():  # every block, merged ones included, ran on the rank's slab as it is
            assert [x.shape[1] for x, _ in calls] == [slab] and [y.shape[1] for _, y in calls] == [slab]
            assert all(torch.equal(a, b) for (x, y), (xe, ye) in zip(calls, expected[i]) for a, b in ((x, xe), (y, ye)))
        assert torch.equal(out, plain_out)
        assert not runtime.summary()["levels"]
        # one count per call of a block the node patched (one model call, cfg 1)
        assert runtime.summary()["unmerged"] == {pack.nodes.adapters.dit.SLAB: len(dit_checks.dit_patches(patched))}
    said = [r.getMessage() for r in caplog.records if "sequence parallelism" in r.getMessage()]
    assert len(said) == 1 and "steps aside" in said[0]


def test_a_block_called_on_padded_slabs_steps_aside_on_every_rank(pack, wan, caplog):
    """The stand-in: one Wan block call's tokens and RoPE rows padded to a multiple of the ranks and cut into
    contiguous slabs, as raylight does; each rank's call through ToMA's patch runs the block on its slab
    unmerged (the same output as the block alone), every rank keeps as many tokens, and the log says it
    once."""
    dit, wan_adapter = pack.nodes.adapters.dit, pack.nodes.adapters.wan
    dm = wan.model.diffusion_model
    layout = dit.ImageLayout(h=7, w=10, frames=5)
    pe = dm.rope_encode(5, 14, 20)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, layout.total, dm.dim, generator=g)
    e0 = torch.randn(1, 1, 6, dm.dim, generator=g)
    context = torch.randn(1, 9, dm.dim, generator=g)
    pad = -layout.total % WORLD
    xs = torch.cat([x, x.new_zeros(1, pad, dm.dim)], 1).chunk(WORLD, 1)
    pes = torch.cat([pe, pe.new_zeros(1, pad, *pe.shape[2:])], 1).chunk(WORLD, 1)
    _, runtime = dit_checks.toma_patched(pack, wan)
    runtime.begin_run()
    patch = wan_adapter.WanPatch(runtime)
    block = dm.blocks[3]

    def run(args):
        return {"img": block(args["img"], e=args["vec"], freqs=args["pe"], context=args["txt"],
                             transformer_options=args["transformer_options"])}

    outs = []
    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        for xr, per in zip(xs, pes):
            options = {"sigmas": torch.tensor([1.0]), dit.LAYOUT_KEY: layout}
            args = {"img": xr, "txt": context, "vec": e0, "pe": per, "transformer_options": options}
            outs.append(patch.block(args, {"original_block": run})["img"])
            assert torch.equal(outs[-1], run(args)["img"])
    assert {o.shape[1] for o in outs} == {(layout.total + pad) // WORLD}
    assert runtime.report().unmerged == {dit.SLAB: WORLD} and not runtime.report().plans
    assert sum("sequence parallelism" in r.getMessage() for r in caplog.records) == 1
