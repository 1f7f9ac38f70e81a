"""The embedded models' lineage, and building any set of them on every core.

Every embedded model is derived from others (`kvlingo-tiny-l` grows from `kvlingo-tiny-s`, the hybrids from the
pair, `kvlingo-tiny-l-gdn`'s mixers from `kvlingo-tiny-s-gdn`'s, the Kimi-Linear hybrid from
`kvlingo-tiny-s-mla`). Each build runs on a pinned thread count (`infra.tiny_models.build_under_lock`) so that its
weights do not depend on the caller's or the machine's; a build therefore leaves the other cores idle, and two
independent lineages (the GDN pair beside the MLA family) build side by side in separate processes without
changing a single weight. :func:`build_embedded` does that: a model starts once its parents are built, at most
``jobs`` at a time.
"""

from __future__ import annotations

import difflib
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from translators.errors import ConfigError


def embedded_names() -> list[str]:
    """Every embedded model, parents before children (each family derives only from the ones listed before it,
    and within a family parents come first: `tests/unit/test_embedded_build.py` checks the order)."""
    from infra import gdn_models, kda_models, mla_models, tiny_models

    return [*tiny_models.TINY_MODELS, *mla_models.MLA_MODELS, *gdn_models.GDN_MODELS, *kda_models.KDA_MODELS]


def embedded_parents(name: str) -> tuple[str, ...]:
    """The embedded models ``name`` is derived from directly (none for `kvlingo-tiny-s`).

    Raises:
        ConfigError: ``name`` is not an embedded model (with the nearest one).
    """
    from infra import gdn_models, kda_models, mla_models, tiny_models

    if name in tiny_models.TINY_MODELS:
        grown_from = tiny_models.TINY_MODELS[name].grown_from
        return (grown_from,) if grown_from else ()
    if name in mla_models.MLA_MODELS:
        return (mla_models.MLA_MODELS[name].parent,)
    if name in gdn_models.GDN_MODELS:
        spec = gdn_models.GDN_MODELS[name]
        return (spec.parent, spec.mixers_from) if spec.mixers_from else (spec.parent,)
    if name in kda_models.KDA_MODELS:
        return (kda_models.KDA_MODELS[name].parent,)
    raise ConfigError(_unknown_message([name]))


def ensure_embedded(name: str, *, home: Path | None = None, progress: bool = True) -> Path:
    """Directory of the built embedded model ``name``, building it and its parents first if needed.

    Raises:
        ConfigError: ``name`` is not an embedded model.
    """
    from infra import gdn_models, kda_models, mla_models, tiny_models

    if name in gdn_models.GDN_MODELS:
        return gdn_models.ensure_gdn_model(name, home=home, progress=progress)
    if name in kda_models.KDA_MODELS:
        return kda_models.ensure_kda_model(name, home=home, progress=progress)
    if name in mla_models.MLA_MODELS:
        return mla_models.ensure_mla_model(name, home=home, progress=progress)
    if name in tiny_models.TINY_MODELS:
        return tiny_models.ensure_tiny_model(name, home=home, progress=progress)
    raise ConfigError(_unknown_message([name]))


def check_embedded_names(names: Sequence[str]) -> None:
    """Raises ConfigError naming every name that is not an embedded model, each with its nearest one."""
    known = set(embedded_names())
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(_unknown_message(unknown))


def with_ancestors(names: Sequence[str]) -> list[str]:
    """``names`` and every model they derive from, parents before children."""
    check_embedded_names(names)
    closure: set[str] = set()
    pending = list(names)
    while pending:
        name = pending.pop()
        if name not in closure:
            closure.add(name)
            pending.extend(embedded_parents(name))
    return [name for name in embedded_names() if name in closure]


def _unknown_message(unknown: Sequence[str]) -> str:
    known = embedded_names()
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"Not an embedded model: {', '.join(parts)}. Embedded models: {', '.join(known)}."


# --- Building on every core ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildOutcome:
    """One model of a :func:`build_embedded` call."""

    name: str
    status: str  # "built" | "cached" | "failed" | "skipped" (a parent failed)
    seconds: float  # wall time of its own build in its worker (0 when cached or skipped)
    directory: str = ""
    error: str = ""


def build_embedded(names: Sequence[str], *, jobs: int, home: Path | None = None,
                   builder: Callable[[str, str | None], tuple[str, bool]] | None = None) -> list[BuildOutcome]:
    """Build ``names`` and their parents, each in a worker process once its parents are built, ``jobs`` at a time.

    A failed build is reported, not raised: what was built stays built (each build is atomic, see
    `infra.tiny_models.build_under_lock`), and the models derived from it are skipped.

    Args:
        builder: ``(name, home) -> (directory, built)`` run in the workers; it must be importable by the spawned
            processes (a module-level function). Default :func:`_build_one`. It is timed inside the worker, so a
            model's seconds leave out its wait for a free worker.

    Returns:
        One outcome per model, parents before children.

    Raises:
        ConfigError: an unknown name (all of them listed), or ``jobs`` < 1.
    """
    if jobs < 1:
        raise ConfigError(f"jobs must be at least 1, got {jobs}")
    order = with_ancestors(names)
    builder = builder or _build_one
    outcomes: dict[str, BuildOutcome] = {}
    started: dict[Future, str] = {}
    home_arg = str(home) if home is not None else None
    # spawn, not fork: the parent may hold torch's thread pools, which a forked child inherits broken.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        while len(outcomes) < len(order):
            for name in order:
                if name in outcomes or name in started.values():
                    continue
                parents = embedded_parents(name)
                unbuilt = [p for p in parents if p in outcomes and outcomes[p].status in ("failed", "skipped")]
                if unbuilt:
                    outcomes[name] = BuildOutcome(name, "skipped", 0.0, error=f"not built: its parent {unbuilt[0]} was not")
                elif all(p in outcomes for p in parents):
                    started[pool.submit(_timed, builder, name, home_arg)] = name
            if not started:
                continue  # only skips were decided this round
            done, _ = wait(started, return_when=FIRST_COMPLETED)
            for future in done:
                name = started.pop(future)
                try:
                    directory, built, seconds = future.result()
                except Exception as err:  # reported per model; the other lineages go on building
                    outcomes[name] = BuildOutcome(name, "failed", 0.0, error=f"{type(err).__name__}: {err}")
                else:
                    outcomes[name] = BuildOutcome(name, "built" if built else "cached",
                                                  round(seconds, 1) if built else 0.0, directory)
    return [outcomes[name] for name in order]


def _timed(builder: Callable[[str, str | None], tuple[str, bool]], name: str, home: str | None
           ) -> tuple[str, bool, float]:
    """Worker: ``builder(name, home)`` and its wall time in this process."""
    started = time.perf_counter()
    directory, built = builder(name, home)
    return directory, built, time.perf_counter() - started


def _build_one(name: str, home: str | None) -> tuple[str, bool]:
    """Worker: build ``name`` (its parents are built already); ``(directory, whether it was built now)``."""
    from infra.settings import apply_offline_defaults, kvlingo_home
    from infra.tiny_models import BUILD_FILE

    apply_offline_defaults()
    home_path = Path(home) if home is not None else None
    build_file = Path(home_path if home_path is not None else kvlingo_home()) / "models" / name / BUILD_FILE
    before = build_file.stat().st_mtime_ns if build_file.exists() else None
    directory = ensure_embedded(name, home=home_path, progress=False)
    # A build writes a new build file (atomically, with the model); a cached model keeps its old one.
    return str(directory), (directory / BUILD_FILE).stat().st_mtime_ns != before
