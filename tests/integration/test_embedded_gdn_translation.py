"""Closed-form translation between the embedded GDN hybrids, both directions (paper 004 Pair B setting):
same state geometry, so states are copied, or copied and corrected by the closed-form bilinear map."""

from __future__ import annotations

import pytest

from infra.hybrid_fit import fit_report

pytestmark = pytest.mark.integration

PAIRS = [("kvlingo-tiny-l-gdn", "kvlingo-tiny-s-gdn"), ("kvlingo-tiny-s-gdn", "kvlingo-tiny-l-gdn")]


@pytest.fixture(scope="module", params=PAIRS, ids=lambda pair: "->".join(pair))
def report(request):
    source, target = request.param
    return fit_report(source, target, n_fit=200, n_val=120, recompute=(1,))


def test_copied_states_beat_zero_states_and_the_empty_prefix(report):
    kl = {key: row["mean"] for key, row in report["val_kl"].items()}
    assert kl["copy"] < 0.3 * kl["zero"] and kl["copy_corrected"] < 0.3 * kl["zero"], kl
    assert kl["zero"] < kl["empty_prefix"], kl


def test_replay_from_the_sources_attention_layers_carries_the_prompt(report):
    """Replay reads only the source hybrid's attention K/V (its layers 4-5, or 3) and runs the target's own
    mixers. Measured (session 12): 0.276 l -> s, 0.190 s -> l, against zero 1.513 / 1.818."""
    kl = {key: row["mean"] for key, row in report["val_kl"].items()}
    assert kl["replay"] < 0.3 * kl["zero"], kl
    assert all(fit["r2"] > 0.6 for fit in report["replay_r2_heldout"]), report["replay_r2_heldout"]


def test_correction_fits_the_target_states_better_than_plain_copy(report):
    for fit in report["state_fit_heldout"]:  # held-out relative error of each corrected layer's state and window
        assert fit["state_corrected"] < 0.5 * fit["state_copy"], fit
        assert fit["conv_corrected"] < 0.5 * fit["conv_copy"], fit


def test_copy_plus_correction_never_loses_to_plain_copy_beyond_paired_noise(report):
    """At the default state ridge (1.0: the correction shrunk hard towards copy). Measured in session 21 with 300
    validation conversations: 0.214 -> 0.181 l -> s and 0.184 -> 0.142 s -> l (paired gains 2.7-2.8 standard errors),
    where the old ridge 1e-3 lost s -> l (0.197). Whether it gains beyond noise depends on the build: on session 33's
    machine s -> l went 0.1538 -> 0.1588 on these 120 conversations. So each direction is held to "not worse than
    plain copy by more than two paired standard errors"."""
    assert report["ridge_state"] == 1.0
    delta = report["corrected_minus_copy"]  # per-conversation KL(copy_corrected) - KL(copy), summarised
    assert delta["n"] == report["n_val"]
    assert delta["mean"] < 2 * delta["se"], (delta, report["val_kl"]["copy"], report["val_kl"]["copy_corrected"])


def test_per_layer_selection_keeps_a_correction_exactly_where_it_lowered_the_selection_kl(report):
    """The greedy selection on the 40 selection conversations: its KL never rises from plain copy's, and it falls
    exactly at the layers that keep a correction (at half or full strength). On validation the choice can go
    either way (session 14's build kept layer 3 of s -> l whole: 0.149 against copy's 0.132, within copy's standard
    error of 0.04), so validation is only checked where nothing was kept."""
    selection = report["correction_selection"]
    layers = sorted(selection, key=int)
    scores = [report["selection_copy_kl"]] + [selection[t]["kl"] for t in layers]
    assert all(b <= a for a, b in zip(scores, scores[1:])), scores
    dropped = {t for t, a, b in zip(layers, scores, scores[1:]) if b < a}
    kept = {str(t) for t, strategy in report["selected_strategies"].items() if strategy == "copy_corrected"}
    assert kept == dropped == {t for t in layers if selection[t]["strength"] > 0}, (kept, selection)
    assert all(selection[t]["strength"] in (0.0, 0.5, 1.0) for t in layers), selection
    kl = {key: row["mean"] for key, row in report["val_kl"].items()}
    if not kept:
        assert kl["selected"] == kl["copy"], kl


def test_attention_maps_explain_most_of_the_target_kv(report):
    for fit in report["kv_r2_heldout"]:
        assert fit["r2"]["keys"] > 0.5 and fit["r2"]["values"] > 0.5, fit


def test_the_partial_recompute_baseline_reports_its_compute_and_carries_the_prompt(report):
    """DroidSpeak-style: the target recomputes its first layer (a GDN layer) and reads copied objects above it.
    Measured: 0.249 (25% of prefill) l -> s against copy 0.248, 0.131 (16%) s -> l against copy 0.151; deeper
    recompute was worse in both directions (README)."""
    (row,) = report["partial_recompute"]
    kl = {key: value["mean"] for key, value in report["val_kl"].items()}
    assert row["layers"] == 1 and 0.1 < row["compute_fraction"] < 0.3, row
    assert row["val_kl"]["mean"] < 0.3 * kl["zero"], (row, kl)
