"""The engine-independent half of the vLLM connector (infra.serving): saved conversations, the model skeleton's
cache points, the served translator and the gate. The connector itself runs in the serving tier."""

import pytest
import torch
from tiny_configs import noisy_identity, save_tiny_model_dir, tiny_model

from infra.serving import (
    APPLIED,
    FALLBACK,
    UNSUPPORTED,
    ConversationStore,
    ServingError,
    check_served_config,
    gate,
    model_skeleton,
    new_conversation_key,
    serve_translator,
    translate_rows,
)
from translators.artifact import save_translator
from translators.capture import capture
from translators.errors import ConfigError, PairMismatchError
from translators.layout import cache_layout
from translators.points import apply_rope, keys_to_point


def signature(layout, name="m"):
    return {"name": name, "layout": layout.signature()}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 (per-head key norm) saved as a model directory, and the same model loaded."""
    path = save_tiny_model_dir("qwen3", tmp_path_factory.mktemp("qwen3"), seed=3)
    return path, tiny_model("qwen3", seed=3)


def test_skeleton_keys_match_the_model_and_rope_inverts(qwen3):
    path, model = qwen3
    skeleton, layout = model_skeleton(path)
    assert layout == cache_layout(model) and layout.layers[0].kv.has_k_norm
    ids = torch.arange(3, 40)
    post_norm = capture(model, layout, ids, "post_norm")
    post_rope = capture(model, layout, ids, "post_rope")
    pre_norm = capture(model, layout, ids, "pre_norm")
    for layer in range(layout.n_layers):
        # The skeleton's own k-norm and RoPE (weights read from the directory) reproduce the engine's keys.
        engine = keys_to_point(skeleton, layout, layer, pre_norm.keys[layer], start="pre_norm", end="post_rope",
                               positions=post_rope.positions)
        torch.testing.assert_close(engine, post_rope.keys[layer], atol=1e-5, rtol=1e-5)
        # Rotating the engine's keys back at their positions gives the post_norm keys.
        back = apply_rope(skeleton, layout, layer, post_rope.keys[layer], post_rope.positions, inverse=True)
        torch.testing.assert_close(back, post_norm.keys[layer], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(post_rope.keys[0], post_norm.keys[0], atol=1e-2)  # RoPE did move the keys


def test_skeleton_refuses_a_directory_without_config(tmp_path):
    with pytest.raises(ServingError, match="no config.json"):
        model_skeleton(tmp_path)


def test_conversation_store_round_trip_and_bad_keys(tmp_path):
    store = ConversationStore(tmp_path / "store")
    key = new_conversation_key()
    keys = [torch.randn(7, 8) for _ in range(2)]
    values = [torch.randn(7, 8) for _ in range(2)]
    store.save(key, keys, values, list(range(10, 17)), {"name": "src"})
    header = store.header(key)
    assert header["token_ids"] == list(range(10, 17)) and header["point"] == "post_norm"
    assert header["source"] == {"name": "src"} and header["n_layers"] == 2
    rows = store.load(key, [1], 2, 5)
    torch.testing.assert_close(rows["keys"][1], keys[1][2:5], rtol=0, atol=0)
    torch.testing.assert_close(rows["values"][1], values[1][2:5], rtol=0, atol=0)
    assert store.header(new_conversation_key()) is None
    with pytest.raises(ServingError, match="holds 7 tokens, not 9"):
        store.load(key, [0], 0, 9)
    with pytest.raises(ServingError, match="malformed conversation key '../etc'"):
        store.header("../etc")
    with pytest.raises(ServingError, match="each must hold 7 tokens"):
        store.save(key, keys, values[:1], list(range(7)), {})


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama", seed=1)
    return model, cache_layout(model)


def test_gate_statuses(llama, tmp_path):
    _, layout = llama
    sig = signature(layout)
    served = serve_translator("identity", layout, sig, max_prefix_tokens=20)
    header = {"token_ids": list(range(30)), "source": sig}
    prompt = list(range(12)) + [99, 98]
    decision = gate(served, header, prompt, "k")
    assert (decision.status, decision.n_load) == (APPLIED, 12)  # the common prefix
    assert gate(served, header, list(range(8)), "k").n_load == 7  # the prompt's last token stays with the engine
    long = gate(served, header, list(range(25)), "k")
    assert (long.status, long.n_load) == (FALLBACK, 0)
    assert "24 tokens exceeds the translator's envelope of 20 tokens" in long.reason
    missing = gate(served, None, prompt, "k")
    assert missing.status == FALLBACK and "not in the store" in missing.reason
    other = gate(served, {**header, "source": signature(layout, "other")}, prompt, "k")
    assert other.status == FALLBACK and "source.name is \"m\" in the artifact but \"other\"" in other.reason
    assert gate(served, {**header, "token_ids": [5, 6]}, prompt, "k").status == FALLBACK


def test_gate_refuses_what_cannot_be_served_exactly(qwen3, llama, tmp_path):
    _, model = qwen3
    layout = cache_layout(model)
    sig = signature(layout)
    for point, words in (("pre_norm", "normalises its keys"), ("post_rope", "post_rope are not served")):
        translator = noisy_identity(layout)
        translator.point = point
        art = save_translator(translator, tmp_path / point, source=sig, target=sig, fit={})
        served = serve_translator(str(art), layout, sig)
        decision = gate(served, {"token_ids": [1, 2, 3], "source": sig}, [1, 2, 3], "k")
        assert decision.status == UNSUPPORTED and words in decision.reason
    # A source without key norm: pre_norm is the same point as post_norm, served.
    _, llama_layout = llama
    lsig = signature(llama_layout)
    art = save_translator(noisy_identity(llama_layout), tmp_path / "llama", source=lsig, target=lsig,
                          fit={"config": {"max_prefix_tokens": 64}})
    served = serve_translator(str(art), llama_layout, lsig, max_prefix_tokens=100)
    assert served.envelope == 64 and served.identity != "identity"
    assert gate(served, {"token_ids": [1, 2, 3], "source": lsig}, [1, 2, 3], "k").status == APPLIED
    with pytest.raises(PairMismatchError, match="target"):
        serve_translator(str(art), llama_layout, signature(llama_layout, "another"))
    with pytest.raises(ServingError, match="resolve registry references"):
        serve_translator("models:/pair@champion", llama_layout, lsig)
    with pytest.raises(ServingError, match="neither 'identity' nor an artifact"):
        serve_translator(str(tmp_path / "nope"), llama_layout, lsig)


def test_translate_rows_writes_the_engine_keys(llama):
    model, layout = llama
    served = serve_translator("identity", layout, signature(layout))
    ids = torch.arange(5, 30)
    post_norm = capture(model, layout, ids, "post_norm")
    post_rope = capture(model, layout, ids, "post_rope")
    rows = {"keys": dict(enumerate(k[4:9] for k in post_norm.keys)),
            "values": dict(enumerate(v[4:9] for v in post_norm.values))}
    keys, values = translate_rows(served, rows, model, layout, torch.arange(4, 9))
    for layer in range(layout.n_layers):
        torch.testing.assert_close(keys[layer], post_rope.keys[layer][4:9], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[layer], post_rope.values[layer][4:9], rtol=0, atol=0)


def test_connector_settings_report_every_problem():
    with pytest.raises(ConfigError) as err:
        check_served_config({"model_signature": "x", "speed": 1}, consumer=True)
    message = str(err.value)
    for part in ("store:", "model_signature:", "translator:", "unknown settings ['speed']"):
        assert part in message
    assert check_served_config({"store": "/s", "model_signature": {}}, consumer=False)


def test_plan_servers_checks_the_pair_before_any_engine(tmp_path):
    from tasks.serve import plan_servers

    llama = save_tiny_model_dir("llama", tmp_path / "llama", seed=1)
    qwen = save_tiny_model_dir("qwen3", tmp_path / "qwen3", seed=1)
    with pytest.raises(PairMismatchError, match="--translator identity serves a model's cache to the same model"):
        plan_servers(str(llama), str(qwen), "identity", store=tmp_path / "store")
    producer, consumer = plan_servers(str(llama), str(llama), "identity", store=tmp_path / "store",
                                      max_prefix_tokens=100)
    assert (producer.kv_role, consumer.kv_role) == ("kv_producer", "kv_consumer")
    assert consumer.extra["translator"] == "identity" and consumer.extra["max_prefix_tokens"] == 100
    assert producer.extra["model_signature"] == consumer.extra["model_signature"]
    assert check_served_config(consumer.extra, consumer=True) and check_served_config(producer.extra, consumer=False)
    with pytest.raises(ConfigError, match="not a valid registry URI"):
        plan_servers(str(llama), str(llama), "models:/x", store=tmp_path / "store")
