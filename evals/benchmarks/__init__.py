"""The benchmark registry: one module per benchmark in this package, each defining `SPEC = BenchmarkSpec(...)`.

Adding a benchmark = adding one module here (named like the benchmark, e.g. `needle.py` for `needle`); modules
whose name starts with "_" are helpers. Preflight (unknown names, required files, suite membership), the
evaluation loop, the fit flow's quick benchmarks and the README table all read the specs found here:

    from evals.benchmarks import all_specs, get, suite
    suite("data_free")  # ['corpus_kl', 'first_token_kl', 'needle', 'recall']

`python -m evals.benchmarks` prints the README's benchmark table.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from pathlib import Path

from evals.benchmarks._spec import (
    SUITE_HELP,
    SUITES,
    BenchContext,
    BenchmarkSpec,
    BenchmarkUnavailableError,
    ItemScores,
    merge_shards,
)
from translators.errors import ConfigError

__all__ = [
    "SUITES", "SUITE_HELP", "BenchContext", "BenchmarkSpec", "BenchmarkUnavailableError", "ItemScores",
    "merge_shards", "all_specs", "get", "suite", "default_suite", "unknown_benchmark_message", "markdown_table",
]


def _module_names() -> list[str]:
    """Benchmark module names on the package path (helpers, "_*", excluded); the path may grow at runtime."""
    return sorted({m.name for m in pkgutil.iter_modules(list(__path__)) if not m.name.startswith("_") and not m.ispkg})


def all_specs() -> dict[str, BenchmarkSpec]:
    """Every registered benchmark by name: data-free ones first, then quick, then full-only; by name within.

    Raises:
        ConfigError: a module without a SPEC, a SPEC named unlike its module, or a module that fails to import.
    """
    specs: dict[str, BenchmarkSpec] = {}
    for module_name in _module_names():
        qualified = f"{__name__}.{module_name}"
        try:
            module = importlib.import_module(qualified)
        except ImportError as err:
            raise ConfigError(f"benchmark module {qualified} failed to import: {err}") from err
        spec = getattr(module, "SPEC", None)
        if not isinstance(spec, BenchmarkSpec):
            raise ConfigError(f"benchmark module {qualified} defines no SPEC = BenchmarkSpec(...) "
                              "(name helper modules with a leading underscore)")
        if spec.name != module_name:
            raise ConfigError(f"benchmark module {qualified} registers {spec.name!r}: name the module like the benchmark")
        specs[spec.name] = spec
    order = sorted(specs.values(), key=lambda s: (min(SUITES.index(x) for x in s.suites), s.name))
    return {s.name: s for s in order}


def unknown_benchmark_message(name: str, known: list[str] | None = None) -> str:
    """"unknown benchmark 'x'; did you mean 'y'? (available: ...)"."""
    known = list(all_specs()) if known is None else known
    close = difflib.get_close_matches(name, known, n=2, cutoff=0.4)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown benchmark {name!r}{hint} (available: {', '.join(known)})"


def get(name: str) -> BenchmarkSpec:
    """The spec registered as `name`.

    Raises:
        ConfigError: unknown name (with the closest names).
    """
    specs = all_specs()
    if name not in specs:
        raise ConfigError(unknown_benchmark_message(name, list(specs)))
    return specs[name]


def suite(name: str) -> list[str]:
    """The benchmarks of one suite, in registry order.

    Raises:
        ConfigError: unknown suite.
    """
    if name not in SUITES:
        close = difflib.get_close_matches(name, SUITES, n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown suite {name!r}{hint} (choose {', '.join(SUITES)})")
    return [spec.name for spec in all_specs().values() if name in spec.suites]


def default_suite(data_dir: Path | str | None) -> str:
    """`data_free` without a data directory (works on every pair out of the box), `quick` with one."""
    return "quick" if data_dir is not None else "data_free"


def markdown_table() -> str:
    """The README's benchmark table, generated from the specs."""
    lines = ["| benchmark | suites | metric | better | local files (under `--data-dir`) | what it measures |",
             "|---|---|---|---|---|---|"]
    for spec in all_specs().values():
        files = [" or ".join(f"`{a}`" for a in ((e,) if isinstance(e, str) else e)) for e in spec.required_files]
        lines.append(f"| `{spec.name}` | {', '.join(spec.suites)} | {spec.metric} | "
                     f"{'higher' if spec.higher_is_better else 'lower'} | {', '.join(files) or '—'} | "
                     f"{spec.description} |")
    return "\n".join(lines)
