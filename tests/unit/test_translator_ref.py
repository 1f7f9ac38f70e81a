"""registry.translator_ref: one reference type (PATH | models:/NAME@ALIAS | identity) parsed without loading,
then loaded for a pair."""

import pytest
from tiny_configs import noisy_identity, save_tiny_model_dir

from infra.zoo import load_model, model_signature
from registry.translator_ref import TranslatorRef, load_translator_ref, parse_translator_ref
from translators.artifact import save_translator
from translators.errors import ConfigError, PairMismatchError


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two copies of one tiny model's directory loaded, a llama of another shape, and a self-translator artifact."""
    root = tmp_path_factory.mktemp("refs")
    qwen = load_model(str(save_tiny_model_dir("qwen3", root / "qwen3")))
    llama = load_model(str(save_tiny_model_dir("llama", root / "llama")))
    artifact = root / "fit" / "distilled"
    save_translator(noisy_identity(qwen.layout), artifact, source=model_signature(qwen), target=model_signature(qwen),
                    fit={"stage": "distilled"})
    return qwen, llama, artifact


@pytest.mark.parametrize("text, message", [
    ("", "empty translator reference"),
    ("   ", "empty translator reference"),
    ("models:/", "not a valid registry URI: expected models:/NAME@ALIAS"),
    ("models:/a--b", "not a valid registry URI"),
    ("models:/a--b@", "not a valid registry URI"),
    ("models:/a--b/latest", "not a valid registry URI"),
    ("models:/a/b@champion", "not a valid registry URI"),
    ("runs:/abc", "expected runs:/RUN_ID/PATH"),
    ("s3://bucket/translator", "unsupported URI scheme"),
    ("/nonexistent/translator", "no such directory"),
])
def test_malformed_references_name_the_accepted_forms(text, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_translator_ref(text)
    assert any(form in str(err.value) for form in ("identity", "models:/", "runs:/"))  # says what to give


def test_valid_references_parse_without_loading(pair, tmp_path):
    _, _, artifact = pair
    assert parse_translator_ref("identity") == TranslatorRef("identity", "identity")
    for uri in ("models:/a--b@champion", "models:/a--b/3", "runs:/0123abcd/translators/distilled"):
        ref = parse_translator_ref(uri)
        assert (ref.kind, ref.text, ref.path, ref.label) == ("registry", uri, None, uri)
    ref = parse_translator_ref(f" {artifact} ")
    assert (ref.kind, ref.path, ref.label) == ("path", artifact, "distilled")


def test_a_fit_directory_points_at_its_artifact(pair, tmp_path):
    _, _, artifact = pair
    with pytest.raises(ConfigError, match=f"it is a fit directory: pass {artifact}"):
        parse_translator_ref(str(artifact.parent))
    with pytest.raises(ConfigError, match="no manifest.json"):
        parse_translator_ref(str(tmp_path))


def test_identity_and_path_load_for_the_pair(pair):
    qwen, llama, artifact = pair
    assert load_translator_ref(parse_translator_ref("identity"), qwen, qwen) is None
    with pytest.raises(PairMismatchError, match="identity only works between copies of one model"):
        load_translator_ref(parse_translator_ref("identity"), qwen, llama)
    translator = load_translator_ref(parse_translator_ref(str(artifact)), qwen, qwen)
    assert translator.n_target_layers == qwen.layout.n_layers
    with pytest.raises(PairMismatchError):
        load_translator_ref(parse_translator_ref(str(artifact)), qwen, llama)


def test_registry_uris_load_through_the_tracking_store_with_the_pair_signatures(pair, monkeypatch):
    qwen, llama, artifact = pair
    from translators.artifact import load_translator

    calls = []

    def fake_load_uri(uri, source_sig, target_sig):
        calls.append((uri, source_sig, target_sig))
        return load_translator(artifact, source=source_sig, target=target_sig)

    monkeypatch.setattr("registry.tracking.load_translator_uri", fake_load_uri)
    translator = load_translator_ref(parse_translator_ref("models:/q--q@champion"), qwen, qwen)
    assert calls == [("models:/q--q@champion", model_signature(qwen), model_signature(qwen))]
    assert translator.n_target_layers == qwen.layout.n_layers
    with pytest.raises(PairMismatchError):  # the signatures of the pair asked for are checked
        load_translator_ref(parse_translator_ref("models:/q--q@champion"), qwen, llama)
