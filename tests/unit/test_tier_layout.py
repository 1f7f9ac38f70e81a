"""The test tiers live side by side without packages, so pytest imports each test module by its basename: a name
used in both tiers makes the README's test command stop at collection."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_names_are_unique_across_tiers():
    tiers = {tier: {p.name for p in (TESTS / tier).glob("test_*.py")} for tier in ("unit", "integration", "serving")}
    assert all(tiers.values())
    for a, b in (("unit", "integration"), ("unit", "serving"), ("integration", "serving")):
        assert not tiers[a] & tiers[b], f"rename one of each: {sorted(tiers[a] & tiers[b])}"
