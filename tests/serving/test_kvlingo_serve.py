"""Serving tier: `kvlingo serve` starts the source and target vLLM OpenAI servers with the connector, a client
switches a conversation between them over HTTP, and Ctrl-C stops both."""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.serving

ROOT = Path(__file__).resolve().parents[2]
KVLINGO = ROOT / ".venv" / "bin" / "kvlingo"
MODEL = "smollm2-135m-instruct"


def _free_port_pair() -> int:
    for port in range(18100, 18400, 2):
        ok = True
        for p in (port, port + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return port
    raise AssertionError("no two free consecutive ports in 18100-18400")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_kvlingo_serve_switches_a_conversation_and_stops_on_ctrl_c(tmp_path):
    import httpx

    if not (ROOT / ".venv-serve" / "bin" / "python").is_file():
        pytest.fail("the serving venv is missing: run `bash infra/bootstrap.sh --serve`")
    port = _free_port_pair()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "KVLINGO_HOME": os.environ.get("KVLINGO_HOME", str(Path.home() / ".cache" / "kvlingo"))}
    cli = subprocess.Popen([str(KVLINGO), "serve", MODEL, MODEL, "--translator", "identity", "--port", str(port),
                            "--store", str(tmp_path / "store")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        lines, deadline = [], time.monotonic() + 900
        while time.monotonic() < deadline:
            line = cli.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Ctrl-C to stop both"):
                break
        assert lines and lines[-1].startswith("Ctrl-C"), f"kvlingo serve did not start: {lines}\n{cli.stderr.read()[-3000:]}"
        source_url = next(l.split()[2] for l in lines if l.startswith("source "))
        target_url = next(l.split()[2] for l in lines if l.startswith("target "))
        assert (source_url, target_url) == (f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port + 1}/v1")
        prompt = ("The committee met on Tuesday to review the budget. After a long discussion about the new library, "
                  "the chair asked everyone to vote. The result was")
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        first = httpx.post(f"{source_url}/completions", json=body, timeout=300).json()
        key = first["kv_transfer_params"]["conversation"]
        switched = httpx.post(f"{target_url}/completions", timeout=300,
                              json={**body, "kv_transfer_params": {"source_conversation": key}}).json()
        native = httpx.post(f"{target_url}/completions", json=body, timeout=300).json()
        params = switched["kv_transfer_params"]
        assert params["status"] == "applied", params
        assert params["loaded_tokens"] == first["usage"]["prompt_tokens"] - 1
        assert switched["choices"][0]["text"] == native["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        cli.send_signal(signal.SIGINT)
        try:
            code = cli.wait(timeout=120)
        except subprocess.TimeoutExpired:
            cli.kill()
            raise
    assert code == 0, cli.stderr.read()[-3000:]
    assert not _listening(port) and not _listening(port + 1)
