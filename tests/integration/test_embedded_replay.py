"""GQA <-> GDN hybrid translation on the embedded models (issue #16 item 4): into the hybrid, the replay strategy
synthesises its linear layers' states by running its own mixers over inputs predicted from the GQA source's
K/V; out of the hybrid, the GQA target's K/V come from the hybrid's attention layers alone."""

from __future__ import annotations

import pytest

from infra.hybrid_fit import fit_report

pytestmark = pytest.mark.integration

PAIRS = [("kvlingo-tiny-l", "kvlingo-tiny-s-gdn"), ("kvlingo-tiny-s-gdn", "kvlingo-tiny-l")]


@pytest.fixture(scope="module", params=PAIRS, ids=lambda pair: "->".join(pair))
def report(request):
    source, target = request.param
    # 400 stage-2 steps, 120 recall items: at 150 steps and 60 items tiny-s-gdn -> tiny-l scored distilled recall
    # 0.600 here but 0.517 on CI's machine (its builds differ in fp32 rounding), a margin within one standard error
    # (0.064); the held-out selection KL ends at 0.242 after 150 steps and at 0.138 after 400.
    return fit_report(source, target, n_fit=200, n_val=60, distill_steps=400, distill_lr=3e-4, recall=120)


def _kl(report) -> dict[str, float]:
    return {key: row["mean"] for key, row in report["val_kl"].items()}


def test_distilled_beats_the_zero_state_and_both_controls(report):
    """Measured (session 18): tiny-l -> tiny-s-gdn zero 1.565, replay 0.269, distilled 0.216, empty prefix 3.809,
    random map 4.314; tiny-s-gdn -> tiny-l translated 0.623, distilled 0.257, empty 3.522, random 7.323."""
    kl = _kl(report)
    assert kl["distilled"] < min(kl["empty_prefix"], kl["random_map"]) / 4, kl
    assert kl["distilled"] < kl.get("zero", float("inf")), kl
    start = report["distilled_from"]
    assert kl["distilled"] < kl[start], kl


def test_replay_carries_the_prompt_into_the_hybrids_states(report):
    if report["target"] != "kvlingo-tiny-s-gdn":
        assert report["strategies"] == ["translated"] and report["replay_sources"] == {}
        return
    kl = _kl(report)
    assert report["strategies"] == ["zero", "replay"], report["strategies"]
    assert kl["replay"] < 0.3 * kl["zero"], kl
    assert all(fit["r2"] > 0.8 for fit in report["replay_r2_heldout"]), report["replay_r2_heldout"]


def test_the_translated_cache_recalls_what_the_zero_state_cannot(report):
    """Measured (session 18, 120 items): tiny-l -> tiny-s-gdn target 0.875, zero 0.042, replay 0.600, distilled
    0.717; tiny-s-gdn -> tiny-l target 0.958, translated 0.417, distilled 0.725, empty prefix 0.0."""
    recall = {key: row["score"] for key, row in report["recall"].items()}
    assert recall["distilled"] >= recall["target_native"] - 0.45, recall
    assert recall["distilled"] > recall["empty_prefix"] + 0.4, recall
    assert recall["distilled"] > recall.get("zero", 0.0) + 0.4, recall
