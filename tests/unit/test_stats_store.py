"""The stage-1 statistics store: usage, pruning by last read and by size, temporary leftovers, the CLI."""

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tasks.stats_store import STALE_TMP_S, mark_used, prune_store, store_entries, store_usage
from translators.errors import ConfigError

DAY = 86400.0
NOW = 1_800_000_000.0
runner = CliRunner()


def make_entry(root: Path, name: str, size: int, days_ago: float, now: float = NOW) -> Path:
    """A store directory holding `size` bytes, last read `days_ago` days before `now`."""
    path = root / name
    path.mkdir(parents=True)
    (path / "keys.safetensors").write_bytes(b"k" * (size // 2))
    (path / "values.safetensors").write_bytes(b"v" * (size - size // 2))
    stamp = now - days_ago * DAY
    os.utime(path, (stamp, stamp))
    return path


@pytest.fixture
def store(tmp_path) -> Path:
    root = tmp_path / "stats"
    make_entry(root, "aaa", 400, days_ago=30)  # oldest read
    make_entry(root, "bbb", 300, days_ago=10)
    make_entry(root, "ccc", 200, days_ago=2)
    make_entry(root, "ddd", 100, days_ago=0.1)  # newest read
    return root


def test_entries_are_listed_least_recently_read_first_with_their_sizes(store):
    entries = store_entries(store)
    assert [e.path.name for e in entries] == ["aaa", "bbb", "ccc", "ddd"]
    assert [e.bytes for e in entries] == [400, 300, 200, 100]
    assert store_usage(store) | {"root": None} == {"root": None, "entries": 4, "bytes": 1000, "tmp_entries": 0,
                                                   "oldest_use": NOW - 30 * DAY, "newest_use": NOW - 0.1 * DAY}


def test_a_missing_store_is_empty(tmp_path):
    assert store_entries(tmp_path / "nowhere") == []
    assert store_usage(tmp_path / "nowhere")["entries"] == 0


def test_prune_by_last_read_removes_only_the_entries_unread_for_longer(store):
    result = prune_store(store, unused_days=5, now=NOW)
    assert result["removed"] == ["aaa", "bbb"]
    assert (result["freed_bytes"], result["kept"], result["kept_bytes"]) == (700, 2, 300)
    assert sorted(p.name for p in store.iterdir()) == ["ccc", "ddd"]


def test_prune_by_size_removes_the_least_recently_read_until_the_rest_fits(store):
    result = prune_store(store, max_gb=450 / 1e9, now=NOW)
    # 1000 bytes → remove aaa (600 left) → remove bbb (300 left ≤ 450): the two most recently read stay.
    assert result["removed"] == ["aaa", "bbb"]
    assert sorted(p.name for p in store.iterdir()) == ["ccc", "ddd"]
    assert prune_store(store, max_gb=0, now=NOW)["removed"] == ["ccc", "ddd"]
    assert list(store.iterdir()) == []


def test_both_limits_together_and_a_dry_run_that_removes_nothing(store):
    before = sorted(p.name for p in store.iterdir())
    result = prune_store(store, unused_days=20, max_gb=250 / 1e9, dry_run=True, now=NOW)
    assert result["removed"] == ["aaa", "bbb", "ccc"] and result["dry_run"]  # aaa by age, then bbb, ccc by size
    assert (result["freed_bytes"], result["kept_bytes"]) == (900, 100)
    assert sorted(p.name for p in store.iterdir()) == before


def test_reading_an_entry_marks_it_as_used_so_size_pruning_keeps_it(tmp_path):
    now = time.time()
    for name, days_ago in (("aaa", 30), ("bbb", 10), ("ccc", 2)):
        make_entry(tmp_path, name, 100, days_ago=days_ago, now=now)
    mark_used(tmp_path / "aaa")  # a fit read the oldest entry just now
    result = prune_store(tmp_path, max_gb=150 / 1e9)
    assert result["removed"] == ["bbb", "ccc"]
    assert [p.name for p in tmp_path.iterdir()] == ["aaa"]


def test_temporary_directories_go_only_once_stale(store):
    make_entry(store, "eee.123-456.tmp", 50, days_ago=STALE_TMP_S / DAY + 1)  # left by a killed fit
    make_entry(store, "fff.789-1.tmp", 50, days_ago=0.01)  # a fit writing it now
    assert store_usage(store)["tmp_entries"] == 2
    result = prune_store(store, unused_days=100, now=NOW)
    assert result["removed"] == ["eee.123-456.tmp"]
    assert (store / "fff.789-1.tmp").is_dir()


def test_prune_without_a_limit_or_with_negative_ones_reports_every_problem(store):
    with pytest.raises(ConfigError, match="say what to keep: --max-gb"):
        prune_store(store)
    with pytest.raises(ConfigError) as err:
        prune_store(store, max_gb=-1, unused_days=-2)
    assert "--max-gb must be ≥ 0, got -1" in str(err.value) and "--unused-days must be ≥ 0, got -2" in str(err.value)
    assert len(list(store.iterdir())) == 4


def test_cli_show_and_prune(tmp_path, monkeypatch):
    root = tmp_path / "home" / "stats"
    now = time.time()
    make_entry(root, "old", 300, days_ago=30, now=now)
    make_entry(root, "new", 100, days_ago=1, now=now)
    monkeypatch.setenv("KVLINGO_HOME", str(root.parent))
    shown = runner.invoke(app, ["stats-store", "show", "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout) | {"oldest_use": None, "newest_use": None} == {
        "root": str(root), "entries": 2, "bytes": 400, "tmp_entries": 0, "oldest_use": None, "newest_use": None}
    refused = runner.invoke(app, ["stats-store", "prune"])
    assert refused.exit_code == 2 and "say what to keep" in refused.output
    pruned = runner.invoke(app, ["stats-store", "prune", "--unused-days", "5", "--json"])
    assert pruned.exit_code == 0, pruned.output
    assert json.loads(pruned.stdout)["removed"] == ["old"]
    emptied = runner.invoke(app, ["stats-store", "prune", "--max-gb", "0"])
    assert emptied.exit_code == 0 and "removed 1 shard(s)" in emptied.output
    assert list(root.iterdir()) == []
