"""A stand-in builder for `test_embedded_build`: stdlib only, so that spawned workers start at once."""

from __future__ import annotations

import json
import time
from pathlib import Path


def stub_builder(name: str, home: str | None) -> tuple[str, bool]:
    """Records when each build ran; fails for the names listed in HOME/fail; cached for HOME/cached."""
    root = Path(home)
    start = time.time()
    if name in (root / "fail").read_text().split():
        raise RuntimeError(f"stub failure in {name}")
    if name in (root / "cached").read_text().split():
        return str(root / name), False
    time.sleep(1.0)
    (root / f"{name}.json").write_text(json.dumps({"start": start, "end": time.time()}))
    return str(root / name), True
