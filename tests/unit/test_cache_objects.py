"""Cache-object adapters: the GQA pair's widths, its capture → engine-cache round trip on every family, and an
extra object kind flowing through statistics, solve, translator and artifacts without code changes elsewhere."""

import dataclasses

import pytest
import torch
from tiny_configs import FAMILIES, tiny_model

from translators.artifact import load_translator, save_translator
from translators.capture import capture
from translators.errors import ConfigError, UnsupportedModelError
from translators.gram import GramStats
from translators.inject import decode_step, write_cache
from translators.layout import cache_layout
from translators.objects import GQA, KEYS, VALUES, cache_objects, engine_tensor, object_names, object_width
from translators.points import CAPTURE_POINTS
from translators.roundtrip import native_next_logits
from translators.stage1 import (
    Side,
    accumulate_pair,
    assign_layers,
    candidate_layers,
    empty_stats,
    heldout_r2,
    solve_translator,
)
from translators.translator import Translator

N_TOKENS = 20  # longer than the tiny Gemma window (6)


def prompt(seed=0, n=N_TOKENS):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    model = tiny_model(request.param)
    return model, cache_layout(model)


def test_gqa_objects_and_widths(family_model):
    model, layout = family_model
    assert cache_objects(layout) == GQA == (KEYS, VALUES)
    assert object_names(layout) == ("keys", "values")
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = config.num_key_value_heads * head_dim
    for obj in GQA:
        assert object_width(obj, layout) == expected == layout.kv_width
        assert all(obj.width(layer) == expected for layer in layout.layers)
    cap = capture(model, layout, prompt(n=5))
    assert set(cap.objects) == {"keys", "values"} and cap.keys is cap.objects["keys"]
    assert all(x.shape == (5, expected) for xs in cap.objects.values() for x in xs)


@pytest.mark.parametrize("point", CAPTURE_POINTS)
def test_capture_write_round_trip_matches_native_prefill(family_model, point):
    model, layout = family_model
    ids = prompt(1)
    with torch.no_grad():
        native = native_next_logits(model, ids)
        cap = capture(model, layout, ids[:-1], point)
        cache = write_cache(model, layout, cap.objects, point=point)
        stepped = decode_step(model, cache, ids[-1:])[-1]
    assert (stepped - native).abs().max() <= 1e-4


def test_engine_tensors_equal_the_engines_own_cache(family_model):
    # Independent reference: what transformers stores after a prefill, object by object.
    model, layout = family_model
    ids = prompt(2)
    with torch.no_grad():
        engine = model(input_ids=ids.view(1, -1), use_cache=True).past_key_values
        cap = capture(model, layout, ids, "pre_norm")
        for i in range(layout.n_layers):
            stored = {"keys": engine.layers[i].keys, "values": engine.layers[i].values}  # [1, H, n_kept, hd]
            for obj in GQA:
                ours = engine_tensor(obj, model, layout, i, cap.objects[obj.name][i], point="pre_norm",
                                     positions=cap.positions)
                n_kept = stored[obj.name].shape[2]
                torch.testing.assert_close(ours[..., -n_kept:, :], stored[obj.name], atol=1e-5, rtol=1e-5)


def test_write_cache_refuses_other_objects():
    model = tiny_model("llama")
    layout = cache_layout(model)
    cap = capture(model, layout, prompt(n=5))
    with pytest.raises(ConfigError, match="holds keys, values per layer, got keys"):
        write_cache(model, layout, {"keys": cap.keys}, point="pre_norm")


def test_layout_without_an_adapter_is_refused():
    layout = cache_layout(tiny_model("llama"))

    @dataclasses.dataclass(frozen=True)
    class RecurrentState:
        kind: str = "recurrent_state"

    hybrid = dataclasses.replace(layout, layers=(dataclasses.replace(layout.layers[0], objects=(RecurrentState(),)),))
    with pytest.raises(UnsupportedModelError, match="no adapter.*recurrent_state"):
        cache_objects(hybrid)


# --- An extra object kind, defined here only -------------------------------------------------------

# A copy of the values under another name: it must flow through capture, statistics, assignment, solve,
# R², the translator and artifacts with nothing else changed, and give exactly what the values give.
VALUES_AGAIN = dataclasses.replace(VALUES, name="values_again")


@pytest.fixture(scope="module")
def qwen():
    model = tiny_model("qwen3")
    return Side(model, cache_layout(model))


def test_extra_object_flows_through_stage1_and_translator(qwen, tmp_path):
    objects = cache_objects(qwen.layout) + (VALUES_AGAIN,)
    layout = qwen.layout
    cap = capture(qwen.model, layout, prompt(n=6), "pre_norm", objects)
    assert all(torch.equal(a, b) for a, b in zip(cap.objects["values_again"], cap.values))

    candidates = candidate_layers(layout, layout, "r2", 1)
    train = [(p, p[-3:]) for p in (prompt(seed, n=16) for seed in range(8))]
    stats = accumulate_pair(empty_stats(layout, layout, candidates, objects), qwen, qwen, train, "pre_norm",
                            objects=objects)
    assert list(stats) == ["keys", "values", "values_again"] and stats["values_again"].side == "values_again"
    assert all(torch.equal(stats["values_again"].xy[k], v) for k, v in stats["values"].xy.items())

    assignment = assign_layers(stats, layout, layout, "r2", 1)
    assert assignment["values_again"] == assignment["values"]
    translator = solve_translator(stats, assignment, layout, layout, "pre_norm")
    assert translator.objects == ("keys", "values", "values_again")
    for t in range(layout.n_layers):
        assert torch.equal(translator.weight("values_again", t), translator.weight("values", t))
    r2 = heldout_r2(stats, translator)
    assert r2["values_again"] == r2["values"] and min(r2["values_again"]) > 0.9999

    out = translator.translate_objects(cap.objects)
    assert all(torch.equal(a, b) for a, b in zip(out["values_again"], out["values"]))

    save_translator(translator, tmp_path / "t", source={"name": "q"}, target={"name": "q"}, fit={})
    loaded, manifest = load_translator(tmp_path / "t")
    assert sorted(manifest["assignment"]) == ["keys", "values", "values_again"]
    assert loaded.assignment == translator.assignment
    assert all(torch.equal(loaded.maps[n], p) for n, p in translator.maps.items())


def test_gram_stats_name_objects_strictly():
    # A plain name must be one an adapter defines (typo guard); an object brings its own name.
    with pytest.raises(ConfigError, match="values_again"):
        GramStats.empty("values_again", {0: (0,)}, 4, 4)
    assert GramStats.empty(VALUES_AGAIN, {0: (0,)}, 4, 4).side == "values_again"


def test_translator_orders_objects_canonically():
    band = {0: (0,), 1: (1,)}
    a = Translator({"values": band, "keys": band}, 4, 4, "pre_norm")
    b = Translator({"keys": band, "values": band}, 4, 4, "pre_norm")
    assert a.objects == b.objects == ("keys", "values") and list(a.maps) == list(b.maps)
    with pytest.raises(ConfigError, match="identifiers"):
        Translator({"keys.x": band}, 4, 4, "pre_norm")
    with pytest.raises(ConfigError, match="cover the same target layers"):
        Translator({"keys": band, "values": {0: (0,)}}, 4, 4, "pre_norm")
