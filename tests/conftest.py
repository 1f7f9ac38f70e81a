import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny_configs.py

from infra.settings import apply_offline_defaults, stop_local_services  # noqa: E402

apply_offline_defaults()  # before torch loads: OMP_WAIT_POLICY is read once, at import

import pytest  # noqa: E402
import torch  # noqa: E402
# Two cores: keep torch from oversubscribing when helpers or Ray workers run beside the tests.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session", autouse=True)
def _local_services_stop_with_the_session():
    """Stop Prefect's temporary server and local Ray while pytest's streams are still open (not at exit)."""
    yield
    stop_local_services()


SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The offline benchmark files. Missing: a skip on a developer's machine, a failure under CI (CI=true),
    where a silently skipped integration test would pass off as green."""
    if not SHARED_DATA.is_dir():
        message = f"offline benchmark data not found at {SHARED_DATA} (../shared/data beside the repository)"
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(message + "; CI runs the integration tier and needs it")
        pytest.skip(message)
    return SHARED_DATA


@pytest.fixture
def kvlingo_home(tmp_path, monkeypatch) -> Path:
    """An empty platform data directory for tests that write into it."""
    home = tmp_path / "kvlingo-home"
    monkeypatch.setenv("KVLINGO_HOME", str(home))
    return home
