"""Fault test (issue #11): a fit killed during Gram accumulation and re-run reuses the finished shards and yields
a bit-identical closed form.

`run_fit` accumulates the training set in contiguous shards of `tasks.fit.STATS_SHARD_SIZE` samples, each
stored under its content address in KVLINGO_HOME/stats as soon as it is finished. The test runs
`python -m flows.cli fit --stage1-only` in a subprocess on enough samples for three training shards, SIGKILLs
it once the first shard is stored, re-runs it to completion and compares against an uninterrupted run in a
fresh KVLINGO_HOME.

Tiny models accumulate a shard in well under a second, so killing "after the first shard, before the last"
would be a race. The killed run therefore goes through a test-side wrapper (`SLOW_FIT` below, never product
code) that sleeps after each shard's accumulation, before the shard is saved: the kill lands while shard 2 is
in progress.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tiny_configs import save_tiny_model_dir, words

from tasks.fit import STATS_SHARD_SIZE

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
N_TRAIN, N_VAL = 2 * STATS_SHARD_SIZE + 6, 6  # three training shards: 32, 32, 6

# Test-side delay hook: run the CLI with translators.stage1.accumulate_pair slowed down (sleep after each call).
SLOW_FIT = """
import runpy, sys, time
import translators.stage1 as stage1

_accumulate = stage1.accumulate_pair

def slow_accumulate(*args, **kwargs):
    out = _accumulate(*args, **kwargs)
    time.sleep(DELAY)
    return out

DELAY = float(sys.argv.pop(1))
stage1.accumulate_pair = slow_accumulate
sys.argv[0] = "kvlingo"
runpy.run_module("flows.cli", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit-faults")
    source = save_tiny_model_dir("qwen3", root / "qwen3", seed=1)
    target = save_tiny_model_dir("llama", root / "llama", seed=2)
    data = root / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": words(60, seed=i)}) for i in range(N_TRAIN + N_VAL)))
    config = root / "fit.yaml"
    config.write_text(yaml.safe_dump({"data": str(data), "max_prefix_tokens": 24, "max_continuation_tokens": 6,
                                      "n_train": N_TRAIN, "n_val": N_VAL, "assignment": "depth", "nu": 2}))
    return {"root": root, "args": ["fit", str(source), str(target), "--stage1-only", "--config", str(config), "--json"]}


def env_for(home: Path) -> dict[str, str]:
    return {**os.environ, "KVLINGO_HOME": str(home), "PYTHONPATH": str(ROOT)}


def fit(setup, home: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "flows.cli", *setup["args"]], cwd=ROOT, env=env_for(home),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def finished_shards(home: Path) -> dict[str, tuple[int, int, int]]:
    """Stored shards (both sides written, final name) → (directory inode, keys file inode, keys file mtime_ns)."""
    out = {}
    stats = home / "stats"
    for d in sorted(stats.iterdir()) if stats.is_dir() else []:
        if d.name.endswith(".tmp") or not all((d / f"{side}.safetensors").is_file() for side in ("keys", "values")):
            continue
        keys = (d / "keys.safetensors").stat()
        out[d.name] = (d.stat().st_ino, keys.st_ino, keys.st_mtime_ns)
    return out


def closed_form(summary: dict) -> dict[str, torch.Tensor]:
    return load_file(str(Path(summary["artifact"]) / "weights.safetensors"))


def test_killed_fit_reuses_finished_shards_and_gives_bit_identical_closed_form(setup):
    reference = fit(setup, setup["root"] / "home-uninterrupted")
    assert reference["stats_shards"]["train"] == {"shards": 3, "reused": 0, "computed": 3}
    assert reference["n_train"] == N_TRAIN

    home = setup["root"] / "home-killed"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_FIT, "3", *setup["args"]], cwd=ROOT, env=env_for(home),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not finished_shards(home):
            assert proc.poll() is None, f"the fit ended before its first shard was stored: {proc.communicate()[1][-3000:]}"
            assert time.monotonic() < deadline, "no statistics shard appeared within 180 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    survived = finished_shards(home)
    assert len(survived) == 1, survived  # killed while the second training shard was in progress
    assert not list((home / "runs").rglob("weights.safetensors"))  # no closed form was written

    read_from = time.time()
    resumed = fit(setup, home)
    assert resumed["stats_shards"]["train"] == {"shards": 3, "reused": 1, "computed": 2}
    after = finished_shards(home)
    for key, stamp in survived.items():
        assert after[key] == stamp, f"finished shard {key} was recomputed"  # same inodes, same mtime
        # ... and its directory records the read, which `kvlingo stats-store prune --max-gb` keeps longest
        assert (home / "stats" / key).stat().st_mtime >= read_from - 1
    assert set(after) == set(finished_shards(setup["root"] / "home-uninterrupted"))  # same content addresses

    expected, got = closed_form(reference), closed_form(resumed)
    assert set(got) == set(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert resumed["val_kl"] == reference["val_kl"] and resumed["r2_per_layer"] == reference["r2_per_layer"]
