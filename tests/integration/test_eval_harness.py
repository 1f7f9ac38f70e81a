"""Harness sanity on a real model: SmolLM2-135M translated into itself by the identity scores exactly as the
target itself on every benchmark of the quick suite (the same items, the same decoding)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_identity_equals_native_on_quick_suite(shared_data, tmp_path):
    env = {**os.environ, "KVLINGO_HOME": os.environ.get("KVLINGO_HOME", os.path.expanduser("~/.cache/kvlingo"))}
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "eval", "smollm2-135m-instruct", "smollm2-135m-instruct", "--suite", "quick",
         "--translator", "identity", "--fit-dir", str(tmp_path), "--limit", "2", "--data-dir", str(shared_data),
         "--ruler-lengths", "128,256", "--json"],
        capture_output=True, text=True, timeout=3000, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    rows = {(r["benchmark"], r["condition"]): r for r in out["rows"]}
    benchmarks = {b for b, _ in rows}
    assert {"corpus_kl", "first_token_kl", "recall", "needle", "ruler_noise_128", "ruler_noise_256", "mmlu_pro",
            "arc_challenge", "gsm8k", "xquad_multiturn"} <= benchmarks
    for bench in benchmarks:
        native, identity = rows[(bench, "target_native")], rows[(bench, "identity")]
        assert identity["n"] == native["n"] > 0
        assert identity["score"] == pytest.approx(native["score"], abs=1e-6), bench
    assert rows[("corpus_kl", "identity")]["score"] <= 1e-6
