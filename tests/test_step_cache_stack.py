"""The node beside a step cache (nodes/runtime/step_caches.py, issue 45 part 2): it finds core's EasyCache and
LazyCache by their wrappers and TeaCache and MagCache by their options, whichever node comes first, says so once
in the log and in every run's stats, takes the stack setting where its ratio is auto (the stack's ratio; nothing
where LazyCache's threshold is low), keeps every setting where the ratio is set by hand, and leaves nothing of a
stack to a later run without the cache.

On the tiny random Flux of the conformance table. EasyCache and LazyCache come from the ComfyUI tree
(comfy_extras/nodes_easycache.py: v0.3.64 on; the cases skip with the reason in a tree without it), TeaCache and
MagCache from their mirrors (toma_bench/pack_source.py: skipped with the reason where their code does not load).
"""
import logging

import pytest
import torch

import dit_checks
from test_family_conformance import ROWS
from toma_bench import comfy_host, pack_source, sampling, step_caches

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

STEPS = 10  # over the image DiTs' short-run rule (8 steps), where the stack setting applies


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def flux(pack):
    import comfy.supported_models

    row = ROWS["flux"]
    if not hasattr(comfy.supported_models, row.host):
        pytest.skip(f"{row.host} is not in this ComfyUI (set COMFYUI_PATH to a tree of {row.tree})")
    return row, row.build()


def core_cache(name):
    """core's EasyCache or LazyCache node: ``apply(model, threshold, start, end)``."""
    try:
        from comfy_extras import nodes_easycache
    except ImportError as error:
        pytest.skip(f"no EasyCache/LazyCache in this ComfyUI (comfy_extras.nodes_easycache: {error})")
    node = {"EasyCache": nodes_easycache.EasyCacheNode, "LazyCache": nodes_easycache.LazyCacheNode}[name]
    return lambda m, threshold=0.5, start=0.0, end=1.0: node.execute(m, reuse_threshold=threshold, start_percent=start,
                                                                     end_percent=end, verbose=False)[0]


def mirror_cache(name):
    try:
        module = pack_source.load(name.lower())
    except (FileNotFoundError, ImportError) as error:
        pytest.skip(str(error))
    if name == "TeaCache":
        return lambda m: module.TeaCache().apply_teacache(m, "flux", 0.4, 0.0, 1.0, "cpu")[0]
    return lambda m: module.MagCache().apply_magcache(m, "flux", 0.3, 0.2, 6, 0, -1)[0]


def cache_node(name):
    return core_cache(name) if name in ("EasyCache", "LazyCache") else mirror_cache(name)


def sample(row, model, steps=STEPS):
    step_caches.clear_state(model)  # TeaCache and MagCache keep theirs on the diffusion model between runs
    latent = torch.zeros(1, row.channels, *row.sizes["odd"])
    return sampling.sample(model, row.text(1, row.texts[0], 0), latent, steps=steps, scheduler="simple")


def basic(pack, model, ratio=None):
    nodes = pack.nodes.toma_nodes
    (patched,) = nodes.ToMAPatchModel().patch(model, nodes.DEFAULT_RATIO if ratio is None else ratio,
                                              nodes.DEFAULT_WINDOW, nodes.DEFAULT_REUSE)
    return patched, pack.nodes.runtime.runtime_of(patched)


def said(caplog, kind):
    return [r.getMessage() for r in caplog.records if f"found {kind}" in r.getMessage()]


@pytest.mark.parametrize("order", ["toma-then-cache", "cache-then-toma"])
@pytest.mark.parametrize("kind", ["EasyCache", "LazyCache", "TeaCache", "MagCache"])
def test_the_node_finds_the_cache_and_says_so_once(pack, flux, kind, order, caplog):
    """Whichever node comes first, every run's stats name the cache and the stack setting (the basic node's ratio
    is auto: the stack's ratio, or nothing where it steps aside: TeaCache at 0.4 and MagCache at 0.3), and the log
    says so once over two runs."""
    row, base = flux
    apply_cache = cache_node(kind)
    found = pack.nodes.runtime.step_caches
    setting = found.STACK_SETTINGS[kind]
    if order == "toma-then-cache":
        patched, runtime = basic(pack, base)
        stacked = apply_cache(patched)
    else:
        stacked, runtime = basic(pack, apply_cache(base))
    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        for _ in range(2):
            out = sample(row, stacked)
            summary = runtime.summary()
            assert summary["step_cache"]["cache"] == kind
            aside = setting.steps_aside(found.StepCache(kind, summary["step_cache"]["settings"]))
            assert summary["step_cache"]["ratio"] == (None if aside else setting.ratio)
            assert any(kind in line for line in pack.nodes.live_stats.stats_lines(summary))
    assert torch.isfinite(out).all()
    assert bool(summary["levels"]) != aside and not summary["unmerged"]
    assert len(said(caplog, kind)) == 1


@pytest.mark.parametrize("order", ["toma-then-cache", "cache-then-toma"])
def test_a_ratio_set_by_hand_is_kept_and_a_cache_that_skips_nothing_changes_nothing(pack, flux, order):
    """The Advanced node at ratio 0.5 (set by hand) beside a LazyCache whose window holds no step (end 0: every
    call runs): the cache is found and said, every setting is kept, and the output is that of ToMA alone."""
    row, base = flux
    lazy = core_cache("LazyCache")
    alone, _ = dit_checks.toma_patched(pack, base, ratio=0.5, window=0, rotation="on")
    if order == "toma-then-cache":
        patched, runtime = dit_checks.toma_patched(pack, base, ratio=0.5, window=0, rotation="on")
        stacked = lazy(patched, 0.5, 0.0, 0.0)
    else:
        stacked, runtime = dit_checks.toma_patched(pack, lazy(base, 0.5, 0.0, 0.0), ratio=0.5, window=0,
                                                   rotation="on")
    out = sample(row, stacked)
    summary = runtime.summary()
    assert summary["step_cache"]["cache"] == "LazyCache" and summary["step_cache"]["ratio"] == 0.5
    assert "as set" in summary["step_cache"]["setting"]
    assert torch.equal(out, sample(row, alone))


def test_the_stack_setting_is_used_and_nothing_leaks_to_a_later_run(pack, flux):
    """The basic node (ratio auto) beside an EasyCache that skips nothing (threshold 0) samples what the basic
    node at the stack's ratio samples without a cache; the same patched model sampled afterwards without the cache
    samples what a fresh one does, and its stats name no cache."""
    row, base = flux
    easy = core_cache("EasyCache")
    setting = pack.nodes.runtime.step_caches.STACK_SETTINGS["EasyCache"]
    patched, runtime = basic(pack, base)
    stacked = sample(row, easy(patched, 0.0))
    summary = runtime.summary()
    assert summary["step_cache"]["ratio"] == setting.ratio != pack.nodes.placement.PRESETS["dit"].ratio
    assert torch.equal(stacked, sample(row, basic(pack, base, ratio=setting.ratio)[0]))

    later = sample(row, patched)
    assert runtime.summary()["step_cache"] is None
    assert torch.equal(later, sample(row, basic(pack, base)[0]))
    assert not torch.equal(later, stacked)


def test_in_a_short_run_the_node_keeps_its_own_setting(pack, flux):
    """A run of at most 8 steps (the image DiTs' short-run rule) beside a cache: the stack setting, measured at 20
    steps, is not taken (at 8 steps its ratio makes LazyCache skip nothing); the node merges as it does without a
    cache, and says so; a longer run of the same patched model takes the stack setting again."""
    row, base = flux
    easy = core_cache("EasyCache")
    patched, runtime = basic(pack, base)
    short = sample(row, easy(patched, 0.0), steps=6)
    summary = runtime.summary()
    assert summary["step_cache"]["ratio"] == pack.nodes.placement.PRESETS["dit"].ratio
    assert "own setting in this 6-step run" in summary["step_cache"]["setting"]
    assert torch.equal(short, sample(row, basic(pack, base)[0], steps=6))
    sample(row, easy(patched, 0.0))
    assert runtime.summary()["step_cache"]["ratio"] == pack.nodes.runtime.step_caches.STACK_SETTINGS["EasyCache"].ratio


def test_on_a_video_dit_the_node_keeps_its_own_setting_and_says_why(pack):
    """On a video DiT (the tiny Wan), whose fronts chose the node's own setting beside a cache, the basic node beside
    an EasyCache that skips nothing (threshold 0) says it found the cache and why it keeps its setting, and samples
    what it samples without one."""
    import comfy.supported_models

    row = ROWS["wan"]
    if not hasattr(comfy.supported_models, row.host):
        pytest.skip(f"{row.host} is not in this ComfyUI (set COMFYUI_PATH to a tree of {row.tree})")
    base = row.build()
    patched, runtime = basic(pack, base)
    frames = [5] if row.video else []
    latent = torch.zeros(1, row.channels, *frames, *row.sizes["odd"])

    def run(model):
        return sampling.sample(model, row.text(1, row.texts[0], 0), latent, steps=STEPS, scheduler="simple")

    stacked = run(core_cache("EasyCache")(patched, 0.0))
    summary = runtime.summary()
    assert summary["step_cache"]["cache"] == "EasyCache" and "own setting" in summary["step_cache"]["setting"]
    assert pack.nodes.runtime.step_caches.OWN_SETTING_MEASURED["video"] in summary["step_cache"]["setting"]
    assert summary["step_cache"]["ratio"] == pack.nodes.placement.PRESETS["video"].ratio
    assert torch.equal(stacked, run(basic(pack, base)[0]))


def test_beside_lazycache_at_a_low_threshold_the_node_steps_aside(pack, flux, caplog):
    """LazyCache under its stack setting's threshold (0.2 < 0.3): the basic node merges nothing, so the run is
    LazyCache's alone, and the log (once) and the stats say why."""
    row, base = flux
    lazy = core_cache("LazyCache")
    patched, runtime = basic(pack, base)
    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        out = sample(row, lazy(patched, 0.2))
    summary = runtime.summary()
    assert summary["step_cache"]["ratio"] is None and "steps aside" in summary["step_cache"]["setting"]
    assert not summary["levels"] and summary["nothing_merges"]
    assert torch.equal(out, sample(row, lazy(base, 0.2)))
    assert len(said(caplog, "LazyCache")) == 1


def test_ratio_zero_beside_a_cache_is_the_cache_alone(pack, flux):
    """Ratio 0 is off: the node's clone beside LazyCache samples exactly what LazyCache alone does."""
    row, base = flux
    lazy = core_cache("LazyCache")
    nodes = pack.nodes.toma_nodes
    off = nodes.ToMAPatchModel().patch(base, 0.0, nodes.DEFAULT_WINDOW, nodes.DEFAULT_REUSE)[0]
    assert torch.equal(sample(row, lazy(off, 0.3)), sample(row, lazy(base, 0.3)))
