"""The one switch of issue 17: --workers N > 1 or a Ray address (argument or RAY_ADDRESS) sends the heavy steps to
Ray; without them nothing imports or starts Ray."""

import subprocess
import sys
from pathlib import Path

from tasks.cluster import ray_address, release_workers, use_ray

ROOT = Path(__file__).resolve().parents[2]


def test_switch(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not use_ray(1) and use_ray(2) and use_ray(1, "10.0.0.1:6379")
    assert ray_address() is None and ray_address("h:1") == "h:1"
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert use_ray(1) and ray_address() == "head:6379" and ray_address("h:1") == "h:1"
    monkeypatch.setenv("RAY_ADDRESS", "")  # an empty variable (a deployment without a cluster) is no address
    assert not use_ray(1) and ray_address() is None


def test_one_process_path_never_imports_ray():
    code = ("import sys\nfrom tasks.cluster import release_workers, use_ray\nimport tasks.fit, tasks.evaluate\n"
            "release_workers()\nassert not use_ray(1)\nprint('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"PATH": "", "RAY_ADDRESS": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_cli_options_reach_the_configs():
    """--workers / --ray-address (or RAY_ADDRESS) are accepted by fit, eval and sweep."""
    from typer.testing import CliRunner

    from flows.cli import app

    for command in ("fit", "eval", "sweep"):
        out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert out.exit_code == 0 and "--workers" in out.stdout and "--ray-address" in out.stdout, command
    release_workers()  # no pool: a no-op without Ray
