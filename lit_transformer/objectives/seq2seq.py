"""Encoder-decoder training: T5 span corruption (Raffel et al. 2020, 3.1.4) and supervised
source -> target pairs (Vaswani et al. 2017's translation task). Both are teacher-forced
cross-entropy over the decoder labels; the collator builds decoder_input_ids (labels shifted
right behind the start token) and marks padding in the labels with IGNORE_INDEX.

For supervised pairs the validation can also decode validation sentences (by default the
first 500: the whole split when it is small) with the recipe's beam settings and report corpus
BLEU (Papineni et al. 2002) with sacrebleu, given a `detokenize` function.

Shape legend: B batch, S source length, T target length, G generated length, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal, Unpack

import torch

from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.objectives.fused_loss import linear_cross_entropy
from lit_transformer.objectives.metrics import IGNORE_INDEX, CorpusBLEU, TokenAverage, token_cross_entropy
from lit_transformer.objectives.objective_base import ObjectiveBase, ObjectiveOptions, as_language_model
from lit_transformer.recipe.registry import implements
from lit_transformer.recipe.schema import OptimConfig, RunConfig
from lit_transformer.training.distributed import eager_outside_the_step, gathered_parameters

Task = Literal["span", "seq2seq"]


@implements("span", "seq2seq")
class Seq2SeqLM(ObjectiveBase):
    compiles_whole_step = True  # its losses go through loss_terms

    def __init__(
        self,
        model: TransformerConfig | LanguageModel | dict,
        optim: OptimConfig | dict | None = None,
        max_steps: int | None = None,
        *,
        task: Task = "seq2seq",
        bytes_per_token: float | None = None,
        bleu: bool = False,
        detokenize: Callable[[list[int]], str] | None = None,
        bleu_max_batches: int | None = 4,
        bleu_max_sentences: int | None = None,
        generate_kwargs: dict[str, Any] | None = None,
        **options: Unpack[ObjectiveOptions],
    ):
        """`task` only documents the run (hparams); the loss is the same.
        `bleu`: decode the first `bleu_max_sentences` sentences of the first `bleu_max_batches`
        validation batches (None: no limit) with `generate(**generate_kwargs)`
        (max_new_tokens, num_beams, eos_token_id, pad_token_id, decoder_start_token_id, ...)
        and log corpus BLEU of `detokenize(ids)` against the labels.
        `detokenize` is a function, so it is not saved in the hyperparameters: pass it again to
        load_from_checkpoint."""
        if task not in ("span", "seq2seq"):
            raise ValueError(f"task={task!r} is not one of ['span', 'seq2seq']")
        if bleu and task != "seq2seq":
            raise ValueError("bleu is for supervised pairs (task='seq2seq'), not span corruption")
        if bleu and detokenize is None:
            raise ValueError("bleu=True needs detokenize: a function from token ids to text")
        _check_generate_kwargs(generate_kwargs or {})
        lm = as_language_model(model)
        if lm.config.arch != "encoder_decoder":
            raise ValueError(f"Seq2SeqLM needs model.arch='encoder_decoder', not {lm.config.arch!r}")
        hparams = {
            "model": lm.config.to_dict(),
            "task": task,
            "bytes_per_token": bytes_per_token,
            "bleu": bleu,
            "bleu_max_batches": bleu_max_batches,
            "bleu_max_sentences": bleu_max_sentences,
            "generate_kwargs": dict(generate_kwargs or {}),
        }
        super().__init__(
            model_config=lm.config,
            optim=optim,
            max_steps=max_steps,
            bytes_per_token=bytes_per_token,
            hparams=hparams,
            **options,
        )
        self.model = lm
        self.task = task
        self.bleu = bleu
        self.detokenize = detokenize
        self.bleu_max_batches = bleu_max_batches
        self.bleu_max_sentences = bleu_max_sentences
        self._bleu_count = 0  # sentences this rank decoded in the current validation
        self.generate_kwargs = {"max_new_tokens": 64, **(generate_kwargs or {})}
        self.eval_metrics["loss"] = TokenAverage()
        self.eval_metrics["token_accuracy"] = TokenAverage()
        if bleu:
            self.eval_metrics["bleu"] = CorpusBLEU()

    @property
    def objective_name(self) -> str:
        return self.task

    @classmethod
    def from_recipe(cls, name: str, cfg: RunConfig, model: TransformerConfig | LanguageModel, data: Any):
        """`name` is the task; seq2seq decodes objective.bleu_sentences validation sentences for
        BLEU with objective.num_beams and objective.length_penalty (GNMT's alpha)."""
        bleu: dict[str, Any] = {}
        if name == "seq2seq" and cfg.objective.bleu:
            tokenizer, special = data.tokenizer, data.special_tokens
            beams = (
                dict(
                    num_beams=cfg.objective.num_beams,
                    length_penalty=cfg.objective.length_penalty,
                    length_normalization="gnmt",
                )
                if cfg.objective.num_beams > 1
                else {}
            )
            bleu = dict(
                bleu=True,
                detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                bleu_max_batches=cfg.objective.bleu_batches,
                bleu_max_sentences=cfg.objective.bleu_sentences,
                generate_kwargs=dict(
                    max_new_tokens=cfg.data.max_target_length,
                    eos_token_id=special.eos_id,
                    pad_token_id=special.pad_id or 0,
                    decoder_start_token_id=special.decoder_start_id,
                    **beams,
                ),
            )
        return cls(model, task=name, bytes_per_token=data.bytes_per_token, **bleu, **cls.recipe_options(cfg))

    @classmethod
    def from_hparams(cls, hparams: dict[str, Any], **overrides: Any):
        # BLEU needs a detokenize function, which hyperparameters cannot hold: off unless given
        return cls(**{**hparams, "bleu": False, **overrides})

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoder_input_ids: torch.Tensor,
        decoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced decoder logits (B, T, V)."""
        return self.model(
            input_ids,
            attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss_sum, nll_sum, count, correct = self._terms(batch, self.optim.label_smoothing, self.optim.z_loss)
        n = self.token_normalizer(count)
        mask = batch.get("attention_mask")
        source_tokens = mask.sum() if mask is not None else batch["input_ids"].numel()
        return self.finish_training_step(
            loss_sum / n,
            nll_sum / n,
            batch,
            flop_tokens=source_tokens,
            head_positions=count,
            metrics={"token_accuracy": correct / n},
        )

    def on_validation_epoch_start(self) -> None:
        self._gather_for_bleu()

    def on_validation_epoch_end(self) -> None:
        try:
            super().on_validation_epoch_end()
        finally:
            self._release_gathered()

    def on_test_epoch_start(self) -> None:  # the test split decodes BLEU as validation does
        self._gather_for_bleu()

    def on_test_epoch_end(self) -> None:
        try:
            super().on_test_epoch_end()
        finally:
            self._release_gathered()

    def _gather_for_bleu(self) -> None:
        if self.bleu:
            # ranks decode their own batches for different numbers of steps: under FSDP2 the
            # whole model is gathered for the epoch instead of per block in each forward
            self._gathered = contextlib.ExitStack()
            self._gathered.enter_context(gathered_parameters(self))

    def _release_gathered(self) -> None:
        if getattr(self, "_gathered", None) is not None:
            self._gathered.close()
            self._gathered = None

    def eval_update(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        _, nll_sum, count, correct = self._terms(batch, 0.0)
        self.eval_metrics["loss"].update(nll_sum, count)
        self.eval_metrics["token_accuracy"].update(correct, count)
        if batch_idx == 0:
            self._bleu_count = 0
        rows = self._bleu_rows(batch_idx, batch["input_ids"].shape[0])
        if rows:
            hypotheses, references = self.translate(
                {k: v[:rows] if torch.is_tensor(v) else v for k, v in batch.items()}
            )
            self.eval_metrics["bleu"].update(hypotheses, references)
            self._bleu_count += rows

    def eval_compute(self) -> dict[str, float]:
        out = self.lm_eval_metrics(self.eval_metrics["loss"].compute())
        out["token_accuracy"] = float(self.eval_metrics["token_accuracy"].compute())
        if self.bleu:
            # compute on every rank (it gathers the sums), then keep it only if any batch was decoded
            bleu = float(self.eval_metrics["bleu"].compute())
            if bleu == bleu:
                out["bleu"] = bleu
        return out

    def _bleu_rows(self, batch_idx: int, batch_size: int) -> int:
        """How many of this batch's sentences to decode for BLEU: the rank's share of
        bleu_max_sentences not yet decoded, in the first bleu_max_batches batches."""
        if not self.bleu or (self.bleu_max_batches is not None and batch_idx >= self.bleu_max_batches):
            return 0
        if self.bleu_max_sentences is None:
            return batch_size
        world = self.trainer.world_size if self._trainer is not None else 1
        share = -(-self.bleu_max_sentences // world)  # ceil: the ranks together decode at least the limit
        return max(0, min(batch_size, share - self._bleu_count))

    def translate(self, batch: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Decode the batch's sources; (hypotheses, references) as detokenized text."""
        from lit_transformer.model.generate import generate

        with eager_outside_the_step(self):  # decoding shapes change every step: not the compiled step's
            out = generate(self.model, batch["input_ids"], batch.get("attention_mask"), **self.generate_kwargs)
        eos = self.generate_kwargs.get("eos_token_id")
        stop = set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
        hypotheses = [self.detokenize(_until(row, stop)) for row in out[:, 1:].tolist()]  # (B, G): drop the start
        references = [
            self.detokenize(_until([t for t in row if t != IGNORE_INDEX], stop)) for row in batch["labels"].tolist()
        ]
        return hypotheses, references

    def _terms(self, batch, label_smoothing: float, z_loss: float = 0.0):
        return self.loss_terms(seq2seq_terms, batch, label_smoothing, fused=self.fuse_head_and_loss(), z_loss=z_loss)


def seq2seq_terms(
    model: LanguageModel, batch: dict[str, torch.Tensor], label_smoothing: float, *, fused: bool, z_loss: float = 0.0
):
    """(loss sum, NLL sum, target count, correct predictions) of teacher-forced decoding; the
    head and the loss run fused when `fused` (training with a plain head weight). The loss sum
    holds the label smoothing and the z-loss (metrics.token_cross_entropy)."""
    labels = batch["labels"]  # (B, T)
    if fused:
        features = model.head_features(
            batch["input_ids"],
            batch.get("attention_mask"),
            decoder_input_ids=batch["decoder_input_ids"],
            decoder_attention_mask=batch.get("decoder_attention_mask"),
        )  # (B, T, C)
        decoder = model.lm_head.decoder
        return linear_cross_entropy(
            features.flatten(0, 1), decoder.weight, decoder.bias, labels.reshape(-1), label_smoothing, z_loss=z_loss
        )
    logits = model(
        batch["input_ids"],
        batch.get("attention_mask"),
        decoder_input_ids=batch["decoder_input_ids"],
        decoder_attention_mask=batch.get("decoder_attention_mask"),
    )  # (B, T, V)
    V = logits.shape[-1]
    flat_logits, flat_labels = logits.reshape(-1, V), labels.reshape(-1)  # (B*T, V), (B*T,)
    loss_sum, nll_sum, count = token_cross_entropy(flat_logits, flat_labels, label_smoothing, z_loss)
    correct = ((flat_logits.detach().argmax(-1) == flat_labels) & (flat_labels != IGNORE_INDEX)).sum()
    return loss_sum, nll_sum, count, correct


def _check_generate_kwargs(kwargs: dict[str, Any]) -> None:
    import inspect

    from lit_transformer.errors import closest
    from lit_transformer.model.config import ConfigError
    from lit_transformer.model.generate import generate

    valid = [
        name for name in inspect.signature(generate).parameters if name not in ("model", "input_ids", "attention_mask")
    ]
    for key in kwargs:
        if key not in valid:
            raise ConfigError(f"unknown generate_kwargs key {key!r}{closest(key, valid)}")


def _until(ids: list[int], stop: set[int]) -> list[int]:
    """Token ids up to (not including) the first stop id."""
    for i, token in enumerate(ids):
        if token in stop:
            return ids[:i]
    return ids
