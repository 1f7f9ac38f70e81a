"""Serve the MLflow UI over the platform's store, as a context manager that leaves no process behind.

The server runs in its own session (process group): Ctrl-C in the terminal reaches only kvlingo, which then
terminates the whole group (the `mlflow server` launcher and its uvicorn worker), escalating to SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from infra.settings import apply_offline_defaults, kvlingo_home
from registry.errors import RegistryError
from registry.tracking import artifact_root, is_server_uri, tracking_uri, use_tracking_store

LOOPBACK = "127.0.0.1"
STARTUP_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each stops `serve_forever` cleanly


@dataclass(frozen=True)
class UiServer:
    """A running UI: `url` to open, the launcher `process`, its process group, and the server's log file."""

    url: str
    process: subprocess.Popen
    pgid: int
    log_path: Path


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raises RegistryError when `port` is taken, before a server is started that would fail on it."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as err:
            raise RegistryError(f"port {port} on {host} is in use ({err.strerror}): pass --port with a free port") from err


def server_command(store_uri: str, host: str, port: int) -> list[str]:
    """`mlflow server` on the store, one worker (2-core machines), artifacts of new experiments under
    `kvlingo_home()/mlflow/artifacts`."""
    return [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", store_uri,
        "--default-artifact-root", artifact_root().as_uri(),
        "--host", host, "--port", str(port), "--workers", "1",
    ]


def server_env() -> dict[str, str]:
    """This process's environment with the offline switches; job execution off (else it forks job workers)."""
    apply_offline_defaults()
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}


@contextmanager
def serve_ui(port: int | None = None, host: str = LOOPBACK, *, startup_timeout: float = STARTUP_TIMEOUT_S) -> Iterator[UiServer]:
    """Start `mlflow server` on the platform's store, wait until it answers, yield it, and stop its process
    group on exit (also on exceptions and KeyboardInterrupt).

    Args:
        port: None picks a free port.
    Raises:
        RegistryError: the tracking URI is already a server (open it instead), the port is taken, or the server
            exited or did not answer within `startup_timeout` (the log tail is in the message).
        TrackingUnavailableError: the local store is not writable.
    """
    uri = tracking_uri()
    if is_server_uri(uri):
        raise RegistryError(f"MLFLOW_TRACKING_URI points at a running server already: open {uri} in a browser")
    use_tracking_store()  # creates the default store directory and checks it is writable
    port = free_port(host) if port is None else port
    check_port_free(host, port)
    log_path = kvlingo_home() / "mlflow" / "ui.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        # Own session: terminal signals do not reach the server; we stop its whole group ourselves.
        process = subprocess.Popen(server_command(uri, host, port), stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, env=server_env(), start_new_session=True)
    server = UiServer(f"http://{_display_host(host)}:{port}", process, process.pid, log_path)
    try:
        wait_until_ready(server, startup_timeout)
        yield server
    finally:
        stop_group(process, server.pgid)


def _display_host(host: str) -> str:
    return LOOPBACK if host in ("0.0.0.0", "") else host


def wait_until_ready(server: UiServer, timeout: float) -> None:
    """Poll `/health` until it answers 200.

    Raises:
        RegistryError: the server exited, or did not answer within `timeout` seconds.
    """
    # No proxies: the server is local, and a proxy from the environment must not intercept loopback calls.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RegistryError(f"the MLflow UI server exited with code {server.process.returncode}:\n{_tail(server.log_path)}")
        try:
            with opener.open(f"{server.url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RegistryError(f"the MLflow UI server did not answer within {timeout:.0f} s:\n{_tail(server.log_path)}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in process group `pgid`.

    Zombies are ignored: an orphaned worker is reparented to PID 1, which in a container may never reap it,
    yet it runs nothing and holds no port.
    """
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: ask the kernel, zombies included
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(process: subprocess.Popen, pgid: int, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group, wait up to `grace` seconds, then SIGKILL what is left; reap the launcher."""
    if _signal_group(pgid, signal.SIGTERM) and not _wait_gone(process, pgid, grace):
        _signal_group(pgid, signal.SIGKILL)
        _wait_gone(process, pgid, 5.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(process: subprocess.Popen, pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()  # reap the launcher so it does not linger as our zombie
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    return not group_alive(pgid)


class StopRequest:
    """Signal handler for STOP_SIGNALS: records the request, then raises KeyboardInterrupt so `serve_ui` cleans up
    as on Ctrl-C. Python drops an exception raised while a finalizer or weakref callback runs (the signal may land
    in one), so the serving loop also checks `requested`: no stop request is ever lost."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum, frame) -> None:
        self.requested = True
        raise KeyboardInterrupt


def serve_forever(port: int | None, host: str, on_ready) -> int:
    """Run the UI until Ctrl-C, SIGTERM or SIGHUP (exit code 0) or until the server dies (exit code 1).

    `on_ready(server)` is called once it answers (e.g. to print the address). Call from the main thread (signal
    handlers are installed there, and restored on return).

    Raises:
        RegistryError, TrackingUnavailableError: see :func:`serve_ui`.
    """
    stop = StopRequest()
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        with serve_ui(port, host) as server:
            on_ready(server)
            try:
                while server.process.poll() is None and not stop.requested:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                return 0
            return 0 if stop.requested else 1
    except KeyboardInterrupt:  # interrupted while starting: serve_ui has stopped the group already
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
