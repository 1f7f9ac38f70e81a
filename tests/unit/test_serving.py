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
    attach_prompt_token_identity,
    check_served_config,
    gate,
    model_skeleton,
    new_conversation_key,
    own_rows,
    serve_translator,
    translate_rows,
)
from translators.artifact import load_translator, save_translator
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
    decision = gate(served, {"k": header}.get, prompt, "k")
    assert (decision.status, decision.n_load) == (APPLIED, 12)  # the common prefix
    assert gate(served, {"k": header}.get, list(range(8)), "k").n_load == 7  # the prompt's last token stays with the engine
    long = gate(served, {"k": header}.get, list(range(25)), "k")
    assert (long.status, long.n_load) == (FALLBACK, 0)
    assert "24 tokens exceeds the translator's envelope of 20 tokens" in long.reason
    missing = gate(served, {}.get, prompt, "k")
    assert missing.status == FALLBACK and "not in the store" in missing.reason
    other = gate(served, {"k": {**header, "source": signature(layout, "other")}}.get, prompt, "k")
    assert other.status == FALLBACK and "source.name is \"m\" in the artifact but \"other\"" in other.reason
    assert gate(served, {"k": {**header, "token_ids": [5, 6]}}.get, prompt, "k").status == FALLBACK


def test_gate_refuses_what_cannot_be_served_exactly(qwen3, llama, tmp_path):
    _, model = qwen3
    layout = cache_layout(model)
    sig = signature(layout)
    for point, words in (("pre_norm", "normalises its keys"), ("post_rope", "post_rope are not served")):
        translator = noisy_identity(layout)
        translator.point = point
        art = save_translator(translator, tmp_path / point, source=sig, target=sig, fit={})
        served = serve_translator(str(art), layout, sig)
        decision = gate(served, {"k": {"token_ids": [1, 2, 3], "source": sig}}.get, [1, 2, 3], "k")
        assert decision.status == UNSUPPORTED and words in decision.reason
    # A source without key norm: pre_norm is the same point as post_norm, served.
    _, llama_layout = llama
    lsig = signature(llama_layout)
    art = save_translator(noisy_identity(llama_layout), tmp_path / "llama", source=lsig, target=lsig,
                          fit={"config": {"max_prefix_tokens": 64}})
    served = serve_translator(str(art), llama_layout, lsig, max_prefix_tokens=100)
    assert served.envelope == 64 and served.identity != "identity"
    assert gate(served, {"k": {"token_ids": [1, 2, 3], "source": lsig}}.get, [1, 2, 3], "k").status == APPLIED
    with pytest.raises(PairMismatchError, match="target"):
        serve_translator(str(art), llama_layout, signature(llama_layout, "another"))
    with pytest.raises(ServingError, match="resolve registry references"):
        serve_translator("models:/pair@champion", llama_layout, lsig)
    with pytest.raises(ServingError, match="neither 'identity' nor an artifact"):
        serve_translator(str(tmp_path / "nope"), llama_layout, lsig)


def test_gate_reuses_the_models_own_rows_when_a_conversation_returns(llama, tmp_path):
    """A → B → A: B's conversation started from A's; A reuses its own rows and translates only B's span."""
    _, layout = llama
    a, b = signature(layout, "a"), signature(layout, "b")
    art = save_translator(noisy_identity(layout), tmp_path / "b-to-a", source=b, target=a, fit={})
    served = serve_translator(str(art), layout, a)  # engine A, serving B → A
    mine, theirs, third = new_conversation_key(), new_conversation_key(), new_conversation_key()
    turn1 = list(range(10))
    turn2 = turn1 + list(range(50, 58))
    headers = {mine: {"token_ids": turn1, "source": a, "loaded": None},
               theirs: {"token_ids": turn2, "source": b, "loaded": {"conversation": mine, "tokens": 9}}}
    turn3 = turn2 + [70, 71, 72]
    decision = gate(served, headers.get, turn3, theirs)
    assert (decision.status, decision.n_load, decision.reused, decision.own) == (APPLIED, 18, 9, mine)
    assert f"9 reused from this model's conversation {mine}, 9 translated" in decision.reason
    # A prompt that stops inside the reused rows loads only own rows.
    short = gate(served, headers.get, turn1[:6], theirs)
    assert (short.n_load, short.reused) == (5, 5)
    # B's conversation without an origin: everything is translated.
    plain = gate(served, {theirs: {**headers[theirs], "loaded": None}}.get, turn3, theirs)
    assert (plain.status, plain.n_load, plain.reused, plain.own) == (APPLIED, 18, 0, None)
    # Origins that are not this model's rows: a translation is never translated again.
    cases = {"is gone": {},
             "is another model's": {mine: {"token_ids": turn1, "source": signature(layout, "c")}},
             "holds other tokens": {mine: {"token_ids": [9] * 10, "source": a}}}
    for words, extra in cases.items():
        decision = gate(served, {theirs: headers[theirs], third: {}, **extra}.get, turn3, theirs)
        assert decision.status == FALLBACK and words in decision.reason, (words, decision)
        assert "not translated again" in decision.reason
    bad = {theirs: {**headers[theirs], "loaded": {"conversation": mine, "tokens": "9"}}}
    assert gate(served, bad.get, turn3, theirs).status == FALLBACK
    with pytest.raises(ServingError, match="malformed conversation key"):
        gate(served, {theirs: {**headers[theirs], "loaded": {"conversation": "../x", "tokens": 9}}}.get, turn3,
             theirs)



def test_gate_holds_the_recorded_quality_to_its_calibrated_floor(llama, tmp_path):
    """The artifact's fit.quality record decides per prefix-length bucket, before anything loads: a bucket whose
    recorded cosine is below the floor falls back with the numbers, so does a prefix longer than every measured
    one; an artifact without a record (fitted before records existed) and identity are served."""
    _, layout = llama
    sig = signature(layout)
    quality = {"metric": "attention_output_cosine", "floor": 0.95,
               "buckets": [{"max_tokens": 8, "n": 3, "cosine": 0.99, "agreement": 0.97},
                           {"max_tokens": 16, "n": 2, "cosine": 0.90, "agreement": 0.60},
                           {"max_tokens": 32, "n": 2, "cosine": 0.96, "agreement": 0.92}]}
    art = save_translator(noisy_identity(layout), tmp_path / "rated", source=sig, target=sig,
                          fit={"quality": quality})
    served = serve_translator(str(art), layout, sig)
    assert served.quality == quality
    header = {"token_ids": list(range(60)), "source": sig}

    def decide(n_prompt):
        return gate(served, {"k": header}.get, list(range(n_prompt)), "k")

    assert (decide(9).status, decide(9).n_load) == (APPLIED, 8)  # bucket ≤ 8: 0.99 ≥ 0.95
    low = decide(10)  # 9 tokens to load: bucket ≤ 16, 0.90 < 0.95
    assert (low.status, low.n_load) == (FALLBACK, 0)
    assert "up to 16 tokens is 0.9000, below the floor 0.9500" in low.reason
    assert decide(33).status == APPLIED  # 32 tokens: bucket ≤ 32, 0.96
    beyond = decide(34)
    assert beyond.status == FALLBACK and "longer than every held-out prefix" in beyond.reason
    unrated = save_translator(noisy_identity(layout), tmp_path / "unrated", source=sig, target=sig, fit={})
    assert gate(serve_translator(str(unrated), layout, sig), {"k": header}.get, list(range(50)), "k").status == APPLIED
    identity = serve_translator("identity", layout, sig)
    assert identity.quality is None
    assert gate(identity, {"k": header}.get, list(range(50)), "k").status == APPLIED

def test_own_rows_are_the_engine_keys_of_the_saved_rows(llama, tmp_path):
    model, layout = llama
    ids = torch.arange(5, 30)
    post_norm = capture(model, layout, ids, "post_norm")
    post_rope = capture(model, layout, ids, "post_rope")
    store = ConversationStore(tmp_path)
    key = new_conversation_key()
    origin = {"conversation": new_conversation_key(), "tokens": 3}
    store.save(key, post_norm.keys, post_norm.values, ids.tolist(), signature(layout), origin)
    assert store.header(key)["loaded"] == origin
    rows = store.load(key, list(range(layout.n_layers)), 4, 9)
    keys, values = own_rows(rows, model, layout, torch.arange(4, 9))
    for layer in range(layout.n_layers):
        torch.testing.assert_close(keys[layer], post_rope.keys[layer][4:9], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[layer], post_rope.values[layer][4:9], rtol=0, atol=0)


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
    with pytest.raises(ConfigError, match="not a valid registry URI"):
        plan_servers(str(llama), str(llama), "identity", store=tmp_path / "store", reverse_translator="models:/x")
    # Both directions: both engines save and load, each serving the translator into its own model.
    sig = producer.extra["model_signature"]
    layout = cache_layout(tiny_model("llama", seed=1))
    art = save_translator(noisy_identity(layout), tmp_path / "back", source=sig, target=sig, fit={})
    there, back = plan_servers(str(llama), str(llama), "identity", store=tmp_path / "store",
                               reverse_translator=str(art))
    assert (there.kv_role, back.kv_role) == ("kv_both", "kv_both")
    assert there.extra["translator"] == str(art.resolve()) and back.extra["translator"] == "identity"
    assert check_served_config(there.extra, consumer=True)


def _token_identity_artifact(tmp_path, target_family):
    """A codebook translator llama → `target_family` fitted at post_norm from a few random prompts, saved; the
    target saved as a model directory. Returns (source, target model, target dir, artifact, signatures)."""
    from translators.stage1 import Side, accumulate_pair, candidate_layers, empty_stats, solve_translator
    from translators.token_identity import make_token_identity

    source = tiny_model("llama", seed=1)
    target_dir = save_tiny_model_dir(target_family, tmp_path / target_family, seed=2)
    target = tiny_model(target_family, seed=2)
    src, tgt = Side(source, cache_layout(source)), Side(target, cache_layout(target))
    tokens = make_token_identity("codebook", source, src.layout, target, "post_norm")
    cands = candidate_layers(src.layout, tgt.layout, "depth", 1)
    stats = empty_stats(src.layout, tgt.layout, cands, token_width=tokens.width)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (24,), generator=g) for _ in range(8)]
    accumulate_pair(stats, src, tgt, [(p, p[-4:]) for p in prompts], "post_norm", token_identity=tokens)
    translator = solve_translator(stats, {n: cands for n in stats}, src.layout, tgt.layout, "post_norm",
                                  token_identity="codebook")
    sigs = signature(src.layout, "s"), signature(tgt.layout, "t")
    art = save_translator(translator, tmp_path / f"art-{target_family}", source=sigs[0], target=sigs[1], fit={})
    return source, target, target_dir, art, sigs


def test_token_identity_is_served_from_the_prompts_ids(tmp_path):
    """The connector's translation of a codebook translator (the target's embedding read from its directory, the
    prompt's ids) equals kvlingo's own: the artifact with its codebook attached for the loaded pair, then the
    target's k-norm and RoPE."""
    from translators.token_identity import attach_token_identity

    source, target, target_dir, art, (ssig, tsig) = _token_identity_artifact(tmp_path, "llama")
    skeleton, layout = model_skeleton(target_dir)
    served = serve_translator(str(art), layout, tsig)
    header = {"token_ids": list(range(3, 40)), "source": ssig}
    before = gate(served, {"k": header}.get, list(range(3, 40)), "k")
    assert before.status == UNSUPPORTED and "appends token identity" in before.reason
    attach_prompt_token_identity(served, skeleton, target_dir)
    assert gate(served, {"k": header}.get, list(range(3, 40)), "k").status == APPLIED

    ids = torch.arange(3, 40)
    cap = capture(source, cache_layout(source), ids, "post_norm")
    rows = {"keys": dict(enumerate(k[4:9] for k in cap.keys)), "values": dict(enumerate(v[4:9] for v in cap.values))}
    positions = torch.arange(4, 9)
    keys, values = translate_rows(served, rows, skeleton, layout, positions, ids[4:9])

    reference, _ = load_translator(art)
    attach_token_identity(reference, source, cache_layout(source), target)
    out = reference.translate_objects({"keys": cap.keys, "values": cap.values})  # the codebook decodes the ids
    for layer in range(layout.n_layers):
        expected = keys_to_point(target, layout, layer, out["keys"][layer][4:9], start="post_norm", end="post_rope",
                                 positions=positions)
        torch.testing.assert_close(keys[layer], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[layer], out["values"][layer][4:9], atol=1e-5, rtol=1e-5)


def test_token_identity_into_a_scaled_embedding_is_refused_per_request(tmp_path):
    _, _, target_dir, art, (ssig, tsig) = _token_identity_artifact(tmp_path, "gemma3")
    skeleton, layout = model_skeleton(target_dir)
    served = serve_translator(str(art), layout, tsig)
    attach_prompt_token_identity(served, skeleton, target_dir)
    decision = gate(served, {"k": {"token_ids": [1, 2, 3], "source": ssig}}.get, [1, 2, 3], "k")
    assert decision.status == UNSUPPORTED and "Gemma-3" in decision.reason and "token_identity none" in decision.reason
