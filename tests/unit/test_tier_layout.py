"""The test tiers live side by side without packages, so pytest imports each test module by its basename: a name
used in both tiers makes the README's test command stop at collection."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_names_are_unique_across_tiers():
    unit = {p.name for p in (TESTS / "unit").glob("test_*.py")}
    integration = {p.name for p in (TESTS / "integration").glob("test_*.py")}
    assert unit and integration
    assert not unit & integration, f"rename one of each: {sorted(unit & integration)}"
