"""ToMA stacked with the step caches users run on DiTs: TeaCache (welltop-cn/ComfyUI-TeaCache) and MagCache
(Zehong-Ma/ComfyUI-MagCache), in both orders, on every family of the conformance table each serves.

Both caches swap in their own copy of the diffusion model's ``forward_orig`` (or ``_forward``, or
``forward``) for the model call, and their copies call the blocks without ``transformer_options`` (Wan's
hands them beside ``original_block``). The block patches then find the call's layout on the runtime,
where the model-call wrapper stashed it (adapters.layout.LayoutStash). Where a cache replaces the diffusion model's
``forward`` itself (TeaCache on Lumina 2, HiDream, LTX-Video), that wrapper never runs: those families
read the layout outside the diffusion model too (DiTFamily.read_outside).

The caches' code is read from mirrors of their repositories at test time (toma_bench/pack_source.py): the
original, or where it does not import in this tree a fork kept running there (TeaCache in ComfyUI v0.33.0:
FurkanGozukara/ComfyUI-TeaCache). The cases skip with the reason where there is no mirror, where no
implementation imports in this tree (MagCache in v0.33.0), or where the cache alone fails in this tree. A stand-in for
the mechanism, a model-call wrapper that calls the blocks without transformer_options, always runs.
"""
import logging

import pytest
import torch

import dit_checks
from test_family_conformance import ROWS
from toma_bench import comfy_host, pack_source, sampling, step_caches

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

STEPS = 10
# family row -> the cache's model_type for it (thresholds: the caches' defaults, or near them, at which they
# skip some of the calls of the tiny random Flux; TeaCache's Wan coefficients skip none of them)
TEACACHE = {"flux": "flux", "wan": "wan2.1_t2v_1.3B", "hunyuan_video": "hunyuan_video", "lumina2": "lumina_2",
            "hidream": "hidream_i1_dev", "ltxv": "ltxv"}
MAGCACHE = {"flux": "flux", "wan": "wan2.1_t2v_1.3B", "hunyuan_video": "hunyuan_video", "chroma": "chroma",
            "qwen_image": "qwen_image", "hunyuan_video15": "hunyuan_video1.5"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def caches(pack):
    """{"teacache": its nodes module, "magcache": ...}, or why there is none here: the reason the mirrors are
    missing, or why none of the implementations imports in this tree."""
    out = {}
    for name in ("teacache", "magcache"):
        try:
            out[name] = pack_source.load(name)
        except (FileNotFoundError, ImportError) as error:
            out[name] = str(error)
    return out


def apply_cache(caches, name, model, family):
    if isinstance(caches[name], str):
        pytest.skip(caches[name])
    if name == "teacache":
        return caches[name].TeaCache().apply_teacache(model, TEACACHE[family], 0.4, 0.0, 1.0, "cpu")[0]
    return caches[name].MagCache().apply_magcache(model, MAGCACHE[family], 0.3, 0.2, 6, 0, -1)[0]


def sample(row, model, steps=STEPS):
    """A zero latent sampled for ``steps`` steps; the caches' state on the diffusion model cleared first (they
    clear it themselves only at the first step of a run they can tell, not on every host)."""
    step_caches.clear_state(model)  # TeaCache and MagCache keep theirs on the diffusion model between runs
    frame_axis = [5] if row.video else [1] if row.frame_axis else []
    latent = torch.zeros(1, row.channels, *frame_axis, *row.sizes["odd"])
    return sampling.sample(model, row.text(1, row.texts[0], 0), latent, steps=steps, scheduler="simple")


@pytest.fixture(scope="module")
def built(pack):
    return {}


def model_of(pack, built, family):
    row = ROWS[family]
    if family_missing(pack, row):
        pytest.skip(f"{row.host} is not in this ComfyUI (set COMFYUI_PATH to a tree of {row.tree})")
    if family not in built:
        built[family] = row.build()
    return row, built[family]


def family_missing(pack, row) -> bool:
    import comfy.supported_models

    return not hasattr(comfy.supported_models, row.host)


CASES = [pytest.param(cache, family, order, id=f"{cache}-{family}-{order}")
         for cache, served in (("teacache", TEACACHE), ("magcache", MAGCACHE)) for family in served
         for order in ("toma-then-cache", "cache-then-toma")]


@pytest.mark.parametrize("cache, family, order", CASES)
def test_toma_merges_under_the_cache(pack, caches, built, cache, family, order):
    """ToMA merges the block calls the cache runs, whichever node comes first: its run report names the
    merged groups, nothing ran unmerged, and the output differs from the cache alone."""
    row, base = model_of(pack, built, family)
    try:
        alone = sample(row, apply_cache(caches, cache, base, family))
    except Exception as e:  # the cache's own code against this tree
        pytest.skip(f"{cache} alone fails on {family} in this ComfyUI: {type(e).__name__}: {e}")
    if order == "toma-then-cache":
        patched, runtime = dit_checks.toma_patched(pack, base)
        stacked = apply_cache(caches, cache, patched, family)
    else:
        stacked, runtime = dit_checks.toma_patched(pack, apply_cache(caches, cache, base, family))

    out = sample(row, stacked)
    summary = runtime.summary()

    assert torch.isfinite(out).all()
    assert summary["levels"], "ToMA merged nothing under the cache"
    assert not summary["unmerged"]
    assert all(0 < level["steps"] <= STEPS and level["merged_tokens"] < level["tokens"]
               for level in summary["levels"].values())
    assert not torch.equal(out, alone)


# -- the stand-in: the mechanism without either pack --------------------------------------------------------
def options_dropped(model):
    """``model`` with a model function wrapper that, as TeaCache's and MagCache's copies of forward_orig do,
    calls each replaced block without transformer_options (in its arguments and beside original_block),
    and whose original block gets the model call's options, not those the patch handed it."""
    m = model.clone()

    def wrapper(model_function, kwargs):
        c = kwargs["c"]
        options = c["transformer_options"]
        replaced = options.get("patches_replace", {}).get("dit", {})
        stripped = {key: without_options(patch) for key, patch in replaced.items()}
        options = {**options, "patches_replace": {**options["patches_replace"], "dit": stripped}}
        return model_function(kwargs["input"], kwargs["timestep"], **{**c, "transformer_options": options})

    m.set_model_unet_function_wrapper(wrapper)
    return m


def without_options(patch):
    def call(args, extras):
        own = args.get("transformer_options")
        run = extras["original_block"]
        return patch({k: v for k, v in args.items() if k != "transformer_options"},
                     {"original_block": lambda a: run({**a, "transformer_options": own})})

    return call


@pytest.mark.parametrize("family", ["flux", "wan"])
@pytest.mark.parametrize("order", ["toma-then-other", "other-then-toma"])
def test_blocks_called_without_options_still_merge(pack, built, family, order, caplog):
    """Blocks called without transformer_options merge the same tokens as blocks called with them: scope
    "block" gives the output of ToMA alone. Under scope "attention" Flux's double blocks, and under scope
    "keys/values" every block, whose attention override the caller would drop, merge whole blocks instead
    (the output of scope "block"), and the log says so once per patched model."""
    row, base = model_of(pack, built, family)
    for scope in ("block", "attention", "keys/values") if family == "flux" else ("block", "keys/values"):
        if order == "toma-then-other":
            patched, runtime = dit_checks.toma_patched(pack, base, scope=scope)
            stacked = options_dropped(patched)
        else:
            stacked, runtime = dit_checks.toma_patched(pack, options_dropped(base), scope=scope)
        with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
            out = sample(row, stacked, steps=2)
        summary = runtime.summary()
        assert summary["levels"] and not summary["unmerged"]
        assert torch.equal(out, sample(row, dit_checks.toma_patched(pack, base, scope="block")[0], steps=2))
    said = [r.getMessage() for r in caplog.records if "without transformer_options" in r.getMessage()]
    assert len(said) == (2 if family == "flux" else 1)


# -- the layout read outside the diffusion model ------------------------------------------------------------
@pytest.mark.parametrize("family, first_frame_kept", [("lumina2", False), ("hidream", False), ("ltxv", False),
                                                      ("ltxv", True)])
def test_the_layout_read_outside_is_the_one_read_inside(pack, built, family, first_frame_kept, monkeypatch):
    """Where a family also reads its layout at BaseModel._apply_model (read_outside, for caches that replace
    the diffusion model's forward), that layout is the one its model-call wrapper reads inside: on
    LTX-Video with a noise mask too (image-to-video: per-token timesteps, the first frame kept whole)."""
    row, base = model_of(pack, built, family)
    family_of = getattr(pack.nodes.adapters.families, {"lumina2": "LUMINA", "hidream": "HIDREAM", "ltxv": "LTXV"}[family])
    assert family_of.read_outside
    read = []
    layout = family_of.stash.layout
    monkeypatch.setattr(family_of.stash, "layout", lambda self, call: read.append(layout(self, call)) or read[-1])
    patched, _ = dit_checks.toma_patched(pack, base)
    frame_axis = [5] if row.video else []
    latent = torch.zeros(1, row.channels, *frame_axis, *row.sizes["odd"])
    mask = None
    if first_frame_kept:
        mask = torch.ones(1, 1, *latent.shape[2:])
        mask[:, :, 0] = 0
    sampling.sample(patched, row.text(1, row.texts[0], 0), latent, steps=1, scheduler="simple", noise_mask=mask)
    outside, inside = read  # one model call: the wrapper outside runs first
    assert outside is not None and outside == inside
    assert (inside.lead > 0) == first_frame_kept
