"""The machinery of the transformers checkpoint maps: a `Rule` pairs transformers tensor names
with core parameter names (and converts the tensors both ways), a `Family` says how a family's
config.json reads into a TransformerConfig and back; the helpers the family maps share.
import_maps.py holds the four families' maps, directories.py the file I/O.

GPT-2's Conv1D stores its weight as (in, out), the transpose of nn.Linear's (out, in).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lit_transformer.model.config import TransformerConfig


class InteropError(ValueError):
    """A checkpoint or config cannot be mapped; the message names the path, key or field."""


@dataclass(frozen=True)
class Rule:
    """One transformers tensor <-> one or more core parameters.

    hf: names in a transformers checkpoint. Import reads the first one present; the others are
        tied aliases of the same tensor that a checkpoint may also hold. Export writes the first.
    core: core parameter names the tensor becomes.
    kind: copy | transpose (Conv1D) | split3 (fused q|k|v bias) | split3_transpose (fused
        Conv1D q|k|v weight) | zeros (export only: a tensor the core does not have).
    """

    hf: tuple[str, ...]
    core: tuple[str, ...]
    kind: str = "copy"
    shape: tuple[int, ...] = ()  # for kind="zeros"
    write_all: bool = False  # export under every name in `hf`, not only the first

    @property
    def written(self) -> tuple[str, ...]:
        return self.hf if self.write_all else self.hf[:1]


def to_core(rule: Rule, tensor: torch.Tensor) -> list[torch.Tensor]:
    if rule.kind == "copy":
        return [tensor]
    if rule.kind == "transpose":
        return [tensor.t()]  # (in, out) -> (out, in)
    if rule.kind == "split3":
        return list(tensor.chunk(3, dim=0))  # (3C,) -> 3 x (C,)
    if rule.kind == "split3_transpose":
        return list(tensor.t().chunk(3, dim=0))  # (C, 3C) -> (3C, C) -> 3 x (C, C)
    raise InteropError(f"rule kind {rule.kind!r} cannot be imported (tensor {rule.hf[0]})")


def to_hf(rule: Rule, tensors: list[torch.Tensor]) -> torch.Tensor:
    if rule.kind == "copy":
        return tensors[0]
    if rule.kind == "transpose":
        return tensors[0].t()  # (out, in) -> (in, out)
    if rule.kind == "split3":
        return torch.cat(tensors, dim=0)  # 3 x (C,) -> (3C,)
    if rule.kind == "split3_transpose":
        return torch.cat(tensors, dim=0).t()  # 3 x (C, C) -> (3C, C) -> (C, 3C)
    if rule.kind == "zeros":
        return torch.zeros(rule.shape)
    raise InteropError(f"unknown rule kind {rule.kind!r}")


def linear_rules(hf: str, core: str, bias: bool, kind: str = "copy") -> list[Rule]:
    rules = [Rule((f"{hf}.weight",), (f"{core}.weight",), kind)]
    if bias:
        rules.append(Rule((f"{hf}.bias",), (f"{core}.bias",)))
    return rules


def embedding_and_head_rules(
    cfg: TransformerConfig, embedding: tuple[str, ...], head_weight: str, head: bool
) -> list[Rule]:
    """Tied: the head's weight is one more alias of the token embedding (read if present,
    never written: transformers re-ties it). Untied: a tensor of its own."""
    if cfg.tie_embeddings:
        return [Rule((*embedding, head_weight), ("transformer.tokens.weight",))]
    rules = [Rule(embedding, ("transformer.tokens.weight",))]
    if head:
        rules.append(Rule((head_weight,), ("lm_head.decoder.weight",)))
    return rules


def hf_value(hf: dict[str, Any], key: str, default: Any) -> Any:
    value = hf.get(key)
    return default if value is None else value


def require(cfg: TransformerConfig, family: str, **expected: Any) -> None:
    """Export check: every listed core field must hold the value the family hard-codes."""
    for name, want in expected.items():
        have = getattr(cfg, name)
        if have != want:
            raise InteropError(
                f"cannot export to transformers {family}: model.{name}={have!r}, but {family} always has {want!r}"
            )


def require_standard_heads(cfg: TransformerConfig, family: str) -> None:
    if cfg.kv_heads != cfg.n_heads:
        raise InteropError(
            f"cannot export to transformers {family}: model.n_kv_heads={cfg.n_kv_heads} "
            f"(grouped-query attention); {family} has one key/value head per query head"
        )
    if cfg.dim_per_head * cfg.n_heads != cfg.d_model:
        raise InteropError(
            f"cannot export to transformers {family}: model.head_dim={cfg.head_dim} "
            f"is not d_model / n_heads = {cfg.d_model // cfg.n_heads}"
        )


def lookup(table: dict[str, str], value: str, what: str) -> str:
    if value not in table:
        raise InteropError(f"{what}={value!r} has no lit-transformer equivalent; supported: {sorted(table)}")
    return table[value]


# transformers ACT2FN names -> core activations. gelu_new, gelu_pytorch_tanh and gelu_fast are
# all the tanh approximation (Hendrycks & Gimpel 2016, section 2); gelu_python is the exact erf form.
PLAIN_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}
EXPORT_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}


@dataclass(frozen=True)
class Family:
    name: str  # for messages
    model_type: str
    architectures: dict[str, bool]  # transformers class -> whether its checkpoint holds the LM head
    export_architecture: str
    prefix: str  # base-model prefix; a bare base-model checkpoint has its keys without it
    embedding: str  # token embedding's name (with prefix), to decide tying as transformers does
    head_weight: str  # LM head weight's name, tied to `embedding` when the config says so
    head_prefixes: tuple[str, ...]  # names belonging to the LM head (detects a headless checkpoint)
    ignored: tuple[str, ...]  # regexes of tensors knowingly dropped
    config_from_hf: Callable[[dict[str, Any], bool], TransformerConfig]  # (config.json, has LM head)
    config_to_hf: Callable[[TransformerConfig], dict[str, Any]]
    rules: Callable[[TransformerConfig, bool], list[Rule]]
    ignored_note: str = ""  # why the ignored tensors may be dropped

    def is_ignored(self, name: str) -> bool:
        return any(re.fullmatch(pattern, name) for pattern in self.ignored)
