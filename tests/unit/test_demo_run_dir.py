"""The demo's run directory: resumable for the same builds and steps, fresh otherwise."""

from __future__ import annotations

import dataclasses

from flows.pipeline import DEMO_PAIR, demo_run_dir
from infra.tiny_models import TINY_MODELS


def test_demo_run_dir_is_keyed_by_builds_and_steps(kvlingo_home, monkeypatch):
    source, target = DEMO_PAIR
    first = demo_run_dir(source, target, 60)
    assert first == demo_run_dir(source, target, 60)
    assert first.parent == kvlingo_home / "runs" / "demo" / f"{source}--{target}"
    assert demo_run_dir(source, target, 30) != first
    assert demo_run_dir(target, source, 60).parent.name == f"{target}--{source}"
    changed = dataclasses.replace(TINY_MODELS[target], steps=TINY_MODELS[target].steps + 1)
    monkeypatch.setitem(TINY_MODELS, target, changed)
    assert demo_run_dir(source, target, 60) != first
