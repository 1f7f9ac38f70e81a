"""The two real GGUF models from PyPI packages: exact round trip through the `kvlingo doctor` command."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("model, family, n_layers", [("smollm2-135m-instruct", "llama", 30), ("gemma3-270m", "gemma3_text", 18)])
def test_doctor_on_gguf_model(model, family, n_layers):
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "doctor", model, "--json"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["family"] == family and report["n_layers"] == n_layers, report
    for point in ("pre_norm", "post_norm", "post_rope"):
        assert report["points"][point]["max_abs_logit_diff"] <= 1e-4, (point, report)
        assert report["points"][point]["grad_ok"] is True, (point, report)
    assert report["ok"] is True, report
