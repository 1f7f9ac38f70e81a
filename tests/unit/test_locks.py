"""Inter-process locks (infra.locks) and the first opening of a new sqlite tracking store by two processes."""

import os
import subprocess
import sys
import time
from pathlib import Path

from infra.locks import file_lock, lock_path

REPO = Path(__file__).resolve().parents[2]


def python(code: str, home: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"KVLINGO_HOME": str(home)}
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_second_process_waits_for_the_lock_and_says_so(kvlingo_home):
    path = lock_path("cell-" + "ab" * 32)
    assert path == kvlingo_home / "locks" / f"cell-{'ab' * 32}.lock"
    code = ("import time; from infra.locks import named_lock\n"
            f"with named_lock('cell-{'ab' * 32}', 'cell X'): print(time.time())")
    with file_lock(path, "the test"):
        waiter = python(code, kvlingo_home)
        time.sleep(3)
        assert waiter.poll() is None  # still blocked
        released = time.time()
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    assert float(out) >= released
    assert "waiting for another kvlingo process: cell X" in err


def test_names_that_are_not_plain_are_hashed(kvlingo_home):
    path = lock_path("stage1-/models/a--/models/b")
    assert path.parent == kvlingo_home / "locks" and len(path.stem) == 64 and "/" not in path.name


def test_two_processes_opening_a_new_tracking_store_at_once_both_succeed(kvlingo_home):
    # Without the lock one of them fails in MLflow's table creation ("duplicate column name" or
    # "table experiments already exists").
    start = time.time() + 8  # both import mlflow first, then open the store at the same moment
    code = ("import time; from registry.tracking import tracking_client\n"
            f"time.sleep(max(0, {start} - time.time()))\n"
            "client = tracking_client(); print(len(client.search_experiments()), len(client.search_registered_models()))")
    processes = [python(code, kvlingo_home) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in processes]
    for process, (out, err) in zip(processes, results):
        assert process.returncode == 0, err[-3000:]
        assert out.split() == ["1", "0"]  # the Default experiment, no registered models
