"""`kvlingo fit`, `kvlingo bench multiturn` and `kvlingo eval` on the embedded GDN hybrids, both directions (issue
#16): the fit chooses its closed form among the state strategies, stage 2 improves on it, segment-wise hand-offs
keep recall near re-prefill while each span is translated once, and the evaluation reads the fits' artifacts.

The fits read token identity (`token_identity: ids`), the recipe the README gives for hybrid hand-offs: a GDN
model caches per-token objects only in its attention layers, and the target's embedding of each id is what lifts
segment-wise recall to within 0.1 of re-prefill (README, multi-turn hand-off between hybrids)."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app

pytestmark = pytest.mark.integration

runner = CliRunner()
PAIR = ("kvlingo-tiny-l-gdn", "kvlingo-tiny-s-gdn")
# A smaller run than `kvlingo fit`'s defaults (3200 / 600 / 400 steps; README), to keep the tier short.
CONFIG = {"data": "embedded:760", "n_train": 700, "stats_samples": 300, "n_val": 60, "n_select": 40, "steps": 200,
          "batch": 4, "eval_every": 40, "lr": 1e-3, "token_identity": "ids"}


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_cli")
    config = root / "fit.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    out = {}
    for source, target in (PAIR, PAIR[::-1]):
        result = runner.invoke(app, ["fit", source, target, "--config", str(config), "--output-dir",
                                     str(root / f"{source}--{target}"), "--json"])
        assert result.exit_code == 0, result.output
        out[(source, target)] = (root / f"{source}--{target}", json.loads(result.stdout))
    return out


def test_distilled_beats_the_closed_form_zero_states_and_both_controls(fits):
    """Measured with the defaults (session 12): l -> s closed form (copy) 0.248, distilled 0.164, zero 1.420,
    empty prefix 3.646, random map 3.972."""
    gains = []
    for (source, target), (fit_dir, summary) in fits.items():
        kl = summary["val_kl"]
        manifest = json.loads((fit_dir / "distilled" / "manifest.json").read_text())
        assert manifest["token_identity"] == "ids", manifest.get("token_identity")
        # Any strategy the pair admits but the zero state (copy + correction won s -> l on session 21's build).
        assert summary["hybrid"] and summary["closed_form_strategy"] in set(summary["strategies"]) - {"zero"}, summary
        assert kl["closed_form"] < 0.3 * kl["zero"], (source, kl)
        assert kl["distilled"] < 0.1 * min(kl["empty_prefix"], kl["random_map"]), (source, kl)
        # The returned checkpoint is the last step, or an earlier one (the closed form, step 0, included) that is
        # lower on the selection conversations (by two paired SEs: translators.checkpoint_selection).
        selection, chosen = summary["stage2"]["selection_kl"], str(summary["stage2"]["selected_step"])
        last = max(selection, key=int)
        assert chosen == last or selection[chosen] < selection[last], summary["stage2"]
        gains.append(kl["closed_form"] - kl["distilled"])
    assert max(gains) > 0, gains  # stage 2 moved at least one direction below its closed form


def test_segment_hand_offs_stay_near_re_prefill_and_translate_each_span_once(fits):
    (dir_ab, _), (dir_ba, _) = fits[PAIR], fits[PAIR[::-1]]
    result = runner.invoke(app, ["bench", "multiturn", *PAIR, "--fit-dir-ab", str(dir_ab), "--fit-dir-ba",
                                 str(dir_ba), "--conversations", "32", "--turns", "8", "--json"])
    assert result.exit_code == 0, result.output
    modes = json.loads(result.stdout)["modes"]
    assert modes["segment"]["max_times_a_span_was_translated"] == 1
    assert modes["naive"]["max_times_a_span_was_translated"] > 1
    # Measured with these fits (session 22): 32 conversations reprefill 0.883, segment 0.805, naive 0.359; 64
    # conversations 0.875 / 0.783 / 0.352. Without token identity the gap was 0.12-0.13 (README). The bound leaves
    # 0.04 over the 32-conversation gap for builds whose fp32 rounding differs (one answer is 1/256 of the mean).
    assert modes["segment"]["mean"] >= modes["reprefill"]["mean"] - 0.12, modes
    assert modes["naive"]["mean"] < modes["segment"]["mean"] - 0.2, modes


def test_kvlingo_eval_recalls_through_the_hybrid_translators(fits):
    """`kvlingo eval` on each fit (60 held-out recall items): the translated caches carry the facts the empty
    prefix cannot, near the target's own prefill. Measured with these fits (session 23): l -> s target 0.967,
    closed form 0.833, distilled 0.833, empty prefix 0.0; s -> l target 1.0, closed form 0.833, distilled 0.867,
    empty 0.0 (the default-recipe fits: 0.867 and 0.900, README)."""
    for (source, target), (fit_dir, _) in fits.items():
        result = runner.invoke(app, ["eval", source, target, "--fit-dir", str(fit_dir), "--benchmark", "recall",
                                     "--limit", "60", "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        recall = {row["condition"]: row["score"] for row in report["rows"]}
        assert report["errors"] == [] and {row["n"] for row in report["rows"]} == {60}, report
        assert recall["distilled"] > recall["empty_prefix"] + 0.5, (source, recall)
        assert recall["distilled"] >= recall["target_native"] - 0.3, (source, recall)
