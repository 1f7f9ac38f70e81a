"""Serving tier: the kvlingo connector inside vLLM (CPU build, the serving venv `.venv-serve` that
`bash infra/bootstrap.sh --serve` builds), identity SmolLM2 → SmolLM2, fp32, greedy.

A producer engine answers 21 prompts and saves their K/V; a consumer engine then answers the same prompts
naming those conversations (translated requests), plus one naming a conversation that does not exist, and
afterwards the same prompts as ordinary requests. vLLM's own answers (the producer's, and the consumer's
ordinary requests) are the reference.
"""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.serving

ROOT = Path(__file__).resolve().parents[2]
SERVE_PY = ROOT / ".venv-serve" / "bin" / "python"
ENVELOPE = 450  # the consumer's max_prefix_tokens; the last prompt is longer
MAX_TOKENS = 24
MISSING = "0" * 32


def _prompts(tokenizer, data: Path) -> list[list[int]]:
    """20 chat prompts of 140-400 tokens (each longer than one 128-token block, so the prefix cache could share
    blocks between equal prompts) and one of 460-900 tokens, beyond the envelope."""
    short, long = [], None
    with gzip.open(data / "chat" / "hh-rlhf-harmless-base.test.jsonl.gz", "rt") as f:
        for line in f:
            text = json.loads(line)["chosen"].strip()
            chat = tokenizer.apply_chat_template([{"role": "user", "content": "Continue this dialogue:\n" + text}],
                                                 add_generation_prompt=True, tokenize=False)
            ids = tokenizer(chat, add_special_tokens=False).input_ids
            if 140 <= len(ids) <= 400 and len(short) < 20:
                short.append(ids)
            elif ENVELOPE + 10 <= len(ids) <= 900 and long is None:
                long = ids
            if len(short) == 20 and long is not None:
                return short + [long]
    raise AssertionError("the chat data holds too few prompts of the lengths this test needs")


def _run_engine(spec: dict, tmp: Path, name: str) -> tuple[dict, str]:
    spec_path, out_path = tmp / f"{name}.json", tmp / f"{name}-out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(SERVE_PY), "-m", "infra.vllm_run", str(spec_path), str(out_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{name} engine failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(out_path.read_text()), done.stdout + done.stderr


@pytest.fixture(scope="module")
def served(tmp_path_factory, shared_data_dir):
    if not SERVE_PY.is_file():
        pytest.fail(f"the serving venv is missing ({SERVE_PY}): run `bash infra/bootstrap.sh --serve`")
    from infra.zoo import load_model, model_signature

    loaded = load_model("smollm2-135m-instruct")
    signature = model_signature(loaded)
    model_dir = loaded.model.config._name_or_path
    prompts = _prompts(loaded.tokenizer, shared_data_dir)
    tmp = tmp_path_factory.mktemp("serving")
    store = tmp / "store"
    extra = {"store": str(store), "model_signature": signature}
    produced, _ = _run_engine({"model": model_dir, "kv_role": "kv_producer", "extra_config": extra,
                               "max_tokens": MAX_TOKENS, "phases": [[{"prompt_token_ids": p} for p in prompts] + [
                                   {"prompt_token_ids": prompts[1], "kv_transfer_params": {"source_conversation": MISSING}}]]},
                              tmp, "producer")
    keys = [out["kv_transfer_params"]["conversation"] for out in produced["phases"][0][:len(prompts)]]
    translated = [{"prompt_token_ids": p, "kv_transfer_params": {"source_conversation": k}}
                  for p, k in zip(prompts, keys)]
    translated.append({"prompt_token_ids": prompts[0], "kv_transfer_params": {"source_conversation": MISSING}})
    consumed, log = _run_engine({"model": model_dir, "kv_role": "kv_consumer",
                                 "extra_config": {**extra, "translator": "identity", "max_prefix_tokens": ENVELOPE},
                                 "max_tokens": MAX_TOKENS,
                                 "phases": [translated, [{"prompt_token_ids": p} for p in prompts]]}, tmp, "consumer")
    return {"prompts": prompts, "produced": produced["phases"][0], "translated": consumed["phases"][0],
            "ordinary": consumed["phases"][1], "log": log, "store": store, "keys": keys, "loaded": loaded,
            "block_size": consumed["block_size"], "signature": signature, "model_dir": model_dir, "tmp": tmp}


@pytest.fixture(scope="module")
def shared_data_dir():
    data = ROOT.parent / "shared" / "data"
    if not data.is_dir():
        pytest.fail(f"offline data not found at {data} (../shared/data beside the repository)")
    return data


def test_identity_through_both_connectors_equals_vllm_native(served):
    prompts = served["prompts"][:20]
    for i, prompt in enumerate(prompts):
        translated, native = served["translated"][i], served["ordinary"][i]
        params = translated["kv_transfer_params"]
        assert params["status"] == "applied", params
        assert params["loaded_tokens"] == len(prompt) - 1
        # vLLM counts the loaded tokens as cached: only the prompt's last token was computed by the engine.
        assert translated["num_cached_tokens"] == len(prompt) - 1
        assert translated["token_ids"] == native["token_ids"], f"prompt {i}"
        assert translated["token_ids"] == served["produced"][i]["token_ids"], f"prompt {i}"
        assert "conversation" not in params  # a consumer saves nothing


def test_saved_keys_are_the_models_post_norm_keys(served):
    """The producer's saved K/V (read from vLLM's paged cache, keys rotated back) against HF's own capture."""
    from infra.serving import ConversationStore
    from translators.capture import capture

    loaded = served["loaded"]
    prompt = served["prompts"][2]
    reference = capture(loaded.model, loaded.layout, torch.tensor(prompt), "post_norm")
    header = ConversationStore(served["store"]).header(served["keys"][2])
    assert header["token_ids"] == prompt and header["point"] == "post_norm"
    rows = ConversationStore(served["store"]).load(served["keys"][2], list(range(loaded.layout.n_layers)), 0,
                                                   len(prompt))
    for layer in range(loaded.layout.n_layers):
        scale = reference.keys[layer].abs().max()
        assert (rows["keys"][layer] - reference.keys[layer]).abs().max() <= 1e-4 * scale, layer
        vscale = reference.values[layer].abs().max()
        assert (rows["values"][layer] - reference.values[layer]).abs().max() <= 1e-4 * vscale, layer


def test_over_envelope_request_falls_back_with_the_native_answer(served):
    long, native = served["translated"][20], served["ordinary"][20]
    params = long["kv_transfer_params"]
    assert len(served["prompts"][20]) > ENVELOPE
    assert params["status"] == "fallback_reprefill" and params["loaded_tokens"] == 0
    assert f"exceeds the translator's envelope of {ENVELOPE} tokens" in params["reason"]
    assert long["token_ids"] == native["token_ids"] == served["produced"][20]["token_ids"]


def test_missing_conversation_falls_back_with_the_native_answer(served):
    missing = served["translated"][21]
    assert missing["kv_transfer_params"]["status"] == "fallback_reprefill"
    assert "is not in the store" in missing["kv_transfer_params"]["reason"]
    assert missing["token_ids"] == served["ordinary"][0]["token_ids"]


def test_later_ordinary_requests_do_not_reuse_translated_blocks(served):
    """Every prompt holds at least one full block, so without the translated requests' cache salt the ordinary
    requests would have found their blocks in the prefix cache."""
    assert all(len(p) > served["block_size"] for p in served["prompts"])
    # The fallback requests (over the envelope, missing conversation) prefilled natively, unsalted: the ordinary
    # requests for those two prompts reuse their native blocks, as ordinary requests would.
    native_prefilled = {0, 20}
    for i, out in enumerate(served["ordinary"]):
        if i in native_prefilled:
            assert out["num_cached_tokens"] >= served["block_size"], i
        else:
            assert out["num_cached_tokens"] == 0, (i, out["num_cached_tokens"])


def test_a_producer_answers_requests_naming_a_source_natively(served):
    """A producer-only engine cannot load: the request is `unsupported`, answered natively, and saved as usual."""
    out = served["produced"][21]
    params = out["kv_transfer_params"]
    assert params["status"] == "unsupported" and "is not a consumer" in params["reason"]
    assert params["loaded_tokens"] == 0 and len(params["conversation"]) == 32
    assert out["token_ids"] == served["produced"][1]["token_ids"]


def test_statuses_are_counted_in_the_log(served):
    lines = [line for line in served["log"].splitlines() if "kvlingo request" in line]
    assert len(lines) == 22
    assert lines[-1].rstrip().endswith("[totals applied=20 fallback_reprefill=2 unsupported=0]"), lines[-1]


N_ARTIFACT = 10
ARTIFACT_TOKENS = 8


def rated_quality(prompts: list[list[int]]) -> dict:
    """A quality record (translators.quality's format) under which the gate serves every prefix shorter than the
    longest prompt's and falls back on that one: its bucket is recorded below the floor."""
    longest = max(len(p) for p in prompts) - 1  # the tokens the gate would load for it
    return {"metric": "attention_output_cosine", "agreement_level": 0.9, "floor": 0.95,
            "buckets": [{"max_tokens": longest - 1, "n": 4, "cosine": 0.99, "agreement": 0.95},
                        {"max_tokens": 4096, "n": 4, "cosine": 0.5, "agreement": 0.2}]}


@pytest.fixture(scope="module")
def artifact_run(served):
    """A consumer serving a translator artifact (identity plus noise, at post_norm, ν = 1) for the saved
    conversations, and kvlingo's own HF switch runtime with the same translator as the reference. The artifact's
    quality record sends the longest prompt back to re-prefill (`rated_quality`)."""
    from translators.artifact import save_translator
    from translators.generation import GenerationSettings
    from translators.stage1 import Side
    from translators.switch import switch_generate
    from translators.translator import Translator

    loaded = served["loaded"]
    n, d = loaded.layout.n_layers, loaded.layout.kv_width
    translator = Translator({o: {t: (t,) for t in range(n)} for o in ("keys", "values")}, d, d, "post_norm")
    g = torch.Generator().manual_seed(0)
    for p in translator.maps.values():
        p.data.copy_(torch.eye(d) + 0.2 * torch.randn(d, d, generator=g) / d ** 0.5)
    artifact = save_translator(translator, served["tmp"] / "noisy", source=served["signature"],
                               target=served["signature"], fit={"config": {"max_prefix_tokens": 1024},
                                                                  "quality": rated_quality(served["prompts"][:N_ARTIFACT])})
    items = [{"prompt_token_ids": p, "kv_transfer_params": {"source_conversation": k}}
             for p, k in zip(served["prompts"][:N_ARTIFACT], served["keys"])]
    consumed, _ = _run_engine({"model": served["model_dir"], "kv_role": "kv_consumer",
                               "extra_config": {"store": str(served["store"]), "model_signature": served["signature"],
                                                "translator": str(artifact)},
                               "max_tokens": ARTIFACT_TOKENS, "phases": [items]}, served["tmp"], "artifact")
    side = Side(loaded.model, loaded.layout)
    settings = GenerationSettings(max_new_tokens=ARTIFACT_TOKENS)
    reference = [list(map(int, switch_generate(side, side, p, translator, settings).token_ids))
                 for p in served["prompts"][:N_ARTIFACT]]
    return consumed["phases"][0], reference


def test_an_artifact_translator_in_vllm_agrees_with_the_hf_switch_runtime(served, artifact_run):
    outputs, reference = artifact_run
    prompts = served["prompts"][:N_ARTIFACT]
    longest = max(len(p) for p in prompts)
    native = [o["token_ids"][:ARTIFACT_TOKENS] for o in served["ordinary"][:N_ARTIFACT]]
    applied = []
    for i, out in enumerate(outputs):
        params = out["kv_transfer_params"]
        if len(prompts[i]) == longest:  # below the recorded quality floor: vLLM's own prefill answers
            assert params["status"] == "fallback_reprefill" and params["loaded_tokens"] == 0, params
            assert "below the floor 0.9500" in params["reason"], params
            assert out["token_ids"] == native[i], i
        else:
            assert params["status"] == "applied" and params["loaded_tokens"] == len(prompts[i]) - 1, params
            applied.append(i)
    assert len(applied) >= N_ARTIFACT - 2
    first = sum(outputs[i]["token_ids"][0] == reference[i][0] for i in applied)
    assert first >= len(applied) - 1, [(outputs[i]["token_ids"], reference[i]) for i in applied]
    # The maps were applied: the translated cache is not the native one.
    assert any(outputs[i]["token_ids"] != native[i] for i in applied)


N_SEGMENT = 3


@pytest.fixture(scope="module")
def segment_run(served):
    """A conversation A → B → A across engines, both `kv_both`: turn 1 is the producer's (A), engine B serves a
    noisy translator and starts turn 2 from A's conversation, engine A (identity) starts turn 3 from B's."""
    from translators.artifact import save_translator
    from translators.translator import Translator

    loaded, store, sig = served["loaded"], served["store"], served["signature"]
    n, d = loaded.layout.n_layers, loaded.layout.kv_width
    noisy = Translator({o: {t: (t,) for t in range(n)} for o in ("keys", "values")}, d, d, "post_norm")
    g = torch.Generator().manual_seed(1)
    for p in noisy.maps.values():
        p.data.copy_(torch.eye(d) + 0.2 * torch.randn(d, d, generator=g) / d ** 0.5)
    artifact = save_translator(noisy, served["tmp"] / "segment-noisy", source=sig, target=sig, fit={})
    user = loaded.tokenizer("<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False).input_ids

    def turn(engine, translator, prompts, sources):
        items = [{"prompt_token_ids": p, "kv_transfer_params": {"source_conversation": k}}
                 for p, k in zip(prompts, sources)]
        out, _ = _run_engine({"model": served["model_dir"], "kv_role": "kv_both",
                              "extra_config": {"store": str(store), "model_signature": sig, "translator": translator},
                              "max_tokens": MAX_TOKENS, "phases": [items]}, served["tmp"], engine)
        return out["phases"][0]

    turn1, keys1 = served["prompts"][:N_SEGMENT], served["keys"][:N_SEGMENT]
    turn2 = [p + out["token_ids"] + user for p, out in zip(turn1, served["produced"])]
    on_b = turn("segment-b", str(artifact), turn2, keys1)
    keys2 = [out["kv_transfer_params"]["conversation"] for out in on_b]
    turn3 = [p + out["token_ids"] + user for p, out in zip(turn2, on_b)]
    on_a = turn("segment-a", "identity", turn3, keys2)
    keys3 = [out["kv_transfer_params"]["conversation"] for out in on_a]
    return {"turns": (turn1, turn2, turn3), "keys": (keys1, keys2, keys3), "on_b": on_b, "on_a": on_a}


def test_a_returning_conversation_reuses_its_own_rows_and_translates_only_the_new_span(served, segment_run):
    from infra.serving import ConversationStore

    store = ConversationStore(served["store"])
    layers = list(range(served["loaded"].layout.n_layers))
    (turn1, turn2, turn3), (keys1, keys2, keys3) = segment_run["turns"], segment_run["keys"]
    for i in range(N_SEGMENT):
        n1, n2 = len(turn1[i]), len(turn2[i])
        to_b = segment_run["on_b"][i]["kv_transfer_params"]
        assert (to_b["status"], to_b["reused_tokens"], to_b["translated_tokens"]) == ("applied", 0, n1), to_b
        back = segment_run["on_a"][i]["kv_transfer_params"]
        assert back["status"] == "applied", back
        assert (back["reused_tokens"], back["translated_tokens"]) == (n1, n2 - n1), back
        assert f"{n1} reused from this model's conversation {keys1[i]}" in back["reason"]
        assert store.header(keys2[i])["loaded"] == {"conversation": keys1[i], "tokens": n1}
        assert store.header(keys3[i])["loaded"] == {"conversation": keys2[i], "tokens": n2}
        # What engine A held after the switch back (its own saved turn-3 prompt): its own turn-1 rows, exactly,
        # then B's rows of B's span; not B's noisy translation of turn 1.
        first = store.load(keys1[i], layers, 0, n1)
        on_b = store.load(keys2[i], layers, 0, n2)
        held = store.load(keys3[i], layers, 0, n2)
        for kind in ("keys", "values"):
            for layer in layers:
                scale = first[kind][layer].abs().max()
                assert (held[kind][layer][:n1] - first[kind][layer]).abs().max() <= 1e-4 * scale, (i, kind, layer)
                assert (held[kind][layer][n1:] - on_b[kind][layer][n1:]).abs().max() <= 1e-4 * scale
            assert (on_b[kind][0][:n1] - first[kind][0]).abs().max() > 1e-2 * first[kind][0].abs().max()
