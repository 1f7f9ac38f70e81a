import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny_configs.py

from infra.settings import apply_offline_defaults, stop_local_services  # noqa: E402

apply_offline_defaults()  # before torch loads: OMP_WAIT_POLICY is read once, at import

import pytest  # noqa: E402
import torch  # noqa: E402

# The README's test command runs the suite in two pytest-xdist workers (PYTEST_XDIST_WORKER set), one torch thread
# each, which fills the two cores: under OMP_WAIT_POLICY=PASSIVE a second thread in one process mostly waits to
# be woken between the many tiny kernels of these models (a GDN build step: 174 ms on one thread, 271 ms on two).
# A plain serial `pytest` keeps two threads; Ray workers and subprocesses beside the tests set their own.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))

# `--dist loadfile` keeps each test file on one worker, so its module-scoped fixtures (fits, builds) run once.
# Files of one exclusive group never run at the same time on the two workers: the Ray tests start local clusters
# and worker processes sized to the whole machine, the serving tests vLLM engines. (pytest-xdist's loadgroup would
# say this declaratively, but its 3.8 release cannot tag pytest 9's node ids and silently distributes per test.)
EXCLUSIVE_GROUPS = {
    "ray": ("tests/integration/test_ray_", "tests/integration/test_cli_tiers.py"),
    "serving": ("tests/serving/",),
}


def exclusive_group_of(path: str) -> str | None:
    """The exclusive group of the test file at `path` (relative to the repository root, "/"-separated), if any."""
    for group, prefixes in EXCLUSIVE_GROUPS.items():
        if path.startswith(prefixes):
            return group
    return None


@pytest.fixture(scope="module", autouse=True)
def _one_file_of_an_exclusive_group_at_a_time(request):
    """Hold the group's lock (a file in the temp dir, released by the kernel if the worker dies) for the module."""
    import tempfile

    from infra.locks import file_lock

    root = Path(__file__).resolve().parents[1]
    group = exclusive_group_of(Path(request.path).resolve().relative_to(root).as_posix())
    if group is None:
        yield
        return
    with file_lock(Path(tempfile.gettempdir()) / f"kvlingo-tests-{group}.lock", f"the {group} tests of the other worker"):
        yield


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
