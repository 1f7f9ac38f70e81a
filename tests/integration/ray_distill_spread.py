"""Measure the spread behind test_ray_distill's exactness: N runs of each stage-2 path, max |Δ| within and between.

Usage: .venv/bin/python tests/integration/ray_distill_spread.py [N]   (prints one JSON line)
"""

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/ for tiny_configs and conftest's settings

from infra.settings import apply_offline_defaults  # noqa: E402

apply_offline_defaults()

import torch  # noqa: E402
from test_ray_distill import run_both_paths  # noqa: E402


def max_abs(a, b) -> float:
    return max(float((a.maps[n] - b.maps[n]).abs().max()) for n in a.maps)


def main(n: int) -> None:
    singles, rays = [], []
    for i in range(n):
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["KVLINGO_HOME"] = str(Path(tmp) / "home")
            (s, h1), (r, h2) = run_both_paths(Path(tmp))
            singles.append((s, [x["train_kl"] for x in h1]))
            rays.append((r, [x["train_kl"] for x in h2]))
            print(json.dumps({"run": i, "single_vs_ray_maps": max_abs(s, r)}), flush=True)
    ref_s, ref_r = singles[0], rays[0]
    print(json.dumps({
        "runs": n,
        "single_vs_single_maps": max(max_abs(ref_s[0], s) for s, _ in singles),
        "ray_vs_ray_maps": max(max_abs(ref_r[0], r) for r, _ in rays),
        "single_vs_ray_maps": max(max_abs(s, r) for (s, _), (r, _) in zip(singles, rays)),
        "single_vs_ray_train_kl": max(abs(a - b) for (_, ka), (_, kb) in zip(singles, rays) for a, b in zip(ka, kb)),
    }))


if __name__ == "__main__":
    torch.manual_seed(0)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
