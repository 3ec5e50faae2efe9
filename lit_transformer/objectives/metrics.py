"""Losses and metrics shared by the objectives: token cross-entropy, exact token averages
across batches and ranks, corpus BLEU from summed statistics and bits per byte. (The peak
FLOP/s table that model FLOPs utilisation is measured against is in training/throughput.py.)

Shape legend: N predicted positions, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torchmetrics import Metric

IGNORE_INDEX = -100  # the collators' "not predicted" label (PyTorch's cross_entropy default)


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (N, V), labels (N,) with IGNORE_INDEX skipped -> (loss_sum, nll_sum, count).

    `loss_sum` is what training minimises: with smoothing eps, (1 - eps) * nll + eps * the
    mean of -log p over the vocabulary (Szegedy et al. 2016, 7; F.cross_entropy's definition),
    plus z_loss * log(Z)^2 per predicted token, Z the softmax normaliser (PaLM's auxiliary loss,
    Chowdhery et al. 2022, section 5).
    `nll_sum` (detached) is the plain negative log-likelihood that perplexity is made of.
    Sums, not means, so that averages over many batches weigh every token once.
    """
    logits = logits.float()  # bf16 log-softmax over a large vocabulary loses the small probabilities
    keep = labels != IGNORE_INDEX  # (N,)
    count = keep.sum()
    if label_smoothing == 0.0:
        nll_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        loss_sum = nll_sum
    else:
        log_probs = logits.log_softmax(-1)  # (N, V), once for both terms
        nll = -log_probs.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1)  # (N,)
        uniform = -log_probs.mean(-1)  # (N,)
        nll_sum = (nll * keep).sum()
        loss_sum = (1.0 - label_smoothing) * nll_sum + label_smoothing * (uniform * keep).sum()
    if z_loss:
        loss_sum = loss_sum + z_loss * (logits.logsumexp(-1).square() * keep).sum()  # (N,) summed
    return loss_sum, nll_sum.detach(), count


def bits_per_byte(loss_nats_per_token: float | torch.Tensor, bytes_per_token: float) -> float | torch.Tensor:
    """Nats per token -> bits per UTF-8 byte of the text: comparable across tokenizers (a tensor
    stays a tensor: no host sync on a training step)."""
    return loss_nats_per_token / math.log(2) / bytes_per_token


class TokenAverage(Metric):
    """sum(values) / sum(counts) over every batch and rank: the exact per-token mean, not a
    mean of batch means (batches with more predicted tokens weigh more)."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, total: torch.Tensor, count: torch.Tensor) -> None:
        self.total += total.detach().to(self.total.dtype)
        self.count += count.detach().to(self.count.dtype)

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp(min=1)


class CorpusBLEU(Metric):
    """Corpus BLEU (Papineni et al. 2002) with sacrebleu's tokenisation and exp smoothing.
    Corpus BLEU depends on the corpus only through n-gram match counts and lengths, so those
    are summed over batches and ranks and the score is computed once from the sums: equal to
    sacrebleu.corpus_bleu on the whole corpus."""

    full_state_update = False

    def __init__(self, max_ngram_order: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.order = max_ngram_order
        self.add_state("correct", default=torch.zeros(max_ngram_order, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros(max_ngram_order, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("lengths", default=torch.zeros(2, dtype=torch.float64), dist_reduce_fx="sum")  # sys, ref

    def update(self, hypotheses: list[str], references: list[str]) -> None:
        from sacrebleu.metrics import BLEU

        if not hypotheses:
            return
        score = BLEU(max_ngram_order=self.order).corpus_score(hypotheses, [references])
        self.correct += torch.tensor(score.counts, dtype=torch.float64, device=self.correct.device)
        self.total += torch.tensor(score.totals, dtype=torch.float64, device=self.total.device)
        self.lengths += torch.tensor([score.sys_len, score.ref_len], dtype=torch.float64, device=self.lengths.device)

    def compute(self) -> torch.Tensor:
        """The score in [0, 100]; NaN when no reference was seen (on any rank)."""
        from sacrebleu.metrics import BLEU

        if self.lengths[1] == 0:
            return torch.tensor(float("nan"), dtype=torch.float64)
        score = BLEU.compute_bleu(
            [int(c) for c in self.correct.tolist()],
            [int(t) for t in self.total.tolist()],
            int(self.lengths[0]),
            int(self.lengths[1]),
            smooth_method="exp",
            max_ngram_order=self.order,
        )
        return torch.tensor(score.score, dtype=torch.float64)
