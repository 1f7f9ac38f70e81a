"""Stage 1 on a real two-node Ray cluster (`ray start --head` on this machine plus a second node joining it, one
CPU each, started and stopped by the test): `kvlingo fit --stage1-only --workers 2 --ray-address …` gives the
closed-form maps of `--workers 1` bit for bit, and a re-run reuses every finished shard; `kvlingo eval --workers 2`
splits each benchmark's items over the two nodes and gives the one-process rows.

The two actors need one CPU each and each node has one, so the shards are computed on both nodes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from evals.benchmarks import get

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
PAIR = ("kvlingo-tiny-l", "kvlingo-tiny-s")
FIT = ["fit", *PAIR, "--stage1-only", "--n-train", "70", "--n-val", "8", "--json"]  # 3 train shards + 1 held-out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_env() -> dict[str, str]:
    # Ray 2.5x turns token authentication on for `ray start`; a throwaway loopback cluster does without.
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _stop(process: subprocess.Popen) -> None:
    """Stop one `ray start --block` and the daemons it started (its own process group), gracefully first."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # daemons still draining
    except ProcessLookupError:
        pass
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster():
    """Address of a head node plus one worker node, one CPU each; both stopped afterwards."""
    temp = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    port = _free_port()
    address = f"127.0.0.1:{port}"
    common = ["--block", "--num-cpus", "1", "--object-store-memory", str(200 * 2**20), "--disable-usage-stats"]
    started = []
    try:
        started.append(subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
             "--include-dashboard", "false", "--temp-dir", str(temp), *common],
            env=_cluster_env(), stdout=open(temp / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True))
        _wait_nodes(address, 1, started)
        started.append(subprocess.Popen(
            [str(BIN / "ray"), "start", "--address", address, "--node-ip-address", "127.0.0.1", *common],
            env=_cluster_env(), stdout=open(temp / "worker.log", "w"), stderr=subprocess.STDOUT, start_new_session=True))
        _wait_nodes(address, 2, started)
        yield address
    finally:
        for process in reversed(started):
            _stop(process)
        shutil.rmtree(temp, ignore_errors=True)


def _wait_nodes(address: str, n: int, started: list, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in started):
            raise RuntimeError("a ray start process exited early")
        out = subprocess.run([str(BIN / "ray"), "status", "--address", address], env=_cluster_env(),
                             capture_output=True, text=True, timeout=60)
        active = out.stdout.split("Active:")[-1].split("Pending:")[0] if "Active:" in out.stdout else ""
        if active.count("node_") >= n:
            return
        time.sleep(1)
    raise RuntimeError(f"the Ray cluster at {address} did not reach {n} nodes")


@pytest.fixture(scope="module")
def models_dir() -> Path:
    """The embedded pair, built (or found) in the default KVLINGO_HOME and shared read-only by the fits."""
    from infra.settings import kvlingo_home
    from infra.tiny_models import ensure_tiny_model

    for name in PAIR:
        ensure_tiny_model(name, progress=False)
    return kvlingo_home() / "models"


def _kvlingo(home: Path, models: Path, *args: str, env: dict | None = None) -> dict:
    """A `kvlingo … --json` command in a subprocess on its own KVLINGO_HOME (an empty statistics store) sharing
    the models."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "models").exists():
        (home / "models").symlink_to(models)
    run_env = {**(env or _cluster_env()), "KVLINGO_HOME": str(home)}
    if env is None:
        run_env.pop("RAY_ADDRESS", None)  # only what the test passes decides where the work runs
    out = subprocess.run([str(BIN / "kvlingo"), *args], env=run_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _fit(home: Path, models: Path, *extra: str, env: dict | None = None) -> dict:
    return _kvlingo(home, models, *FIT, *extra, env=env)


def _maps(summary: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(summary["artifact"]) / "weights.safetensors"))


def _same_to_fp32_rounding(a, b) -> bool:
    """Equal structure, strings and integers; floats within 1e-5 relative (fp32 sums in another order agree to
    ~1e-7)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-5,
                                                                                          abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_to_fp32_rounding(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_to_fp32_rounding(x, y) for x, y in zip(a, b))
    return a == b


def test_stage1_on_two_nodes_matches_one_process_bit_for_bit(cluster, models_dir, tmp_path):
    one = _fit(tmp_path / "one", models_dir, "--workers", "1")
    two = _fit(tmp_path / "two", models_dir, "--workers", "2", "--ray-address", cluster)
    assert one["stats_shards"]["train"] == two["stats_shards"]["train"] == {"shards": 3, "reused": 0, "computed": 3}
    a, b = _maps(one), _maps(two)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert one["val_kl"] == two["val_kl"] and one["r2"] == two["r2"]
    # Every shard file is byte-identical in the two statistics stores.
    stores = [sorted((tmp_path / h / "stats").iterdir()) for h in ("one", "two")]
    assert [p.name for p in stores[0]] == [p.name for p in stores[1]] and len(stores[0]) == 4
    for x, y in zip(*stores):
        for f in x.iterdir():
            assert f.read_bytes() == (y / f.name).read_bytes(), f
    # A re-run (cluster from RAY_ADDRESS this time) computes nothing: every shard is read back from the store.
    again = _fit(tmp_path / "two", models_dir, "--workers", "2", env={**_cluster_env(), "RAY_ADDRESS": cluster})
    assert again["stats_shards"]["train"] == {"shards": 3, "reused": 3, "computed": 0}
    assert all(torch.equal(v, _maps(again)[k]) for k, v in b.items())

    # Evaluation: (benchmark, condition, item shard) units on the two nodes (both benchmarks are item-sharded:
    # each condition's 4 items split 2 + 2 over the workers) give the one-process rows, CIs included: the same
    # items, counts and recall hits; KL to fp32 rounding (the actors run one thread, this process two, and fp32
    # matmuls sum in another order at another thread count: 8.345098733 vs 8.345099449 nats measured in CI).
    evaluate = ["eval", *PAIR, "--fit-dir", one["run_dir"], "--benchmark", "recall", "--benchmark", "first_token_kl",
                "--limit", "4", "--json"]
    assert get("recall").item_shards and get("first_token_kl").item_shards
    rows_one = _kvlingo(tmp_path / "one", models_dir, *evaluate, "--workers", "1")
    rows_two = _kvlingo(tmp_path / "two", models_dir, *evaluate, "--workers", "2", "--ray-address", cluster)
    assert rows_one["conditions"] == rows_two["conditions"] and "closed_form" in rows_one["conditions"]
    assert len(rows_one["rows"]) >= 8 and rows_two["errors"] == []
    assert _same_to_fp32_rounding(rows_one["rows"], rows_two["rows"]), (rows_one["rows"], rows_two["rows"])
    recall = [(r["condition"], r["score"]) for r in rows_one["rows"] if r["benchmark"] == "recall"]
    assert recall == [(r["condition"], r["score"]) for r in rows_two["rows"] if r["benchmark"] == "recall"]
