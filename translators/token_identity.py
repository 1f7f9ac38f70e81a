"""Token identity for the maps (hybrid paper §3.4): the target's own input embedding of each token's id is
appended to the input of every map, so a map receives an exact token signal beside the source's cache.

Two variants give the ids:

- `codebook` (cache-only): layer 0's position-free cache object (MLA: the latent; GQA: the values) is a function
  of the token alone, so a codebook with one row per vocabulary entry (the object that entry produces) decodes
  every cached row back to its token id by nearest neighbour. Nothing but the source's cache is read.
- `ids`: the caller passes the ids (a serving system knows the prompt). Across tokenizers these are the target's
  ids of the tokens each source token is aligned to (`translators.cross.aligned_token_ids`): both tokenizations
  of the text are known there.

The codebook needs a shared tokenizer: the id it decodes must index the target's embedding.

Privacy: because the codebook recovers tokens from the cache (`codebook_accuracy`, 1.0 on MLA latents), a cached
or translated KV cache is not an anonymised form of the prompt; protect it like the prompt itself.

The embedding enters a map as the pseudo source object `token_embedding` (`Translator.inputs`), read beside each
source layer the map reads; with ν > 1 it is repeated per layer, which gives the least-squares and min-norm fits
the same predictions as appending it once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from translators.errors import ConfigError, PairMismatchError
from translators.layout import CacheLayout, decoder_of
from translators.objects import LATENT, VALUES, CacheObject, cache_objects, layer_objects, object_width
from translators.translator import TOKEN_EMBEDDING, Translator

VARIANTS = ("codebook", "ids")


def check_variant(variant: str | None) -> str | None:
    """None (no token identity) or one of VARIANTS.

    Raises:
        ConfigError: an unknown variant.
    """
    if variant is not None and variant not in VARIANTS:
        raise ConfigError(f"unknown token identity {variant!r}; choose from {', '.join(VARIANTS)} (or leave it off)")
    return variant


def codebook_object(layout: CacheLayout) -> CacheObject:
    """Layer 0's cache object that depends on the token alone at every capture point: the MLA latent (no RoPE)
    or the GQA values (keys are rotated at `post_rope`).

    Raises:
        ConfigError: layer 0 holds no per-token object (a hybrid whose first layer is linear attention).
    """
    names = {obj.name for obj in layer_objects(layout, 0) if isinstance(obj, CacheObject)}
    if not names:
        raise ConfigError(f"the codebook decodes token ids from layer 0's per-token cache objects, but layer 0 of "
                          f"{layout.family} is a linear-attention layer (it caches a state); use token identity 'ids'")
    return LATENT if LATENT.name in names else VALUES


def vocabulary_rows(model: nn.Module, layout: CacheLayout, obj: CacheObject, point: str, batch: int = 4096) -> torch.Tensor:
    """The layer-0 object every vocabulary entry produces, at `point`: [vocab, width] fp32.

    Layer 0 reads only the token's embedding through its input norm, so each row is computed from the token
    alone (no sequence, no position: `obj` is position-free).
    """
    decoder = decoder_of(model)
    layer0 = decoder.layers[0]
    vocab = model.get_input_embeddings().num_embeddings
    rows = []
    with torch.no_grad():
        for start in range(0, vocab, batch):
            ids = torch.arange(start, min(start + batch, vocab), device=model.device).view(1, -1)
            hidden = layer0.input_layernorm(decoder.embed_tokens(ids))
            raw = obj.read(layout.layers[0], obj.module(layer0)(hidden)[0])
            positions = torch.zeros(raw.shape[0], dtype=torch.long)
            rows.append(obj.advance(model, layout, 0, raw, start="pre_norm", end=point, positions=positions).float())
    return torch.cat(rows)


@dataclass
class Codebook:
    """Nearest-neighbour decoder of token ids from layer 0's `object` rows at `point`.

    rows: [vocab, width] fp32, row v = what token v produces.
    """

    object: str
    point: str
    rows: torch.Tensor

    def decode(self, x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """[n, width] cached rows → [n] token ids of their nearest codebook rows (squared L2)."""
        norms = (self.rows**2).sum(-1)  # [vocab]
        out = []
        for start in range(0, x.shape[0], chunk):
            block = x[start:start + chunk].float().to(self.rows.device)
            # ‖x − r‖² = ‖x‖² − 2 x·r + ‖r‖²; ‖x‖² does not change the argmin.
            out.append((norms - 2 * block @ self.rows.T).argmin(-1))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def build_codebook(model: nn.Module, layout: CacheLayout, point: str) -> Codebook:
    """The source's codebook at capture point `point` (its layer-0 position-free object)."""
    obj = codebook_object(layout)
    return Codebook(object=obj.name, point=point, rows=vocabulary_rows(model, layout, obj, point))


def codebook_accuracy(codebook: Codebook, objects: Mapping[str, Sequence[torch.Tensor]], ids: torch.Tensor) -> float:
    """Fraction of tokens whose id the codebook recovers from a capture's layer-0 object (ids: [n])."""
    decoded = codebook.decode(objects[codebook.object][0])
    return float((decoded.cpu() == ids.view(-1).cpu()).float().mean())


class TokenIdentity(nn.Module):
    """What a translator needs to append token identity: the target's input embedding (and, for `codebook`,
    the source's codebook). Built from the models, never saved in the artifact (the manifest records the
    variant; `attach_token_identity` rebuilds it for the loaded pair).

    Buffers: embedding [target vocab, d_model] fp32; codebook rows [source vocab, width] fp32 (codebook only).
    """

    def __init__(self, variant: str, embedding: torch.Tensor, codebook: Codebook | None):
        super().__init__()
        if check_variant(variant) is None or (variant == "codebook") != (codebook is not None):
            raise ConfigError("the codebook variant needs a codebook and the ids variant none")
        self.variant = variant
        self.codebook_object = codebook.object if codebook else None
        self.codebook_point = codebook.point if codebook else None
        self.register_buffer("embedding", embedding.detach().float(), persistent=False)
        self.register_buffer("codebook_rows", codebook.rows if codebook else torch.zeros(0), persistent=False)

    @property
    def width(self) -> int:
        return int(self.embedding.shape[1])

    def ids(self, sources: Mapping[str, Sequence[torch.Tensor]], token_ids: torch.Tensor | None) -> torch.Tensor:
        """The token ids [n] of the tokens being translated.

        Raises:
            ConfigError: the ids variant without `token_ids`.
        """
        if self.variant == "ids":
            if token_ids is None:
                raise ConfigError("this translator reads token ids (token identity 'ids'): pass the prompt's ids")
            return token_ids.view(-1)
        return self.codebook().decode(sources[self.codebook_object][0])

    def codebook(self) -> Codebook:
        """The source's codebook (the `codebook` variant only)."""
        return Codebook(self.codebook_object, self.codebook_point, self.codebook_rows)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[n] ids → [n, d_model] rows of the target's input embedding.

        Raises:
            ConfigError: an id beyond the target's vocabulary.
        """
        if ids.numel() and int(ids.max()) >= self.embedding.shape[0]:
            raise ConfigError(f"token id {int(ids.max())} is beyond the target's vocabulary ({self.embedding.shape[0]})")
        return self.embedding[ids.to(self.embedding.device)]


def target_embedding(model: nn.Module) -> torch.Tensor:
    """The target's input embedding matrix as its maps read it: [vocab, d_model] fp32 (scaled embeddings, as
    Gemma's, are read through the module, so the scale is included)."""
    embed = model.get_input_embeddings()
    with torch.no_grad():
        return embed(torch.arange(embed.num_embeddings, device=model.device)).float()


def make_token_identity(variant: str, source_model: nn.Module, source_layout: CacheLayout, target_model: nn.Module,
                        point: str) -> TokenIdentity:
    """The token-identity module of a pair (see `TokenIdentity`)."""
    codebook = build_codebook(source_model, source_layout, point) if variant == "codebook" else None
    return TokenIdentity(variant, target_embedding(target_model), codebook)


def attach_token_identity(translator: Translator, source_model: nn.Module, source_layout: CacheLayout,
                          target_model: nn.Module) -> Translator:
    """Give a translator that appends token identity its module for this loaded pair (no-op otherwise).

    Raises:
        PairMismatchError: the target's embedding width is not the one the maps were fitted with.
    """
    if translator.token_identity is None:
        return translator
    module = make_token_identity(translator.token_identity, source_model, source_layout, target_model, translator.point)
    expected = {translator.widths(name)[0] - _width_without_tokens(translator, name, source_layout) for name in translator.objects}
    if expected != {module.width}:
        raise PairMismatchError(f"the maps read a token embedding of width {sorted(expected)}, the target's is {module.width}")
    translator.token_module = module.to(next(translator.parameters()).device)
    return translator


def _width_without_tokens(translator: Translator, name: str, layout: CacheLayout) -> int:
    by_name = {obj.name: obj for obj in cache_objects(layout)}
    return sum(object_width(by_name[o], layout) for o in translator.inputs[name] if o != TOKEN_EMBEDDING)


def with_tokens(inputs: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Every map's inputs plus the token embedding (appended last)."""
    return {name: (*names, TOKEN_EMBEDDING) for name, names in inputs.items()}
