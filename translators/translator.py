"""The linear cache translator (eq. 3.1): per target layer and cache object, one map over ν source layers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from translators.assignment import Assignment
from translators.errors import ConfigError

TOKEN_EMBEDDING = "token_embedding"  # the pseudo source object of token identity (translators.token_identity)


class Translator(nn.Module):
    """Maps a source capture to the target's cache objects, token-wise.

    For target layer ℓ and object o (GQA: keys K and values V): Ŷℓ_i = T_o[ℓ] · concat_{s ∈ E_o(ℓ)} X_s,i.
    Objects may read different source layers (the R² assignment ranks keys and values separately). Parameters
    are fp32 whatever the models' dtype; the map of object o, layer ℓ is named `o_ℓ` (artifact tensor names).

    A target object's map reads, per source layer, the source objects named in `inputs` concatenated in that
    order: by default the source object of the same name (GQA → GQA, MLA → MLA); across cache kinds every
    source attention object (GQA → MLA: the latent and the rotary key each read [keys | values]).

    Args:
        assignment: {object name: {ℓ: (s, ...)}} covering every target layer, the same layers for every object
            (GQA: {"keys": ..., "values": ...}).
        d_src, d_tgt: widths one map reads per source layer / writes: an int shared by every object (GQA:
            n_kv_heads * head_dim), or {object name: width} when they differ (MLA: latent and rotary key).
        point: capture point the maps act at (keys); values are the same at every point.
        inputs: {target object: source objects read, in order}; default: each object reads its own name. The
            pseudo object `token_embedding` (token identity, `translators.token_identity`) is the target's
            input embedding of each token's id; `attach_token_identity` supplies it.
        token_identity: None, "codebook" or "ids": how the token ids are obtained (recorded in manifests).
    Raises:
        ConfigError: no objects, an object name that cannot name a map, objects/layers not covered alike, or
            widths/inputs that do not name exactly the assignment's objects.
    """

    def __init__(
        self,
        assignment: Mapping[str, Assignment],
        d_src: int | Mapping[str, int],
        d_tgt: int | Mapping[str, int],
        point: str,
        inputs: Mapping[str, Sequence[str]] | None = None,
        token_identity: str | None = None,
    ):
        super().__init__()
        # Sorted, so the maps' order (saved tensors, optimizer, gradient clipping) never depends on how the
        # caller happened to build the dict; for GQA this is ("keys", "values").
        _check_objects(tuple(assignment))
        self.objects: tuple[str, ...] = tuple(sorted(assignment))
        self.assignment = {
            name: {int(t): tuple(int(s) for s in src) for t, src in assignment[name].items()} for name in self.objects
        }
        layers = {name: set(a) for name, a in self.assignment.items()}
        if any(cover != layers[self.objects[0]] for cover in layers.values()):
            raise ConfigError(f"{' and '.join(self.objects)} must cover the same target layers")
        self.n_target_layers = len(self.assignment[self.objects[0]])
        if sorted(self.assignment[self.objects[0]]) != list(range(self.n_target_layers)):
            raise ConfigError(f"the assignment must cover target layers 0..{self.n_target_layers - 1}")
        # As given (saved in manifests as they are): an int shared by every object, or one width per object.
        self.d_src, self.d_tgt, self.point = d_src, d_tgt, point
        self._widths = {name: (_width_of(d_src, name, self.objects), _width_of(d_tgt, name, self.objects))
                        for name in self.objects}
        self.inputs: dict[str, tuple[str, ...]] = _check_inputs(inputs, self.objects)
        reads_tokens = any(TOKEN_EMBEDDING in names for names in self.inputs.values())
        if reads_tokens != (token_identity is not None):
            raise ConfigError(f"token identity {token_identity!r} but the maps {'' if reads_tokens else 'do not '}read "
                              f"{TOKEN_EMBEDDING!r}")
        self.token_identity = token_identity
        self.token_module: nn.Module | None = None  # a `TokenIdentity`, attached for a loaded pair
        self.maps = nn.ParameterDict(
            {
                _key(name, t): nn.Parameter(torch.zeros(self._widths[name][1], len(src) * self._widths[name][0],
                                                        dtype=torch.float32))
                for name in self.objects
                for t, src in self.assignment[name].items()
            }
        )

    def widths(self, name: str) -> tuple[int, int]:
        """(features one map of object `name` reads per source layer, features it writes)."""
        return self._widths[name]

    @property
    def reads_own_objects(self) -> bool:
        """Every object's map reads the source object of its own name (the pair holds the same cache kinds)."""
        return all(self.inputs[name] == (name,) for name in self.objects)

    def weight(self, name: str, target_layer: int) -> torch.Tensor:
        """The map of one target layer and object: [d_tgt, ν·d_src] (this object's widths)."""
        return self.maps[_key(name, target_layer)]

    def set_weight(self, name: str, target_layer: int, value: torch.Tensor) -> None:
        with torch.no_grad():
            self.maps[_key(name, target_layer)].copy_(value.to(torch.float32))

    def source_layers(self) -> list[int]:
        """Every source layer some map reads (the rest need not be captured)."""
        return sorted({s for name in self.objects for src in self.assignment[name].values() for s in src})

    def source_objects(self) -> tuple[str, ...]:
        """Every source object some map reads, in first-use order."""
        return tuple(dict.fromkeys(o for name in self.objects for o in self.inputs[name]))

    def features(self, name: str, sources: Mapping[str, Mapping[int, torch.Tensor] | Sequence[torch.Tensor]],
                 layer: int) -> torch.Tensor:
        """What the map of object `name` reads from source layer `layer`: its input objects concatenated,
        [n_tokens, d_src of `name`]."""
        return source_features(sources, self.inputs[name], layer)

    def translate_layer(
        self, name: str, target_layer: int, sources: Mapping[str, Mapping[int, torch.Tensor] | Sequence[torch.Tensor]]
    ) -> torch.Tensor:
        """One target layer of object `name` from the source's objects (object name → tensors indexed by source
        layer, [n_tokens, width]; only the layers the map reads are needed) → [n_tokens, d_tgt] fp32."""
        features = [self.features(name, sources, s) for s in self.assignment[name][target_layer]]
        # cat copies even a single tensor: at ν = 1 that is one needless copy of the source layer per map.
        stacked = features[0] if len(features) == 1 else torch.cat(features, dim=-1)
        return stacked.to(torch.float32) @ self.weight(name, target_layer).T  # [n, ν·d_src] @ [ν·d_src, d_tgt]

    def with_token_embedding(
        self, sources: Mapping[str, Sequence[torch.Tensor]], token_ids: torch.Tensor | None = None
    ) -> Mapping[str, Sequence[torch.Tensor]]:
        """`sources` plus the `token_embedding` pseudo object when the maps read it ([n_tokens, d_model], the same
        for every source layer). token_ids: [n_tokens] ids of the translated tokens (the `ids` variant needs them).

        Raises:
            ConfigError: token identity not attached, or the ids variant without ids.
        """
        if self.token_identity is None or TOKEN_EMBEDDING in sources:
            return sources
        if self.token_module is None:
            raise ConfigError("this translator appends token identity: attach it for the loaded pair first "
                              "(translators.token_identity.attach_token_identity)")
        embedding = self.token_module.embed(self.token_module.ids(sources, token_ids))
        return {**sources, TOKEN_EMBEDDING: _EveryLayer(embedding)}

    def translate_objects(
        self, sources: Mapping[str, Sequence[torch.Tensor]], token_ids: torch.Tensor | None = None
    ) -> dict[str, list[torch.Tensor]]:
        """Translate a whole source capture: object name → list indexed by source layer of [n_tokens, width].

        Source objects no map reads are ignored. token_ids: [n_tokens], for token identity's `ids` variant.

        Returns:
            {name: list over target layers of [n_tokens, d_tgt] fp32} for every object in `self.objects`.
        Raises:
            ConfigError: an object the translator reads is missing from `sources`.
        """
        sources = self.with_token_embedding(sources, token_ids)
        missing = [name for name in self.source_objects() if name not in sources]
        if missing:
            raise ConfigError(f"the translator reads {', '.join(missing)} but the source capture holds {', '.join(sources)}")
        return {
            name: [self.translate_layer(name, t, sources) for t in range(self.n_target_layers)]
            for name in self.objects
        }

    def forward(self, *sources: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
        """Translate one list per source object, in `source_objects()` order (GQA: `translator(keys, values)`).

        Returns:
            One list over target layers of [n_tokens, d_tgt] fp32 tensors per object, in `self.objects` order.
        Raises:
            ConfigError: a number of lists other than the source objects the translator reads.
        """
        names = self.source_objects()
        if len(sources) != len(names):
            raise ConfigError(f"the translator reads {', '.join(names)}: pass one list per object, got {len(sources)}")
        return tuple(self.translate_objects(dict(zip(names, sources))).values())

    def flops_per_token(self) -> int:
        """Multiply-adds ×2 of all maps for one token (the switch-speed FLOP model)."""
        return sum(2 * p.numel() for p in self.maps.values())


def _check_objects(names: tuple[str, ...]) -> None:
    """Raises ConfigError for no objects or a name that cannot be part of a map name `<name>_<layer>`."""
    if not names:
        raise ConfigError("an assignment needs at least one cache object (e.g. 'keys' and 'values')")
    bad = [name for name in names if not isinstance(name, str) or not name.isidentifier()]
    if bad:
        raise ConfigError(f"cache object names must be identifiers (they name the maps), got {bad}")


class _EveryLayer:
    """One tensor that stands for every source layer (the token embedding is the same whatever layer a map
    reads)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.tensor


def source_features(
    sources: Mapping[str, Mapping[int, torch.Tensor] | Sequence[torch.Tensor]], names: Sequence[str], layer: int
) -> torch.Tensor:
    """Source objects `names` of one layer side by side: [n_tokens, Σ widths] (one object: that tensor)."""
    if len(names) == 1:
        return sources[names[0]][layer]
    return torch.cat([sources[name][layer] for name in names], dim=-1)


def _width_of(width: int | Mapping[str, int], name: str, objects: tuple[str, ...]) -> int:
    """One object's width from an int shared by all objects or a per-object mapping.

    Raises:
        ConfigError: a mapping that does not name exactly the translator's objects.
    """
    if isinstance(width, int):
        return width
    if set(width) != set(objects):
        raise ConfigError(f"widths are given for {sorted(width)}, the translator maps {list(objects)}")
    return int(width[name])


def _check_inputs(inputs: Mapping[str, Sequence[str]] | None, objects: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """{target object: source objects} with every object covered (default: each reads its own name).

    Raises:
        ConfigError: inputs for other objects than the translator's, or an object reading nothing.
    """
    if inputs is None:
        return {name: (name,) for name in objects}
    if set(inputs) != set(objects) or any(not inputs[name] for name in objects):
        raise ConfigError(f"inputs must name at least one source object for each of {list(objects)}, got {dict(inputs)}")
    return {name: tuple(inputs[name]) for name in objects}


def _key(name: str, target_layer: int) -> str:
    return f"{name}_{target_layer}"
