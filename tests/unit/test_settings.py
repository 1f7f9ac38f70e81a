"""The process-wide switches entry points set: checked in a fresh interpreter, since most are read once at import."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROFILE_ONCE = """
from infra.settings import apply_offline_defaults
apply_offline_defaults()
import torch
from evals.memory import peak_memory
with peak_memory("cpu") as peak:
    x = torch.ones(1024, 1024)
print(peak.mb)
"""


def test_the_cpu_memory_measurement_writes_nothing_to_stderr():
    """torch's profiler logged two "USDT: … profiler_start/stop" lines per measurement; the switches silence them."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", PROFILE_ONCE], capture_output=True, text=True, env=env, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) >= 4.0  # the 4 MiB tensor was measured
    assert "USDT" not in proc.stderr and "profiler_st" not in proc.stderr, proc.stderr
