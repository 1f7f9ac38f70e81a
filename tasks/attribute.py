"""`kvlingo attribute`: where a fitted translator's remaining KL sits, on the fit's own validation conversations.

Rebuilds the fit's split from the config.yaml the fit saved, checks it against the fit's data manifest (the data
must not have changed since), loads the artifact for the pair and runs `translators.attribution.layer_attribution`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from infra.config import FitConfig, load_config
from translators.errors import ConfigError

STAGES = ("closed_form", "distilled")


def check_fit_dir(fit_dir: Path, stage: str) -> FitConfig:
    """The fit's saved config, after checking that the directory holds what attribution reads (no model loads).

    Raises:
        ConfigError: an unknown stage, or a directory without config.yaml, data_manifest.json or the stage's
            artifact (every missing file named at once).
    """
    if stage not in STAGES:
        raise ConfigError(f"unknown stage {stage!r}: choose from {', '.join(STAGES)}")
    missing = [name for name in ("config.yaml", "data_manifest.json", f"{stage}/manifest.json")
               if not (fit_dir / name).is_file()]
    if missing:
        hint = " (a --stage1-only fit has closed_form only)" if stage == "distilled" else ""
        raise ConfigError(f"{fit_dir} is not a finished fit directory of `kvlingo fit`: missing "
                          f"{', '.join(missing)}{hint}")
    return load_config(FitConfig, fit_dir / "config.yaml", {})


def attribute_fit(fit_dir: Path, stage: str = "distilled", loader=None) -> dict[str, Any]:
    """Per target layer and cache object of the fit's `stage` translator: the validation KL with that object
    native, on the fit's validation conversations.

    Returns:
        {"source", "target", "stage", "fit_dir", "n_val", "translated": {mean, se, first_token, n},
         "rows": [{layer, objects, kl, removed, removed_se, share}], "wall_s"}.
    Raises:
        ConfigError: see `check_fit_dir`; a hybrid (linear-attention) pair (not supported: its caches mix
            translated objects with states); data that no longer gives the fit's split.
        PairMismatchError, ArtifactError: the artifact does not belong to the pair (`infra.pairs.load_for_pair`).
    """
    from infra.pairs import load_for_pair, same_tokenizer
    from infra.zoo import load_model
    from tasks.fit import fit_split, model_inputs
    from translators.attribution import cross_layer_attribution, layer_attribution
    from translators.layout import is_hybrid
    from translators.stage1 import Side

    started = time.perf_counter()
    config = check_fit_dir(fit_dir, stage)
    loader = loader or load_model
    source, target = loader(config.source), loader(config.target)
    if is_hybrid(source.layout) or is_hybrid(target.layout):
        raise ConfigError(f"{source.name} → {target.name} has linear-attention layers: layer attribution covers "
                          "per-token caches (GQA, MLA, DSA) only")
    _, _, val, manifest = fit_split(config, source, target)
    saved = json.loads((fit_dir / "data_manifest.json").read_text())
    if saved.get("manifest_sha256") != manifest["manifest_sha256"]:
        raise ConfigError(f"the data of {config.data!r} no longer gives the split {fit_dir} was fitted on (data "
                          "manifest differs): attribute a fresh fit")
    translator = load_for_pair(fit_dir / stage, source, target)
    sides = Side(source.model, source.layout), Side(target.model, target.layout)
    if same_tokenizer(source, target):
        translated, rows = layer_attribution(*sides, model_inputs(val), translator)
    else:  # the target's own objects are read at the aligned target positions (App. K)
        translated, rows = cross_layer_attribution(*sides, val, translator)
    return {"source": source.name, "target": target.name, "stage": stage, "fit_dir": str(fit_dir), "n_val": len(val),
            "translated": translated.summary(), "rows": [r.row(translated.mean) for r in rows],
            "wall_s": round(time.perf_counter() - started, 1)}
