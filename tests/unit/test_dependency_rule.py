"""The one dependency rule: the numerical core (translators/, evals/) imports no prefect, ray or mlflow."""

import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_core_imports_no_orchestration_or_tracking():
    modules = [f"{pkg}.{m.name}" for pkg in ("translators", "evals") for m in pkgutil.iter_modules([str(ROOT / pkg)])]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'ray', 'mlflow'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"core modules pulled in: {out.stdout.strip()}"
    assert len(modules) > 20
