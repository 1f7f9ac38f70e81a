"""Serving tier: `kvlingo bench serve --json` (its public keys, a switch served through vLLM at every length)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.serving

ROOT = Path(__file__).resolve().parents[2]


def test_bench_serve_json_contract():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "kvlingo"), "bench", "serve", "smollm2-135m-instruct",
                           "smollm2-135m-instruct", "--lengths", "200,400", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert list(result) == ["rows"]
    assert [row["n"] for row in result["rows"]] == [200, 400]
    for row in result["rows"]:
        assert set(row) == {"n", "switch_s", "prefill_s", "ratio", "status"}
        assert row["status"] == "applied"
        assert row["switch_s"] > 0 and row["prefill_s"] > 0
        assert row["ratio"] == pytest.approx(row["prefill_s"] / row["switch_s"])

