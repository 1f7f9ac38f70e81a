"""Start a source and a target vLLM OpenAI server on 127.0.0.1 with the kvlingo connector, and stop them.

The servers run from the serving venv (`bash infra/bootstrap.sh --serve`): the source engine is a producer
(it saves every request's K/V and returns the conversation key in `kv_transfer_params`), the target a consumer
serving one translator. `kvlingo serve` is the command line over this module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.serving import ServingError

ROOT = Path(__file__).resolve().parents[1]
CONNECTOR = {"kv_connector": "KvlingoConnector", "kv_connector_module_path": "infra.vllm_connector"}
# Without it vLLM's CPU backend reserves 92% of the NUMA node's memory for the KV cache and refuses to start when
# other processes already hold part of it (a second engine always does). 2 GiB holds about 46k SmolLM2-135M
# tokens in fp32 (46 KB each); an exported value wins. GPU backends ignore it.
ENGINE_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "2"}
_ERROR_LINE = re.compile(r"\b[A-Za-z_.]*(Error|Exception): .+")


def serve_python() -> Path:
    """The serving venv's python.

    Raises:
        ServingError: the serving venv is not built (the message says how to build it).
    """
    python = ROOT / ".venv-serve" / "bin" / "python"
    if not python.is_file():
        raise ServingError(f"the serving venv is missing ({python}): build it with `bash infra/bootstrap.sh --serve`")
    return python


def engine_env() -> dict[str, str]:
    """The environment an engine runs in: this one, kvlingo on PYTHONPATH, and ENGINE_ENV_DEFAULTS where unset."""
    return {**ENGINE_ENV_DEFAULTS, **os.environ,
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def engine_errors(log: str) -> str:
    """The distinct error lines of an engine's output, first seen first: vLLM's root cause is raised in a worker
    process and is buried far above the traceback that ends the log."""
    seen: dict[str, None] = {}
    for line in log.splitlines():
        found = _ERROR_LINE.search(line)
        if found:
            seen.setdefault(found.group(0).strip())
    return "\n".join(seen)


@dataclass
class Server:
    name: str  # the model name clients pass as `model`
    url: str  # http://127.0.0.1:PORT/v1
    process: subprocess.Popen
    log: Path
    log_start: int = 0  # the log's size when this server started (logs are appended to across runs)


def runs_eager(venv: Path) -> bool:
    """Whether the engines of the serving venv at ``venv`` run eager (vLLM's ``enforce_eager``): yes for vLLM's CPU
    build, whose default compiles the model with Inductor at start-up. Measured for SmolLM2-135M on 2 cores
    (README, "Serving"): 112 s to start compiled against 34 s eager, and no faster once running. A CUDA build keeps
    vLLM's default (compiled, with CUDA graphs)."""
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def server_command(python: Path, model_dir: str, name: str, port: int, kv_role: str,
                   extra: dict[str, Any]) -> list[str]:
    """The command line of one vLLM OpenAI server with the kvlingo connector (`extra`: its
    kv_connector_extra_config, see `infra.serving.check_served_config`); eager where `runs_eager` says so."""
    config = {**CONNECTOR, "kv_role": kv_role, "kv_connector_extra_config": extra}
    eager = ["--enforce-eager"] if runs_eager(python.parent.parent) else []
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
            name, "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", json.dumps(config), *eager]


def start_server(python: Path, model_dir: str, name: str, port: int, kv_role: str, extra: dict[str, Any],
                 log: Path) -> Server:
    """Start one server in its own process group (stdout and stderr to `log`); returns at once."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = log.stat().st_size if log.is_file() else 0
    with open(log, "ab") as out:
        process = subprocess.Popen(server_command(python, model_dir, name, port, kv_role, extra), cwd=ROOT,
                                   env=engine_env(),
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(name, f"http://127.0.0.1:{port}/v1", process, log, start)


def wait_ready(servers: list[Server], timeout_s: float = 600) -> None:
    """Wait until every server answers GET /v1/models.

    Raises:
        ServingError: a server exited or did not answer within `timeout_s` (the end of its log is quoted).
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            if server.process.poll() is not None:
                errors = engine_errors(this_run(server))
                raise ServingError(f"the {server.name} server exited with code {server.process.returncode}; "
                                   f"errors in its log ({server.log}):\n{errors or tail(server.log)}")
            try:
                if httpx.get(f"{server.url}/models", timeout=2).status_code == 200:
                    waiting.remove(server)
            except httpx.HTTPError:
                pass
        if waiting and time.monotonic() > deadline:
            raise ServingError(f"{', '.join(s.url for s in waiting)} did not answer within {timeout_s:.0f} s; "
                               f"see {', '.join(str(s.log) for s in waiting)}")
        if waiting:
            time.sleep(1)


def stop_servers(servers: list[Server], grace_s: float = 30) -> None:
    """SIGTERM each server's process group, then SIGKILL what is left after `grace_s`."""
    for server in servers:
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in servers:
        try:
            server.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()


def this_run(server: Server) -> str:
    """What the server wrote to its log since it started ("" if the log cannot be read)."""
    try:
        with open(server.log, "rb") as f:
            f.seek(server.log_start)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
