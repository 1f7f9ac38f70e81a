"""Process-wide platform settings: where kvlingo keeps its data, and the offline/telemetry switches.

Nothing here runs at import time; entry points call :func:`apply_offline_defaults` once.
"""

from __future__ import annotations

import os
from pathlib import Path

# Offline-first defaults: the HF, Prefect, MLflow and Ray offline and telemetry switches. `setdefault` so that
# a user who exports HF_HUB_OFFLINE=0 to reach the hub on purpose keeps that choice.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    # A tracking server that goes away mid-run: fail within about a minute instead of MLflow's default minutes
    # of retries (the run's local artifacts stay in its run directory for a re-run to log).
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    "TOKENIZERS_PARALLELISM": "false",
    # OpenMP threads sleep instead of spinning between parallel regions. On shared or small CPU machines the
    # spinning made every forward 5-10x slower and noisy (measured here with two jobs on 2 cores). Only takes
    # effect when set before torch is imported, which entry points do. It has a price for one job alone, measured
    # as the mean of the first 120 training steps of the kvlingo-tiny-s build (`infra.tiny_models.
    # train_tiny_model` with a callback timing each step): 0.168 s here against 0.115 s at libgomp's default
    # spinning and 0.130 s at GOMP_SPINCOUNT=1000; two such jobs at once take 0.21 s, 0.62 s and 0.24 s. With
    # GOMP_SPINCOUNT=1000 instead, the demo from a fresh clone took 1024 s against 1077 s (embedded-pair build
    # 554 s against 627 s): too little to trade the two-job case for.
    "OMP_WAIT_POLICY": "PASSIVE",
    # torch 2.13's profiler (the CPU memory measurement of `evals.memory`) writes two "USDT: … profiler_start" /
    # "profiler_stop" lines to stderr each time it runs (24 lines in the demo's output). Kineto logs at level 5;
    # 6 turns its log off, its error lines included.
    "KINETO_LOG_LEVEL": "6",
}


def kvlingo_home() -> Path:
    """The platform's data directory: `$KVLINGO_HOME`, else `~/.cache/kvlingo`. Not created here."""
    return Path(os.environ.get("KVLINGO_HOME", Path.home() / ".cache" / "kvlingo")).expanduser()


def apply_offline_defaults() -> None:
    """Set the offline and telemetry switches (without overriding values the user exported).

    Called by entry points (CLI, test session), never at import. Creates PREFECT_HOME: Prefect's temporary
    local server keeps its sqlite database there and fails to start without the directory.
    """
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("PREFECT_HOME", str(kvlingo_home() / "prefect"))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)


def stop_local_services() -> None:
    """Stop the services kvlingo started in this process: Prefect's temporary API server and local Ray.

    Both otherwise stop from `atexit` handlers, which run after a host such as pytest has closed its output
    streams; their shutdown log lines then fail with "I/O operation on closed file". Entry points call this
    while their streams are still open. A no-op for a service this process never imported.
    """
    import sys

    if "prefect.logging.handlers" in sys.modules:
        # Send the run logs and events still queued for the API while the server is up; otherwise their workers
        # report "Error logging to API: All connection attempts failed" after it stops.
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
        EventsWorker.drain_all(timeout=10)
    if "prefect.server.api.server" in sys.modules:
        from prefect.server.api.server import SubprocessASGIServer

        # Prefect keeps its temporary servers in this class-level table (one per port) and has no public
        # "stop all"; stop() removes each from the table.
        for server in list(SubprocessASGIServer._instances.values()):
            server.stop()
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
