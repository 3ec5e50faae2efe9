"""Multi-task pretraining: one LanguageModel trained on a mixture of tasks (UniLM, Dong et al.
2019; UL2, Tay et al. 2022; T5's mixtures, Raffel et al. 2020, 3.5; GPT-BERT, Charpentier and
Samuel 2024). With step mixing every training batch belongs to one task (batch["task"], the
data module's MixtureBatchSampler draws one task per optimizer step, the same on every rank);
the loss is that task's objective, computed by the same functions the single objectives use,
so a mixture of one task trains exactly as the single objective does. With row mixing
(mixture.mixing=row) a batch stacks rows of every task of a decoder (batch["row_task"] (B,)):
its loss is the sum of each task's terms over its rows divided by the batch's target count
(row_loss.py), so every target weighs as in its single objective. The attention mode travels
with the batch: a decoder's rows carry prefix_lengths (0 causal, p prefix, T bidirectional),
and a batch without them keeps SDPA's fused causal path.

Logged per task (besides the mixture's train/loss, train/lr, ...):
  train/<task>/loss, train/<task>/ppl, train/<task>/bpb (clm and prefix_lm tasks: their loss
  predicts the text in order, recipe.tasks' predicts_text_in_order), train/<task>/accuracy
  (mlm, mntp: masked tokens; encoder-decoder tasks: target tokens), on the steps that task
  trains (row mixing: every step, from its own rows);
  train/<task>/step_share, train/<task>/token_share: its share of the micro-batches (row
  mixing: of the rows) and of the input tokens so far (saved in checkpoints, so a resumed run
  goes on counting);
  val/<task>/loss, ppl, bpb, masked_accuracy or token_accuracy, as the single objectives name them
  (test/<task>/... likewise, on the test split).

Shape legend: B batch, T length.
"""

from __future__ import annotations

import math
from typing import Any, Unpack

import torch

from lit_transformer.errors import closest
from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.objectives.causal_lm import causal_terms
from lit_transformer.objectives.masked_lm import masked_terms
from lit_transformer.objectives.metrics import TokenAverage, bits_per_byte
from lit_transformer.objectives.objective_base import ObjectiveBase, ObjectiveOptions, as_language_model
from lit_transformer.objectives.row_loss import row_terms
from lit_transformer.objectives.seq2seq import seq2seq_terms
from lit_transformer.recipe.registry import MIXTURE, implements
from lit_transformer.recipe.schema import OptimConfig, RunConfig
from lit_transformer.recipe.tasks import TASK_OBJECTIVES
from lit_transformer.training.throughput import non_pad_tokens

# the accuracy each task objective reports, named as its single objective names it
_ACCURACY = {"mlm": "masked_accuracy", "mntp": "masked_accuracy", "span": "token_accuracy", "seq2seq": "token_accuracy"}
# task objectives whose loss covers the masked tokens that their labels name (masked_terms)
_MASKED = ("mlm", "mntp")


@implements(MIXTURE)
class MultiTaskLM(ObjectiveBase):
    compiles_whole_step = True  # its losses go through loss_terms

    def __init__(
        self,
        model: TransformerConfig | LanguageModel | dict,
        tasks: list[dict[str, Any]],
        optim: OptimConfig | dict | None = None,
        max_steps: int | None = None,
        *,
        bytes_per_token: list[float | None] | None = None,
        **options: Unpack[ObjectiveOptions],
    ):
        """`tasks`: [{"name": ..., "objective": mlm | clm | prefix_lm | mntp | span | seq2seq}] in the
        data module's order (batch["task"] indexes it). `bytes_per_token`: each task's
        validation bytes per token (None where it has no validation split), for bits per byte."""
        lm = as_language_model(model)
        tasks = [{"name": str(t["name"]), "objective": str(t["objective"])} for t in tasks]
        if not tasks:
            raise ValueError("a mixture needs at least one task")
        per_task = list(bytes_per_token) if bytes_per_token is not None else [None] * len(tasks)
        if len(per_task) != len(tasks):
            raise ValueError(f"bytes_per_token has {len(per_task)} entries for {len(tasks)} tasks")
        hparams = {"model": lm.config.to_dict(), "tasks": tasks, "bytes_per_token": per_task}
        super().__init__(model_config=lm.config, optim=optim, max_steps=max_steps, hparams=hparams, **options)
        self.model = lm
        self.tasks = tasks
        self.task_bytes_per_token = per_task
        self._task_bpb = self._bits_per_byte_denominators(per_task)
        self.encoder_decoder = lm.config.arch == "encoder_decoder"
        for task in tasks:
            self.eval_metrics[_key(task, "loss")] = TokenAverage()
            if self._accuracy_name(task) is not None:
                self.eval_metrics[_key(task, self._accuracy_name(task))] = TokenAverage()
        # micro-batches and input tokens each task has trained on (global over ranks)
        self.task_batches = [0] * len(tasks)
        self.task_tokens = [0.0] * len(tasks)
        # a row-mixed step's detached loss terms per task, until a logging step writes them
        self.unwritten_row_terms: list[list[torch.Tensor]] | None = None

    @classmethod
    def from_recipe(cls, name: str, cfg: RunConfig, model: TransformerConfig | LanguageModel, data: Any):
        """The recipe's tasks in order; `data` is the MixtureDataModule."""
        tasks = [{"name": t.name, "objective": t.objective} for t in cfg.tasks]
        bytes_per_token = [data.bytes_per_token_of(i) for i in range(len(tasks))]
        return cls(model, tasks, bytes_per_token=bytes_per_token, **cls.recipe_options(cfg))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: torch.Tensor
    ) -> torch.Tensor:
        """The language model's logits; keyword inputs (prefix_lengths, decoder_input_ids, ...) pass through."""
        return self.model(input_ids, attention_mask, **kwargs)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor | None:
        if "row_task" in batch:
            return self._row_training_step(batch)
        index = int(batch["task"])
        task = self.tasks[index]
        loss_sum, nll_sum, count, correct = self._terms(task, batch, self.optim.label_smoothing, self.optim.z_loss)
        n = self.token_normalizer(count)
        mask = batch.get("attention_mask")
        tokens = mask.sum() if mask is not None else batch["input_ids"].numel()
        metrics = {"accuracy": correct / n} if self._accuracy_name(task) is not None else {}
        if self._trainer is not None:
            self._count_shares({index: (1, self._input_tokens(batch))})
        return self.finish_training_step(
            loss_sum / n,
            nll_sum / n,
            batch,
            flop_tokens=tokens,
            head_positions=count,
            metrics=metrics,
            task=task["name"],
            task_bytes_per_token=self._task_bpb[index],
        )

    def _row_training_step(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """A batch of every task's rows (mixture.mixing=row): one loss over all their targets."""
        accuracy = [self._accuracy_name(task) is not None for task in self.tasks]
        fused = self.fuse_head_and_loss()
        terms = self.loss_terms(
            row_terms, batch, self.optim.label_smoothing, fused=fused, accuracy=accuracy, z_loss=self.optim.z_loss
        )
        count = sum(term[2] for term in terms)
        n = self.token_normalizer(count)
        if self._trainer is not None:
            self.unwritten_row_terms = [[value.detach() for value in term] for term in terms]
            owner, mask = batch["row_task"], batch["attention_mask"]
            self._count_shares(
                {t: (int((owner == t).sum()), float(mask[owner == t].sum())) for t in range(len(self.tasks))}
            )
        return self.finish_training_step(
            sum(term[0] for term in terms) / n,
            sum(term[1] for term in terms) / n,
            batch,
            flop_tokens=batch["attention_mask"].sum(),
            head_positions=count,
        )

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.eval_update(batch, batch_idx)

    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.eval_update(batch, batch_idx)

    def eval_update(self, batch: dict[str, Any], batch_idx: int) -> None:
        task = self.tasks[int(batch["task"])]
        _, nll_sum, count, correct = self._terms(task, batch, 0.0)
        self.eval_metrics[_key(task, "loss")].update(nll_sum, count)
        accuracy = self._accuracy_name(task)
        if accuracy is not None:
            self.eval_metrics[_key(task, accuracy)].update(correct, count)

    def eval_compute(self) -> dict[str, float]:
        """{"<task>/loss", "<task>/ppl", "<task>/bpb" (in-order tasks), "<task>/<accuracy>"} for every task that
        saw evaluation batches on any rank. Every rank computes every metric (each compute is a
        collective: a rank that skipped a task its peer saw would hang both), and the tasks'
        global batch counts decide what is reported."""
        for metric in self.eval_metrics.values():  # the same update count everywhere: the same syncs
            metric.update(torch.zeros((), device=self.device), torch.zeros((), device=self.device))
        counts = torch.stack([self.eval_metrics[_key(t, "loss")].count for t in self.tasks])  # (tasks,)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            counts = counts.clone()
            torch.distributed.all_reduce(counts)
        out: dict[str, float] = {}
        for index, task in enumerate(self.tasks):
            loss = float(self.eval_metrics[_key(task, "loss")].compute())
            accuracy = self._accuracy_name(task)
            value = float(self.eval_metrics[_key(task, accuracy)].compute()) if accuracy is not None else None
            if float(counts[index]) == 0:
                continue
            out.update({f"{task['name']}/{k}": v for k, v in self.lm_eval_metrics(loss, self._task_bpb[index]).items()})
            if value is not None:
                out[f"{task['name']}/{accuracy}"] = value
        return out

    def evaluation_streams(
        self, data: Any, task: str | None = None, split: str = "validation"
    ) -> list[tuple[str, Any]]:
        """(prefix, batches of `split`) per task that has the split, for `evaluate`: "<task>/"
        before each metric, or, for one task, no prefix (the single objective's keys)."""
        names = [t["name"] for t in self.tasks]
        if task is not None and task not in names:
            raise KeyError(f"--task {task}: the mixture's tasks are {names}{closest(task, names)}")
        tasks, loaders = (
            (data.val_tasks, data.val_dataloader())
            if split == "validation"
            else (data.test_tasks, data.test_dataloader())
        )
        return [
            ("" if task is not None else f"{names[index]}/", loader)
            for index, loader in zip(tasks, loaders)
            if task is None or names[index] == task
        ]

    def measure_bytes_on(self, data: Any, split: str) -> None:
        self._task_bpb = self._bits_per_byte_denominators(
            [data.bytes_per_token_of(i, split) for i in range(len(self.tasks))]
        )

    def bytes_state(self) -> list[float | None]:
        """Each task's bytes per token for bits per byte (None where it means nothing)."""
        return list(self._task_bpb)

    def restore_bytes_state(self, state: list[float | None]) -> None:
        self._task_bpb = list(state)

    # ------------------------------------------------------------------ internals
    def _terms(self, task: dict[str, str], batch: dict[str, Any], label_smoothing: float, z_loss: float = 0.0):
        """(loss sum, NLL sum, target count, correct predictions) of the task's objective."""
        objective = task["objective"]
        if objective in _MASKED:  # mntp's collator put each target at the position before its token
            return self.loss_terms(masked_terms, batch, label_smoothing, z_loss=z_loss)
        fused = self.fuse_head_and_loss()
        if self.encoder_decoder:  # span, seq2seq, and prefix LM as encode-the-prefix, decode-the-rest
            return self.loss_terms(seq2seq_terms, batch, label_smoothing, fused=fused, z_loss=z_loss)
        loss_sum, nll_sum, count = self.loss_terms(
            causal_terms, batch, label_smoothing, fused=fused, z_loss=z_loss
        )  # clm, prefix_lm
        return loss_sum, nll_sum, count, torch.zeros((), device=count.device)

    def _bits_per_byte_denominators(self, per_task: list[float | None]) -> list[float | None]:
        """Each task's bytes per token where its bits per byte means something, else None."""
        return [
            b if TASK_OBJECTIVES[t["objective"]].predicts_text_in_order else None for t, b in zip(self.tasks, per_task)
        ]

    def _accuracy_name(self, task: dict[str, str]) -> str | None:
        if task["objective"] in _MASKED:
            return _ACCURACY[task["objective"]]
        return _ACCURACY["seq2seq"] if self.encoder_decoder else None

    def write_step_metrics(self) -> None:
        """The shared step metrics, then a row-mixed step's per-task values and every task's
        shares. Called on the same steps on every rank: _log_row_tasks all-reduces."""
        super().write_step_metrics()
        if self.unwritten_row_terms is not None:
            self._log_row_tasks(self.unwritten_row_terms)
            self.unwritten_row_terms = None
        all_batches, all_tokens = max(sum(self.task_batches), 1), max(sum(self.task_tokens), 1.0)
        for task, count, spent in zip(self.tasks, self.task_batches, self.task_tokens):
            self.log(f"train/{task['name']}/step_share", count / all_batches)
            self.log(f"train/{task['name']}/token_share", spent / all_tokens)

    def _log_row_tasks(self, terms: list) -> None:
        """train/<task>/loss, ppl, bpb and accuracy of each task's rows of a stacked batch, over
        all ranks' rows (one all-reduce of the tasks' sums); a task without targets logs nothing."""
        sums = torch.stack([torch.stack([v.detach().to(torch.float64) for v in term]) for term in terms])  # (tasks, 4)
        if self.trainer.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums)
        for index, (task, (loss_sum, nll_sum, count, correct)) in enumerate(zip(self.tasks, sums.tolist())):
            if count == 0:
                continue
            prefix = f"train/{task['name']}/"
            self.log(f"{prefix}loss", loss_sum / count)
            self.log(f"{prefix}ppl", math.exp(min(nll_sum / count, 700.0)))
            if self._task_bpb[index] is not None:
                self.log(f"{prefix}bpb", bits_per_byte(nll_sum / count, self._task_bpb[index]))
            if self._accuracy_name(task) is not None:
                self.log(f"{prefix}accuracy", correct / count)

    @staticmethod
    def _input_tokens(batch: dict[str, Any]) -> float:
        tokens = non_pad_tokens(batch["input_ids"], batch.get("attention_mask"))
        if "decoder_input_ids" in batch:
            tokens = tokens + non_pad_tokens(batch["decoder_input_ids"], batch.get("decoder_attention_mask"))
        return float(tokens)

    def _count_shares(self, used: dict[int, tuple[int, float]]) -> None:
        """Counts each task's micro-batches (row mixing: rows) and input tokens, given {task:
        (micro-batches or rows, input tokens)} of this batch (this rank's token count times the
        ranks: packed rows have the same count on every rank); write_step_metrics logs the shares."""
        for index, (batches, tokens) in used.items():
            self.task_batches[index] += batches
            self.task_tokens[index] += tokens * self.trainer.world_size

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["task_batches"] = list(self.task_batches)
        checkpoint["task_tokens"] = list(self.task_tokens)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.task_batches = list(checkpoint.get("task_batches", [0] * len(self.tasks)))
        self.task_tokens = list(checkpoint.get("task_tokens", [0.0] * len(self.tasks)))


def _key(task: dict[str, str], metric: str) -> str:
    """An eval_metrics key (module names may not hold dots; task names hold no '/')."""
    return f"{task['name'].replace('.', '_')}/{metric}"
