import json

import pytest
import torch

from translators.artifact import ArtifactError, load_translator, save_translator
from translators.errors import ConfigError, PairMismatchError
from translators.translator import Translator

SRC = {"name": "a", "identity": {"gguf_sha256": "1" * 64}, "config_sha256": "c1", "tokenizer_sha256": "t", "layout": {"n_layers": 3}}
TGT = {"name": "b", "identity": {"gguf_sha256": "2" * 64}, "config_sha256": "c2", "tokenizer_sha256": "t", "layout": {"n_layers": 2}}


def make_translator():
    assignment = {"keys": {0: (0, 1), 1: (2, 1)}, "values": {0: (0, 2), 1: (1, 2)}}
    tr = Translator(assignment, d_src=4, d_tgt=6, point="pre_norm")
    g = torch.Generator().manual_seed(0)
    for name, p in tr.maps.items():
        p.data.copy_(torch.randn(p.shape, generator=g))
    return tr


def test_forward_is_the_block_map_of_eq_3_1():
    tr = make_translator()
    src_k = [torch.randn(5, 4) for _ in range(3)]
    src_v = [torch.randn(5, 4) for _ in range(3)]
    keys, values = tr(src_k, src_v)
    # Reference: sum over the assigned source layers of per-layer blocks T^{s→ℓ} x_s.
    w = tr.weight("keys", 1)
    expected = src_k[2] @ w[:, :4].T + src_k[1] @ w[:, 4:].T
    torch.testing.assert_close(keys[1], expected)
    assert values[0].shape == (5, 6) and values[0].dtype == torch.float32
    assert tr.source_layers() == [0, 1, 2]


def test_artifact_round_trip_and_pair_check(tmp_path):
    tr = make_translator()
    save_translator(tr, tmp_path / "t", source=SRC, target=TGT, fit={"stage": "closed_form"})
    assert (tmp_path / "t" / "weights.safetensors").is_file()
    loaded, manifest = load_translator(tmp_path / "t", source=SRC, target=TGT)
    for name in tr.maps:
        assert torch.equal(loaded.maps[name], tr.maps[name])
    assert loaded.assignment == tr.assignment and manifest["point"] == "pre_norm"
    other = {**SRC, "identity": {"gguf_sha256": "9" * 64}}
    with pytest.raises(PairMismatchError, match=r"another source model: source\.identity\.gguf_sha256"):
        load_translator(tmp_path / "t", source=other)
    with pytest.raises(PairMismatchError, match="target.name"):
        load_translator(tmp_path / "t", target={**TGT, "name": "c"})


def test_tampered_weights_are_refused(tmp_path):
    save_translator(make_translator(), tmp_path / "t", source=SRC, target=TGT, fit={})
    path = tmp_path / "t" / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="modified or corrupted"):
        load_translator(tmp_path / "t")


def test_missing_or_foreign_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load_translator(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "pickle"}))
    with pytest.raises(ArtifactError, match="unknown artifact format"):
        load_translator(tmp_path)


def test_assignment_must_cover_every_target_layer():
    with pytest.raises(ConfigError, match="cover target layers"):
        Translator({"keys": {0: (0,), 2: (1,)}, "values": {0: (0,), 2: (1,)}}, 4, 4, "pre_norm")


def test_translator_fitted_with_another_tokenizer_is_refused(tmp_path):
    # Cross-tokenizer artifacts record an alignment that only holds for the tokenizers they were fitted with: the
    # pair signature pins both tokenizers' hashes, and a model loaded with another tokenizer is refused by name.
    save_translator(make_translator(), tmp_path / "t", source=SRC, target=TGT,
                    fit={"stage": "closed_form", "alignment": {"samples": 3}})
    _, manifest = load_translator(tmp_path / "t", source=SRC, target=TGT)
    assert manifest["fit"]["alignment"] == {"samples": 3}
    with pytest.raises(PairMismatchError, match=r"another target model: target\.tokenizer_sha256"):
        load_translator(tmp_path / "t", source=SRC, target={**TGT, "tokenizer_sha256": "u"})
    with pytest.raises(PairMismatchError, match=r"source\.tokenizer_sha256"):
        load_translator(tmp_path / "t", source={**SRC, "tokenizer_sha256": "u"}, target=TGT)
