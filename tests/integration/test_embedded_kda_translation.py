"""MLA <-> Kimi-Linear hybrid translation on the embedded models (issue #16 item 4, the paper's Pair A): into
kvlingo-tiny-kda its NoPE MLA layer reads latent maps and its KDA layers are replayed, every map also reading the
target's embedding of each token decoded by the source's codebook; out of it, the MLA target's latents come from
the hybrid's one attention layer, with the token ids given."""

from __future__ import annotations

import pytest

from infra.hybrid_fit import fit_report

pytestmark = pytest.mark.integration

PAIRS = [("kvlingo-tiny-l-mla", "kvlingo-tiny-kda", "codebook"), ("kvlingo-tiny-kda", "kvlingo-tiny-l-mla", "ids")]


@pytest.fixture(scope="module", params=PAIRS, ids=lambda pair: "->".join(pair[:2]))
def report(request):
    source, target, token_identity = request.param
    return fit_report(source, target, n_fit=120, n_val=30, distill_steps=60, distill_lr=1e-3, recall=30,
                      token_identity=token_identity)


def _kl(report) -> dict[str, float]:
    return {key: row["mean"] for key, row in report["val_kl"].items()}


def test_distilled_beats_the_zero_state_and_both_controls(report):
    """Measured (session 23's build, this fixture): l-mla -> kda zero 2.325, replay 0.146, distilled 0.169 (step 48
    of 60 chosen on 24 held-out fit conversations, 0.162 -> 0.154 there), empty 3.422, random 4.412. Distilled
    minus replay per validation conversation: +0.023 with a standard error of 0.020: stage 2 on 96 conversations
    moves the translator by less than 30 validation conversations can resolve, so the check is that it does not end
    significantly above its start (an earlier build: replay 0.310, distilled 0.302)."""
    kl = _kl(report)
    assert kl["distilled"] < min(kl["empty_prefix"], kl["random_map"]) / 4, kl
    assert kl["distilled"] < kl.get("zero", float("inf")) / 3, kl
    delta = report["distilled_minus_start"]
    assert delta["n"] == report["n_val"] and delta["mean"] <= 2 * delta["se"], (delta, kl)


def test_replay_and_latent_maps_explain_the_targets_objects(report):
    if report["target"] == "kvlingo-tiny-kda":
        assert report["strategies"] == ["zero", "replay"]
        assert all(fit["r2"] > 0.85 for fit in report["replay_r2_heldout"]), report["replay_r2_heldout"]
    for fit in report["kv_r2_heldout"]:
        assert fit["r2"]["latent"] > 0.7 and fit["r2"]["rope_key"] > 0.6, fit


def test_the_translated_cache_recalls_what_the_zero_state_cannot(report):
    """Measured (60 items): l-mla -> kda target 0.917, zero 0.100, replay 0.733, distilled 0.800; kda -> l-mla
    target 0.983, translated 0.667, distilled 0.767; empty prefix 0.0 both ways."""
    recall = {key: row["score"] for key, row in report["recall"].items()}
    assert recall["distilled"] >= recall["target_native"] - 0.4, recall
    assert recall["distilled"] > max(recall["empty_prefix"], recall.get("zero", 0.0)) + 0.4, recall
