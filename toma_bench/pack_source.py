"""Other node packs' code (TeaCache, MagCache, raylight), taken at test time from bare git mirrors of their
public repositories, never kept in this one.

``load(name)`` writes a pack's module from its mirror's HEAD into a temporary folder and imports it under
a private module name (``toma_bench_mirror_<pack>_<module>``), as ComfyUI would load the pack's nodes; the
host's ComfyUI must already be importable. A pack may have several implementations (the original and the
forks that kept it running in later ComfyUI trees): ``load`` takes the first whose mirror is here and whose
module imports in this tree, and says which (``origin``). A module that imports its pack's siblings or
libraries the test venv lacks (raylight's xfuser) is given them by the caller through ``stand_ins`` (module
name -> module), present in sys.modules only while it is imported. ``extract(name, folder)`` writes a whole
pack (kijai's ComfyUI-WanVideoWrapper, which ComfyUI loads as a package) into a folder instead. Mirrors live in
a ``.mirror`` folder beside this checkout or in any folder above it (../.mirror/<owner>+<name>/repo), or where
TOMA_MIRRORS points.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _mirrors() -> Path:
    if os.environ.get("TOMA_MIRRORS"):
        return Path(os.environ["TOMA_MIRRORS"])
    found = [folder / ".mirror" for folder in REPO.parents if (folder / ".mirror").is_dir()]
    return found[0] if found else REPO.parent / ".mirror"


MIRRORS = _mirrors()
PACKS = {  # name -> the GitHub owner/name of each implementation, in the order load() tries them
    # The original (to July 2025) imports comfy.ldm.lightricks.model.precompute_freqs_cis, which ComfyUI v0.33.0
    # no longer has; FurkanGozukara's fork (to 2026-08) imports the lightricks helpers only where they exist,
    # Encoded404's (to 2026-08) takes a precompute_freqs_cis from comfy.text_encoders.llama.
    "teacache": ("welltop-cn/ComfyUI-TeaCache", "FurkanGozukara/ComfyUI-TeaCache",
                 "Encoded404/ComfyUI-TeaCache-CosmosPredict"),
    # The original (to Nov 2025) imports the same function; its forks are older copies of it (wzgrx 2025-11,
    # aziib 2025-08) or a rewrite for Flux and Wan 2.1 with other inputs (wildminder, 2025-06): none runs in
    # v0.33.0.
    "magcache": ("Zehong-Ma/ComfyUI-MagCache",),
    "raylight": ("komikndr/raylight",),
    # kijai's ComfyUI-WanVideoWrapper: kijai's commits to 2026-05-24 (plus that fork's SCAIL changes), kijai's
    # code of 2026-02-01 unchanged, and kijai's own repository as mirrored (March 2025)
    "wanvideowrapper": ("rookiestar28/ComfyUI-WanVideoWrapper",),
    "wanvideowrapper-2026-02": ("saha18uiuc/ComfyUI-WanVideoWrapper",),
    "wanvideowrapper-2025-03": ("kijai/ComfyUI-WanVideoWrapper",),
}


def mirror_of(repo: str) -> Path:
    return MIRRORS / repo.replace("/", "+") / "repo"


def mirror(name: str) -> Path:
    """The mirror of pack ``name``'s first implementation that is here (else where the first would be)."""
    present = [mirror_of(repo) for repo in PACKS[name] if mirror_of(repo).is_dir()]
    return present[0] if present else mirror_of(PACKS[name][0])


def missing(name: str) -> str | None:
    """Why pack ``name``'s code cannot be read here, or None."""
    if any(mirror_of(repo).is_dir() for repo in PACKS[name]):
        return None
    return (f"no mirror of {' or '.join(PACKS[name])} (looked in {MIRRORS}; set TOMA_MIRRORS to the folder of "
            "mirrors)")


def head(name: str) -> str:
    """The commit at the HEAD of pack ``name``'s mirror."""
    return subprocess.run(["git", "--git-dir", str(mirror(name)), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()


def extract(name: str, folder: Path) -> list[str]:
    """Write every file of pack ``name``'s HEAD into ``folder`` (made if missing); a mirror may lack its
    largest blobs (tokenizer files), which are left out: their paths are returned. FileNotFoundError with
    the reason where there is no mirror."""
    reason = missing(name)
    if reason:
        raise FileNotFoundError(reason)
    git = ["git", "--git-dir", str(mirror(name))]
    listing = subprocess.run(git + ["ls-tree", "-r", "-z", "HEAD"], check=True, capture_output=True).stdout
    entries = []  # (blob, path) of the files at HEAD
    for entry in filter(None, listing.split(b"\0")):
        meta, path = entry.split(b"\t", 1)
        _, kind, blob = meta.split()
        if kind == b"blob":
            entries.append((blob.decode(), path.decode()))
    batch = subprocess.run(git + ["cat-file", "--batch"], input="".join(f"{blob}\n" for blob, _ in entries).encode(),
                           check=True, capture_output=True).stdout
    left_out, cursor = [], 0
    for blob, path in entries:
        end = batch.index(b"\n", cursor)
        header = batch[cursor:end].split()
        cursor = end + 1
        if header[-1] == b"missing":
            left_out.append(path)
            continue
        size = int(header[2])
        target = Path(folder) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(batch[cursor:cursor + size])
        cursor += size + 1  # the content, then a newline
    return left_out


def source(name: str, path: str, repo: str | None = None) -> str:
    """The text of ``path`` at the HEAD of the mirror of ``repo`` (default: pack ``name``'s first one here)."""
    git_dir = mirror_of(repo) if repo else mirror(name)
    return subprocess.run(["git", "--git-dir", str(git_dir), "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout


def load(name: str, path: str = "nodes.py", stand_ins: dict | None = None, module_name: str | None = None):
    """Pack ``name``'s module ``path`` imported from the first of its mirrors here in which it imports in this
    ComfyUI; its ``origin`` says which repository it is. FileNotFoundError with the reason where there is no
    mirror; ImportError naming each implementation and why it failed where none imports (a module that lacks
    what it imports from this ComfyUI). ``module_name``: the name to import it under, where its relative
    imports must resolve (against ``stand_ins``); by default a private one."""
    reason = missing(name)
    if reason:
        raise FileNotFoundError(reason)
    failed = []
    for repo in PACKS[name]:
        if not mirror_of(repo).is_dir():
            continue
        try:
            module = _import(repo, name, path, stand_ins or {}, module_name)
        except ImportError as error:  # this implementation against this tree
            failed.append(f"{repo}: {type(error).__name__}: {error}")
            continue
        module.origin = repo
        return module
    raise ImportError(f"no {name} implementation imports in this ComfyUI: {'; '.join(failed)}")


def _import(repo: str, name: str, path: str, stand_ins: dict, module_name: str | None):
    module_name = module_name or f"toma_bench_mirror_{name}_{Path(path).with_suffix('').as_posix().replace('/', '_')}"
    saved = {key: sys.modules.get(key) for key in stand_ins}
    with tempfile.TemporaryDirectory(prefix=f"{name}_") as folder:
        file = Path(folder) / Path(path).name
        file.write_text(source(name, path, repo))
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        try:
            sys.modules.update(stand_ins)
            spec.loader.exec_module(module)
        finally:
            restore_modules(saved)
    return module


def restore_modules(saved: dict) -> None:
    """Put back the ``sys.modules`` entries ``saved`` holds ({name: module, or None where there was none})."""
    for key, previous in saved.items():
        if previous is None:
            sys.modules.pop(key, None)
        else:
            sys.modules[key] = previous


def stand_in_module(name: str, **attributes) -> types.ModuleType:
    """A module (a package: it may have submodules) named ``name`` holding ``attributes``."""
    module = types.ModuleType(name)
    module.__path__ = []
    module.__dict__.update(attributes)
    return module


RAYLIGHT_USP = (  # raylight's modules its Wan USP injection needs, in import order: (module name, path)
    ("raylight.diffusion_models.utils", "src/raylight/diffusion_models/utils.py"),
    ("raylight.diffusion_models.wan.xdit_context_parallel", "src/raylight/diffusion_models/wan/xdit_context_parallel.py"),
    ("raylight.distributed_modules.usp", "src/raylight/distributed_modules/usp.py"),
)


def raylight_usp(rank, world, sp_group, attention) -> dict:
    """raylight's sequence-parallel (USP) modules from its mirror, against stand-ins for xfuser: ``rank()`` and
    ``world()`` its sequence-parallel rank and size, ``sp_group`` its group (``all_gather(x, dim)``),
    ``attention`` its Ulysses attention (what raylight's make_xfuser_attention returns: ``attention(q, k, v,
    heads, ...)``). {module name: module}, the stand-ins included: they belong in sys.modules while raylight's
    injection (``modules["raylight.distributed_modules.usp"].USPInjectRegistry.inject``) runs and the model
    samples (ToMA reads the rank from xfuser's module, as under raylight)."""
    distributed = stand_in_module("xfuser.core.distributed", get_sequence_parallel_rank=rank,
                                  get_sequence_parallel_world_size=world, get_sp_group=lambda: sp_group)
    raylight_attention = stand_in_module("raylight.distributed_modules.attention", get_attn_type=lambda: "TORCH",
                                         get_sync_ulysses=lambda: False, make_xfuser_attention=lambda *a: attention)
    modules = {"xfuser": stand_in_module("xfuser"), "xfuser.core": stand_in_module("xfuser.core"),
               "xfuser.core.distributed": distributed, "raylight": stand_in_module("raylight"),
               "raylight.distributed_modules": stand_in_module("raylight.distributed_modules",
                                                               attention=raylight_attention),
               "raylight.distributed_modules.attention": raylight_attention,
               "raylight.diffusion_models": stand_in_module("raylight.diffusion_models"),
               "raylight.diffusion_models.wan": stand_in_module("raylight.diffusion_models.wan")}
    for name, path in RAYLIGHT_USP:
        modules[name] = load("raylight", path, modules, name)
    return modules
