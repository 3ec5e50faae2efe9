"""What generation is asked for (GenerationConfig) and the per-step pieces of choosing a token:
left padding of decoder prompts, positions from the attention mask, top-k / top-p filtering and
sampling. generate.py runs the loop and beam search.

Shape legend: B prompts, R rows the model sees, T prompt length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """Everything `generate` needs besides the model and the prompts; validated on creation."""

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    num_beams: int = 1
    length_penalty: float = 1.0  # the exponent alpha of the length normalisation below
    # "power": score = sum log p / length ** alpha (HF's convention); "gnmt": divided by
    # ((5 + length) / 6) ** alpha (Wu et al. 2016, eq. 14), the penalty Vaswani et al. 2017 used
    # with alpha = 0.6 (section 6.1)
    length_normalization: Literal["power", "gnmt"] = "power"
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int = 0
    decoder_start_token_id: int | None = None  # encoder-decoder only; None: pad_token_id (T5)
    use_cache: bool = True
    # decoder-only: the prompt attends bidirectionally (UniLM / prefix LM), the new tokens causally
    bidirectional_prompt: bool = False
    # On a CUDA device, decoding replays the single-token step as a CUDA graph
    # (graph_step.py): a small model's step is bound by launching its kernels from the host.
    cuda_graph: bool = True

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be a positive integer")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be positive")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be at least 1")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.num_beams < 1:
            raise ValueError(f"num_beams={self.num_beams} must be at least 1")
        if self.length_normalization not in ("power", "gnmt"):
            raise ValueError(f"length_normalization={self.length_normalization!r} is not one of ['power', 'gnmt']")
        if self.num_beams > 1 and self.do_sample:
            raise ValueError(
                "beam search is deterministic here: use num_beams=1 with do_sample=True, "
                "or do_sample=False with num_beams>1"
            )

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if (
            isinstance(self.eos_token_id, Sequence)
            or isinstance(self.eos_token_id, torch.Tensor)
            and self.eos_token_id.dim() > 0
        ):
            return [int(i) for i in self.eos_token_id]
        return [int(self.eos_token_id)]


def left_pad(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int):
    """Move each row's real tokens to the right end, keeping their order: (B, T) -> (B, T), (B, T).
    Works for right-, left- or already-left-padded prompts."""
    mask = attention_mask.bool()
    order = torch.argsort(mask.long(), dim=1, stable=True)  # padding (0) first, real tokens (1) after
    mask = mask.gather(1, order)
    return input_ids.gather(1, order).masked_fill(~mask, pad_token_id), mask


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of every real token counted from the row's first real token; padding gets 0."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # (B, T)


def filter_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Temperature, then top-k, then nucleus (Holtzman et al. 2020) filtering: (R, V) -> (R, V)
    with removed tokens at -inf. top_p keeps the smallest set of most likely tokens whose
    probability reaches p; the most likely token is always kept."""
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (R, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # 0 for the top token, so it always survives
        remove_sorted = mass_before >= top_p
        remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)  # back to vocab order
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row (R, V) -> (R,): argmax, or a draw from the filtered distribution."""
    if not config.do_sample:
        return logits.argmax(-1)
    probs = filter_logits(logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
