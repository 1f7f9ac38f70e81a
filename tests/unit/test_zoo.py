import pytest
import torch
from tiny_configs import save_tiny_model_dir

from infra.zoo import ZOO, ModelUnavailableError, UnknownModelError, load_model, resolve_model, tokenizer_fingerprint


def test_zoo_names_the_required_models():
    for name in ("smollm2-135m-instruct", "gemma3-270m", "kvlingo-tiny-s", "kvlingo-tiny-l", "Qwen/Qwen3-8B",
                 "google/gemma-3-12b-it", "mistralai/Mistral-7B-Instruct-v0.3", "HuggingFaceTB/SmolLM2-1.7B-Instruct"):
        assert resolve_model(name).name == name
    assert ZOO["smollm2-135m-instruct"].source == "gguf_package"


def test_unknown_name_suggests_close_zoo_names():
    with pytest.raises(UnknownModelError, match="did you mean 'smollm2-135m-instruct'"):
        resolve_model("smollm-135m-instruct")


def test_any_hub_id_resolves_but_offline_load_fails_fast_with_instructions(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("someorg/some-model").source == "hub"
    with pytest.raises(ModelUnavailableError, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE=0"):
        load_model("someorg/some-model")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(UnknownModelError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_local_directory_loads_frozen_with_layout_and_identity(tmp_path):
    path = save_tiny_model_dir("qwen3", tmp_path / "m")
    loaded = load_model(str(path))
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.layout.family == "qwen3" and loaded.layout.n_layers == 3
    assert loaded.model.dtype == torch.float32
    assert loaded.identity["source"] == "local" and len(loaded.identity["files_sha256"]) == 64
    assert loaded.identity["tokenizer_sha256"] == tokenizer_fingerprint(loaded.tokenizer)


def test_tokenizer_fingerprint_tells_vocabularies_apart(tmp_path):
    from tiny_configs import tiny_tokenizer

    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    b.add_tokens(["<extra>"])
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)
