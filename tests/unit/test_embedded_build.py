"""`infra.embedded`: the embedded lineage, and building it in dependency order on several processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from infra.zoo import ZOO
from infra.embedded import build_embedded, embedded_names, embedded_parents, with_ancestors
from translators.errors import ConfigError

from embedded_build_stub import stub_builder

runner = CliRunner()


def test_the_lineage_is_the_one_the_builds_follow():
    assert embedded_parents("kvlingo-tiny-s") == ()
    assert embedded_parents("kvlingo-tiny-l") == ("kvlingo-tiny-s",)
    assert embedded_parents("kvlingo-tiny-l-gdn") == ("kvlingo-tiny-l", "kvlingo-tiny-s-gdn")
    assert embedded_parents("kvlingo-tiny-s-dsa") == ("kvlingo-tiny-s-mla",)
    assert embedded_parents("kvlingo-tiny-kda") == ("kvlingo-tiny-s-mla",)
    assert with_ancestors(["kvlingo-tiny-kda"]) == ["kvlingo-tiny-s", "kvlingo-tiny-s-mla", "kvlingo-tiny-kda"]
    order = with_ancestors(["kvlingo-tiny-l-gdn", "kvlingo-tiny-s-dsa"])
    assert set(order) == {"kvlingo-tiny-s", "kvlingo-tiny-l", "kvlingo-tiny-s-gdn", "kvlingo-tiny-l-gdn",
                          "kvlingo-tiny-s-mla", "kvlingo-tiny-s-dsa"}
    for name in order:  # parents first
        assert all(order.index(p) < order.index(name) for p in embedded_parents(name))
    everything = embedded_names()
    assert len(everything) == len(set(everything))
    assert set(everything) == {spec.location for spec in ZOO.values() if spec.source == "embedded"}
    assert all(everything.index(p) < everything.index(n) for n in everything for p in embedded_parents(n))


def test_unknown_names_are_all_reported_with_the_nearest_one():
    with pytest.raises(ConfigError) as err:
        with_ancestors(["kvlingo-tiny-s-gdm", "kvlingo-tiny-l", "nonsense-model"])
    message = str(err.value)
    assert "'kvlingo-tiny-s-gdm' (did you mean 'kvlingo-tiny-s-gdn'?)" in message
    assert "'nonsense-model'" in message and "'kvlingo-tiny-l'," not in message.split("Embedded models")[0]
    with pytest.raises(ConfigError, match="jobs must be at least 1"):
        build_embedded(["kvlingo-tiny-s"], jobs=0)


def _run_stub(tmp_path: Path, names, *, jobs: int, fail=(), cached=()):
    (tmp_path / "fail").write_text(" ".join(fail))
    (tmp_path / "cached").write_text(" ".join(cached))
    outcomes = build_embedded(names, jobs=jobs, home=tmp_path, builder=stub_builder)
    spans = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    return {o.name: o for o in outcomes}, spans


def test_a_model_starts_only_after_its_parents_and_independent_lineages_overlap(tmp_path):
    outcomes, spans = _run_stub(tmp_path, ["kvlingo-tiny-l-gdn", "kvlingo-tiny-kda"], jobs=2,
                                cached=["kvlingo-tiny-s"])
    assert outcomes["kvlingo-tiny-s"].status == "cached" and outcomes["kvlingo-tiny-s"].seconds == 0.0
    built = ["kvlingo-tiny-l", "kvlingo-tiny-s-gdn", "kvlingo-tiny-l-gdn", "kvlingo-tiny-s-mla", "kvlingo-tiny-kda"]
    assert all(outcomes[n].status == "built" for n in built)
    # A model's seconds are its own build's, not its wait for a free worker (five builds queued on two workers).
    assert all(abs(outcomes[n].seconds - (spans[n]["end"] - spans[n]["start"])) < 0.3 for n in built)
    for name in built:
        for parent in embedded_parents(name):
            if parent in spans:
                assert spans[parent]["end"] <= spans[name]["start"], (parent, name)
    # Two workers: some pair of builds ran at the same time.
    assert any(spans[a]["start"] < spans[b]["end"] and spans[b]["start"] < spans[a]["end"]
               for a in built for b in built if a < b)


def test_a_failed_build_skips_its_descendants_and_the_other_lineage_finishes(tmp_path):
    outcomes, spans = _run_stub(tmp_path, ["kvlingo-tiny-l-gdn", "kvlingo-tiny-kda", "kvlingo-tiny-s-dsa"], jobs=2,
                                fail=["kvlingo-tiny-s-mla"])
    assert outcomes["kvlingo-tiny-s-mla"].status == "failed"
    assert "stub failure in kvlingo-tiny-s-mla" in outcomes["kvlingo-tiny-s-mla"].error
    assert outcomes["kvlingo-tiny-kda"].status == outcomes["kvlingo-tiny-s-dsa"].status == "skipped"
    assert outcomes["kvlingo-tiny-kda"].error == "not built: its parent kvlingo-tiny-s-mla was not"
    assert {"kvlingo-tiny-s", "kvlingo-tiny-l", "kvlingo-tiny-s-gdn", "kvlingo-tiny-l-gdn"} == set(spans)


def test_build_command_refuses_unknown_names_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLINGO_HOME", str(tmp_path))
    result = runner.invoke(app, ["build", "kvlingo-tiny-kdaa", "--jobs", "1"])
    assert result.exit_code == 2
    assert "did you mean 'kvlingo-tiny-kda'?" in result.output
    assert not (tmp_path / "models").exists()
