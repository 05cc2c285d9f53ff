"""Run ComfyUI's own ``main.py`` as a headless server with the pack installed, and drive it over HTTP.

Used by the server tests, the browser tests and ``python -m toma_bench.main_job``::

    with comfy_server(workdir, models={"checkpoints": ckpt_dir}) as client:
        prompt_id = client.post_prompt(graph)          # API-format graph
        run = client.wait_for(prompt_id)               # reads the websocket until the prompt is done
        png = client.view(**run.images()[0])

The server listens on a free port of 127.0.0.1 only, writes everything under ``workdir`` (see
comfy_host.main_argv) and is always stopped by its process id when the ``with`` block ends, whatever
happens inside. The client side uses the standard library and aiohttp, which every ComfyUI installs (its server
runs on it), so it runs in a ComfyUI's own Python as well as in the harness's venv.
"""
from __future__ import annotations

import asyncio
import copy
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from . import comfy_host

TESTING_NODES = Path(__file__).resolve().parent / "testing_nodes"
TESTING_NODES_DIRNAME = "ComfyUI-ToMA-testing"
LOG_NAME = "comfyui.log"


class ServerError(RuntimeError):
    """The server did not start, died, or did not finish a prompt in time (message ends with its log)."""


class PromptRefused(Exception):
    """``POST /prompt`` did not answer 200 (400: the graph failed validation). ``body`` is the parsed answer."""

    def __init__(self, status: int, body):
        super().__init__(f"HTTP {status}: {json.dumps(body)[:2000]}")
        self.status = status
        self.body = body

    @property
    def node_errors(self) -> dict:
        return self.body.get("node_errors", {}) if isinstance(self.body, dict) else {}


class Websocket:
    """A synchronous client of one websocket (ComfyUI's ``/ws``) on aiohttp, driven by an event loop of its own in a
    thread of its own: ``receive`` waits until a frame comes or the timeout passes."""

    def __init__(self, url: str, timeout: float):
        # the loop runs in a thread of its own: a caller whose thread already runs an event loop (Playwright's
        # sync API, in the browser tests) cannot run a second one in it
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="toma-websocket", daemon=True)
        self._thread.start()
        try:
            self._session, self._ws = self._run(self._connect(url, timeout))
        except BaseException:
            self._stop()
            raise

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _stop(self):
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @staticmethod
    async def _connect(url: str, timeout: float):
        session = aiohttp.ClientSession()
        try:  # max_msg_size 0: no limit (latent previews come as binary frames)
            return session, await asyncio.wait_for(session.ws_connect(url, max_msg_size=0), timeout)
        except BaseException:
            await session.close()
            raise

    def receive(self, timeout: float) -> str | bytes | None:
        """The next text (str) or binary (bytes) frame; None when none came within ``timeout`` seconds. Raises
        ConnectionError when the server closed the websocket."""
        try:
            message = self._run(self._ws.receive(timeout))
        except asyncio.TimeoutError:
            return None
        if message.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            return message.data
        raise ConnectionError(f"the server's websocket closed ({message.type.name}: {message.data})")

    def close(self):
        async def closed():
            await self._ws.close()
            await self._session.close()

        try:
            self._run(closed())
        finally:
            self._stop()


@dataclass
class Run:
    """What the websocket said about one prompt: ``messages`` are (arrival time, type, data), in order."""

    prompt_id: str
    messages: list = field(default_factory=list)

    @property
    def error(self) -> dict | None:
        """The ``execution_error`` (or ``execution_interrupted``) data, None when the prompt succeeded."""
        for _, kind, data in self.messages:
            if kind in ("execution_error", "execution_interrupted"):
                return data
        return None

    @property
    def progress(self) -> list[tuple[int, int, str]]:
        """(value, max, node id) of every ``progress`` message (one per sampler step)."""
        return [(d["value"], d["max"], d.get("node")) for _, kind, d in self.messages if kind == "progress"]

    @property
    def seconds(self) -> float:
        """Wall time from ``execution_start`` to the final ``executing`` (node None)."""
        start = next(t for t, kind, _ in self.messages if kind == "execution_start")
        return self.messages[-1][0] - start

    def node_seconds(self) -> dict[str, float]:
        """Wall time of each executed node: from its ``executing`` message to the next one."""
        steps = [(t, d["node"]) for t, kind, d in self.messages if kind == "executing"]
        return {node: t_next - t for (t, node), (t_next, _) in zip(steps, steps[1:]) if node is not None}

    def outputs(self) -> dict[str, dict]:
        """{node id: ui output} from the ``executed`` messages (SaveImage: {"images": [...]})."""
        return {d["node"]: d["output"] for _, kind, d in self.messages if kind == "executed"}

    def images(self) -> list[dict]:
        """Every saved image as keyword arguments for ``ComfyClient.view`` (filename, subfolder, type)."""
        return [{"filename": i["filename"], "subfolder": i.get("subfolder", ""), "type": i.get("type", "output")}
                for output in self.outputs().values() for i in (output or {}).get("images", [])]


class ComfyClient:
    """HTTP + websocket client of one ComfyUI server. ``base_url`` is e.g. ``http://127.0.0.1:8190``;
    ``log`` and ``pid`` are the server's log file and process id when comfy_server started it."""

    def __init__(self, base_url: str, check_alive=lambda: None, log: Path | None = None, pid: int | None = None):
        self.base_url = base_url
        self.log = log
        self.pid = pid
        self.client_id = uuid.uuid4().hex
        self._check_alive = check_alive  # raises ServerError when the server process is gone
        self._backlog: dict[str, list] = {}  # messages read while waiting for another prompt
        ws_url = base_url.replace("http://", "ws://", 1) + f"/ws?clientId={self.client_id}"
        self._ws = Websocket(ws_url, timeout=30)

    def close(self):
        self._ws.close()

    def request(self, method: str, path: str, body=None, timeout: float = 120) -> tuple[int, bytes]:
        """(HTTP status, raw body); 4xx/5xx answers are returned, not raised."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as answer:
            return answer.code, answer.read()

    def get_json(self, path: str):
        status, raw = self.request("GET", path)
        if status != 200:
            raise ServerError(f"GET {path} answered HTTP {status}: {raw[:500]!r}")
        return json.loads(raw)

    def object_info(self) -> dict:
        return self.get_json("/object_info")

    def post_prompt(self, prompt: dict, extra_data: dict | None = None) -> str:
        """Queue an API-format graph; its prompt id. Raises PromptRefused when validation fails."""
        body = {"prompt": prompt, "client_id": self.client_id, "extra_data": extra_data or {}}
        status, raw = self.request("POST", "/prompt", body)
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = raw.decode(errors="replace")
        if status != 200:
            raise PromptRefused(status, answer)
        return answer["prompt_id"]

    def wait_for(self, prompt_id: str, timeout: float = 600, on_message=None) -> Run:
        """Read the websocket until ``prompt_id`` is done (``executing`` with node None) and return its Run.

        ``on_message(kind, data)`` is called for each of its messages as it arrives (e.g. progress lines).
        Messages of other prompts are kept for their own ``wait_for``. Raises ServerError on timeout or
        when the server process dies.
        """
        run = Run(prompt_id)
        for stamp, kind, data in self._backlog.pop(prompt_id, []):
            if self._record(run, stamp, kind, data, on_message):
                return run
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                frame = self._ws.receive(timeout=2)
            except ConnectionError as closed:
                self._check_alive()
                raise ServerError(str(closed)) from closed
            if frame is None:
                self._check_alive()
                continue
            if isinstance(frame, bytes):  # binary frames are latent previews
                continue
            message = json.loads(frame)
            kind, data, stamp = message["type"], message.get("data") or {}, time.perf_counter()
            owner = data.get("prompt_id")
            if owner is None:  # "status" broadcasts
                continue
            if owner != prompt_id:
                self._backlog.setdefault(owner, []).append((stamp, kind, data))
                continue
            if self._record(run, stamp, kind, data, on_message):
                return run
        raise ServerError(f"prompt {prompt_id} not finished after {timeout} s; queue: {self.get_json('/queue')}")

    @staticmethod
    def _record(run: Run, stamp: float, kind: str, data: dict, on_message) -> bool:
        """Append one message; True when it ends the prompt."""
        run.messages.append((stamp, kind, data))
        if on_message is not None:
            on_message(kind, data)
        return kind == "executing" and data.get("node") is None

    def run(self, prompt: dict, timeout: float = 600, on_message=None) -> Run:
        """post_prompt + wait_for; raises ServerError if the prompt ended with an error."""
        run = self.wait_for(self.post_prompt(prompt), timeout, on_message)
        if run.error is not None:
            raise ServerError(f"prompt failed: {json.dumps(run.error)[:3000]}")
        return run

    def history(self, prompt_id: str) -> dict:
        """The history entry of one prompt ({"prompt", "outputs", "status", ...}); {} if unknown."""
        return self.get_json(f"/history/{prompt_id}").get(prompt_id, {})

    def view(self, filename: str, subfolder: str = "", type: str = "output") -> bytes:
        query = urllib.parse.urlencode({"filename": filename, "subfolder": subfolder, "type": type})
        status, raw = self.request("GET", f"/view?{query}")
        if status != 200:
            raise ServerError(f"/view {filename!r} answered HTTP {status}")
        return raw


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def models_config(workdir: Path, models: dict) -> Path:
    """An extra_model_paths yaml mapping ComfyUI model kinds ("checkpoints", "vae", ...) to absolute dirs."""
    path = workdir / "extra_model_paths_models.yaml"
    lines = ["comfyui_toma_models:"] + [f"  {kind}: {json.dumps(str(Path(d).resolve()))}" for kind, d in models.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def server_argv(workdir: Path, port: int, *extra: str, models: dict | None = None, frontend: bool = False,
                testing_nodes: bool = True) -> list[str]:
    """main.py's command line: comfy_host.main_argv + loopback port + optional model dirs and test nodes.

    ``frontend=True`` keeps the tree's real front end (current ComfyUI serves its installed
    comfyui-frontend-package; main_argv otherwise points ``--front-end-root`` at a dummy page).
    """
    argv = comfy_host.main_argv(workdir, "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
                                *extra)
    if testing_nodes:
        link = workdir / "custom_nodes" / TESTING_NODES_DIRNAME
        if not link.exists():
            link.symlink_to(TESTING_NODES, target_is_directory=True)
    if models:
        argv += ["--extra-model-paths-config", str(models_config(workdir, models))]
    if frontend and "--front-end-root" in argv:
        at = argv.index("--front-end-root")
        del argv[at:at + 2]
    return argv


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_until_serving(proc: subprocess.Popen, base_url: str, log: Path, timeout: float) -> None:
    """Poll ``/system_stats`` until it answers 200; ServerError if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"ComfyUI exited with code {proc.returncode} while starting:\n{log_tail(log)}")
        try:
            with urllib.request.urlopen(base_url + "/system_stats", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise ServerError(f"ComfyUI did not answer /system_stats within {timeout} s:\n{log_tail(log)}")


def server_env(extra: dict | None = None) -> dict:
    """This process's environment, plus ``extra`` (e.g. OMP_NUM_THREADS), for the server process."""
    env = dict(os.environ, **(extra or {}))
    env["PYTHONUNBUFFERED"] = "1"  # the log file shows progress as it happens
    return env


def stop(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM the server by its pid, SIGKILL it if it is still there after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def comfy_server(workdir, *extra: str, models: dict | None = None, frontend: bool = False,
                 testing_nodes: bool = True, startup_timeout: float = 300, env: dict | None = None):
    """Start ``main.py --cpu`` of comfy_host.comfy_root() with the pack (and the test nodes) installed.

    ``extra`` are more main.py options (e.g. ``--use-pytorch-cross-attention``); ``models`` maps model kinds
    to folders; ``env`` adds to the server's environment. Yields a ComfyClient (with the server's ``log`` path
    and ``pid``). The server is stopped by its pid when the block ends, whatever happens inside.
    """
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = server_argv(workdir, port, *extra, models=models, frontend=frontend, testing_nodes=testing_nodes)
    log = workdir / LOG_NAME
    base_url = f"http://127.0.0.1:{port}"
    with open(log, "ab") as log_file:
        proc = subprocess.Popen(argv, cwd=comfy_host.comfy_root(), stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=server_env(env))
    client = None
    try:
        wait_until_serving(proc, base_url, log, startup_timeout)

        def check_alive():
            if proc.poll() is not None:
                raise ServerError(f"ComfyUI exited with code {proc.returncode}:\n{log_tail(log)}")

        client = ComfyClient(base_url, check_alive, log, proc.pid)
        yield client
    finally:
        if client is not None:
            client.close()
        stop(proc)


# -- API-format graphs ------------------------------------------------------------------------------

WORKFLOWS = comfy_host.REPO / "workflows"


def load_workflow(name: str) -> dict:
    """A shipped workflow file, e.g. ``load_workflow("sd15_toma_api.json")``."""
    return json.loads((WORKFLOWS / name).read_text())


def set_inputs(prompt: dict, class_type: str, **values) -> dict:
    """Copy of an API graph with ``values`` set on every node of ``class_type`` (at least one must exist)."""
    graph = copy.deepcopy(prompt)
    targets = [node for node in graph.values() if node["class_type"] == class_type]
    if not targets:
        raise KeyError(f"no {class_type} node in the graph")
    for node in targets:
        node["inputs"].update(values)
    return graph


def use_test_conditioning(prompt: dict) -> dict:
    """Copy of an API graph whose CLIPTextEncode nodes are ToMATestConditioning nodes, for checkpoints
    without a text encoder. Each reads the MODEL (output 0) of the loader that supplied its CLIP and gets a
    seed of its own (0, 1, ... in graph order), so positive and negative differ."""
    graph = copy.deepcopy(prompt)
    encoders = [node for node in graph.values() if node["class_type"] == "CLIPTextEncode"]
    for seed, node in enumerate(encoders):
        loader, _ = node["inputs"]["clip"]
        node["class_type"] = "ToMATestConditioning"
        node["inputs"] = {"model": [loader, 0], "seed": seed, "tokens": 77}
    return graph
