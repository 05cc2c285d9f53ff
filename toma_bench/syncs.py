"""Count the calls that make the host wait for the device while a model samples, and say where they are.

On a GPU every read of a device value on the host (``.item()``, ``bool()``, ``float()``, ``int()``,
``.tolist()``, ``.cpu()``, ``nonzero`` and the other ops whose output size depends on the data) blocks
until the GPU has finished all the work queued before it, and a copy from the host inside a block call
waits for the host's data: either stalls the launch queue, so the GPU idles. ``SyncCounter`` is a
``TorchFunctionMode`` that sees every tensor operation while it is active and records each such call with
the ``file:line`` it came from.

Where the compute device is a GPU, "on the device" is the tensor's device. Where it is the CPU (the
tests), nothing is really copied, so the counter tracks what would be a host tensor on a GPU: tensors
made by factories without a ``device`` argument (``torch.tensor([...])``, ``torch.arange(n)``) and
everything computed only from such tensors. Moving one of them with ``.to(device)`` counts as a copy to
the device (and from then on it counts as on the device); reading one on the host counts as nothing.

A call is the pack's when the innermost frame outside torch is in the pack (``toma_core``, ``nodes``), or
when the pack called a ComfyUI helper that made it (e.g. ``percent_to_sigma``): at most ``HELPER_DEPTH``
frames of other code between, and no model module's forward. Calls inside the model's own modules, and
those of ComfyUI's sampler that a pack wrapper hands control to, are recorded as ``other``.
"""
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parent.parent
PACK_PARTS = (str(REPO / "toma_core") + "/", str(REPO / "nodes") + "/", str(REPO / "__init__.py"))
TORCH_DIR = str(Path(torch.__file__).resolve().parent) + "/"
MODULE_CALL = str(Path(torch.nn.modules.module.__file__).resolve())
THIS_FILE = str(Path(__file__).resolve())

# Reads of a device value on the host: each waits for the device.
READS = {"item", "__bool__", "__float__", "__int__", "__index__", "__format__", "tolist", "numpy", "cpu",
         "equal", "allclose", "is_nonzero"}
# Ops whose output size depends on the data: the host reads that size from the device.
DATA_SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "repeat_interleave"}
# Factories: without a device argument they make a host tensor.
FACTORIES = {"tensor", "as_tensor", "from_numpy", "arange", "zeros", "ones", "empty", "full", "rand", "randn",
             "randint", "randperm", "linspace", "logspace", "eye", "zeros_like", "ones_like", "empty_like",
             "full_like", "rand_like", "randn_like"}
LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}
HOST_TAG = "_toma_sync_counter_host"
HELPER_DEPTH = 3  # percent_to_sigma -> sigma is 2 deep; a wrapper's executor reaches the sampler through more


@dataclass(frozen=True)
class SyncEvent:
    what: str  # "read" or "copy to device"
    op: str  # the torch function, e.g. "item", "__float__", "to"
    site: str  # file:line (function) of the pack's (or other code's) frame that made the call
    via: str | None  # the innermost frame outside torch when it is not ``site`` (ComfyUI code the pack called)
    pack: bool
    model_call: int | None  # index of the model call it happened in, None outside model calls


def _short(frame) -> str:
    path = Path(frame.f_code.co_filename)
    try:
        name = str(path.resolve().relative_to(REPO))
    except ValueError:
        parts = path.parts
        name = "/".join(parts[parts.index("comfy"):]) if "comfy" in parts else path.name
    return f"{name}:{frame.f_lineno} ({frame.f_code.co_name})"


def _in_pack(filename: str) -> bool:
    return filename.startswith(PACK_PARTS)


def _attribute(frame) -> tuple[str, str | None, bool]:
    """(site, via, pack) of a call made below ``frame``."""
    innermost, module_call, other = None, False, 0
    while frame is not None:
        name = frame.f_code.co_filename
        if name == THIS_FILE or name.startswith(TORCH_DIR) or name.startswith("<"):
            module_call |= name == MODULE_CALL
        elif innermost is None:
            innermost, other = frame, 1
            if _in_pack(name):
                return _short(frame), None, True
        elif _in_pack(name):
            if module_call or other > HELPER_DEPTH:  # the model's own code, or ComfyUI the pack handed over to
                break
            return _short(frame), _short(innermost), True
        else:
            other += 1
        frame = frame.f_back
    return (_short(innermost) if innermost is not None else "?"), None, False


class SyncCounter(TorchFunctionMode):
    """Active (``with counter:``) it records a SyncEvent for every call that would make the host wait for
    ``device``. ``model_wrapper`` (a ComfyUI ``model_function_wrapper``) numbers the model calls."""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.host_is_device = self.device.type == "cpu"
        self.events: list[SyncEvent] = []
        self.model_calls = 0
        self.current_call: int | None = None

    # -- ComfyUI hook ----------------------------------------------------------------------------
    def model_wrapper(self, apply_model, args):
        """model_function_wrapper: every model call between its start and end gets its own index."""
        self.current_call, self.model_calls = self.model_calls, self.model_calls + 1
        try:
            return apply_model(args["input"], args["timestep"], **args["c"])
        finally:
            self.current_call = None

    # -- what is where -----------------------------------------------------------------------------
    def on_host(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.host_is_device:
            return getattr(t, HOST_TAG, False)
        return t.device.type == "cpu"

    def on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and not self.on_host(t) and t.device.type == self.device.type

    def _target_device(self, func_name, args, kwargs):
        if func_name == "cuda":
            return torch.device("cuda")
        if func_name == "copy_":
            return args[0].device if isinstance(args[0], torch.Tensor) else None
        target = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                target = a
            elif isinstance(a, torch.Tensor):
                target = a.device
        return None if target is None else torch.device(target)

    def _record(self, what, op):
        site, via, pack = _attribute(sys._getframe(2))
        self.events.append(SyncEvent(what, op, site, via, pack, self.current_call))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # torch runs this with the mode switched off, so the tensor calls made here are not seen again
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in READS or name in DATA_SIZED:
            if tensors and self.on_device(tensors[0]):
                self._record("read", name)
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1:
            index = args[1] if isinstance(args[1], (tuple, list)) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in index) \
                    and tensors and self.on_device(tensors[0]):
                self._record("read", f"{name} with a boolean mask")
        elif name in ("to", "cuda", "copy_"):
            source = args[1] if name == "copy_" and len(args) > 1 else (args[0] if args else None)
            target = self._target_device(name, args, kwargs)
            if self.on_host(source) and target is not None and target.type == self.device.type:
                self._record("copy to device", name)
                if self.host_is_device:
                    out = func(*args, **kwargs)
                    if isinstance(out, torch.Tensor):
                        setattr(out, HOST_TAG, False)
                    return out
            elif not self.host_is_device and self.on_device(source) and target is not None \
                    and target.type == "cpu":
                self._record("read", name)
        elif name in ("tensor", "as_tensor") and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == self.device.type:
            self._record("copy to device", name)
        out = func(*args, **kwargs)
        if self.host_is_device and isinstance(out, torch.Tensor):
            if name in FACTORIES and kwargs.get("device") is None and (name not in LIKE or self.on_host(args[0])):
                setattr(out, HOST_TAG, True)
            elif name not in FACTORIES and tensors and all(self.on_host(t) for t in tensors):
                setattr(out, HOST_TAG, True)
        return out

    # -- results -------------------------------------------------------------------------------------
    def pack_events(self) -> list[SyncEvent]:
        return [e for e in self.events if e.pack]

    def per_model_call(self, events=None) -> Counter:
        """model call index -> number of the given (default: the pack's) events in it."""
        return Counter(e.model_call for e in (self.pack_events() if events is None else events)
                       if e.model_call is not None)

    def report(self) -> str:
        """One line per site: how many calls, of which kind, inside how many model calls."""
        lines = [f"{self.model_calls} model calls; calls that would make the host wait for {self.device}:"]
        by_site = Counter((e.pack, e.what, e.op, e.site, e.via) for e in self.events)
        for (pack, what, op, site, via), n in sorted(by_site.items(), key=lambda kv: (not kv[0][0], -kv[1])):
            calls = len({e.model_call for e in self.events if (e.pack, e.what, e.op, e.site, e.via)
                         == (pack, what, op, site, via) and e.model_call is not None})
            owner = "pack " if pack else "other"
            lines.append(f"  {owner} {n:5d}x {what} {op} at {site}" + (f" via {via}" if via else "")
                         + f", in {calls} model calls")
        if len(lines) == 1:
            lines.append("  none")
        return "\n".join(lines)
