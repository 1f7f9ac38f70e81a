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


# flows → tasks → {registry, evals} → infra → translators: a package may import only the ones after it.
# registry and evals sit side by side and import neither each other.
LAYERS = {
    "flows": {"tasks", "registry", "evals", "infra", "translators"},
    "tasks": {"registry", "evals", "infra", "translators"},
    "registry": {"infra", "translators"},
    "evals": {"infra", "translators"},
    "infra": {"translators"},
    "translators": set(),
}
SERVICES = {"prefect", "ray", "mlflow"}  # translators/ and evals/ are usable from a notebook without them


def imported_modules(path: Path) -> set[str]:
    """Every absolute module a file imports, at the top or lazily inside functions."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def layering_violations(root: Path) -> list[str]:
    out = []
    for package, allowed in LAYERS.items():
        forbidden = (set(LAYERS) - allowed - {package}) | (SERVICES if package in ("translators", "evals") else set())
        for path in sorted((root / package).rglob("*.py")):
            for module in sorted(imported_modules(path)):
                if module.split(".")[0] in forbidden:
                    out.append(f"{path.relative_to(root)} imports {module}")
    return sorted(out)


def test_every_import_follows_the_layers_lazy_ones_included():
    assert layering_violations(ROOT) == []


def test_the_layering_check_sees_a_lazy_upward_import(tmp_path):
    for package in LAYERS:
        (tmp_path / package).mkdir()
    (tmp_path / "tasks" / "fit.py").write_text("def run():\n    from flows.cli import app\n    return app\n")
    (tmp_path / "evals" / "m.py").write_text("import ray.train\nfrom registry.tracking import x\n")
    assert layering_violations(tmp_path) == [
        "evals/m.py imports ray.train", "evals/m.py imports registry.tracking", "tasks/fit.py imports flows.cli"]


def test_the_serving_connector_imports_no_services():
    """The vLLM connector runs inside the engine's processes and the serving venv, which has no prefect, ray or
    mlflow: registry references are resolved to artifact paths before the engine starts."""
    for name, uses in (("vllm_connector.py", "infra.serving"), ("serving.py", "translators.artifact")):
        modules = imported_modules(ROOT / "infra" / name)
        assert uses in modules  # the imports were read
        assert not {m for m in modules if m.split(".")[0] in SERVICES}, name
