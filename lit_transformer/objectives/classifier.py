"""Sequence classification and regression on the shared core: a backbone Transformer (an
encoder; a decoder read at its last real token; or the encoder of an encoder-decoder, as
T5's encoder is used for classification) and a ClassificationHead.

Problems and their losses:
  single_label   labels long (B,)       cross-entropy (label smoothing from optim)
  multi_label    labels float (B, N)    binary cross-entropy with logits, one per label
  regression     labels float (B,)      mean squared error (num_labels must be 1)

Shape legend: B batch, T length, C model width, N labels (outputs).
"""

from __future__ import annotations

from typing import Any, Literal, Unpack

import torch
import torch.nn.functional as F
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassF1Score,
    MultilabelAccuracy,
    MultilabelF1Score,
)
from torchmetrics.regression import MeanSquaredError, PearsonCorrCoef

from lit_transformer.errors import RunError
from lit_transformer.model.config import TransformerConfig
from lit_transformer.model.heads import ClassificationHead
from lit_transformer.model.init import init_weights
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.model.transformer import Transformer
from lit_transformer.objectives.metrics import TokenAverage
from lit_transformer.objectives.objective_base import ObjectiveBase, ObjectiveOptions, as_model_config
from lit_transformer.recipe.registry import implements
from lit_transformer.recipe.schema import OptimConfig, RunConfig

Problem = Literal["single_label", "multi_label", "regression"]
Pooling = Literal["first", "mean", "last"]
Attention = Literal["causal", "bidirectional"]
DEFAULT_POOLING = {"encoder": "first", "decoder": "last", "encoder_decoder": "mean"}


@implements("classify")
class SequenceClassifier(ObjectiveBase):
    def __init__(
        self,
        model_config: TransformerConfig | dict | Transformer,
        num_labels: int,
        problem: Problem = "single_label",
        pooling: Pooling | None = None,
        optim: OptimConfig | dict | None = None,
        max_steps: int | None = None,
        *,
        hidden_layer: bool = True,
        classifier_dropout: float = 0.1,
        backbone_lr_ratio: float = 1.0,
        layer_lr_decay: float = 1.0,
        attention: Attention = "causal",
        **options: Unpack[ObjectiveOptions],
    ):
        """`model_config`: a config for a freshly initialised backbone, or a Transformer whose
        weights to fine-tune (see `from_backbone`). `pooling` defaults by architecture:
        first ([CLS]) for encoders, last for decoders, mean for an encoder-decoder's encoder.
        `backbone_lr_ratio` scales the backbone's learning rate relative to the head's;
        `layer_lr_decay` (in (0, 1]) scales it down further by depth (see `lr_scales`).
        `attention`: how a decoder reads the text: causal, or bidirectional (every row a full
        prefix: UniLM's bidirectional mode, for a decoder pretrained with a mixture that has it);
        encoders are bidirectional and encoder-decoders read with their encoder either way."""
        if problem not in ("single_label", "multi_label", "regression"):
            raise ValueError(f"problem={problem!r} is not one of ['single_label', 'multi_label', 'regression']")
        if num_labels < 1 or (problem == "single_label" and num_labels < 2):
            raise ValueError(f"num_labels={num_labels} is too small for {problem}")
        if problem == "regression" and num_labels != 1:
            raise ValueError(f"regression predicts one value: num_labels must be 1, not {num_labels}")
        if not backbone_lr_ratio > 0:
            raise ValueError(f"backbone_lr_ratio={backbone_lr_ratio} must be positive")
        if not 0 < layer_lr_decay <= 1:
            raise ValueError(f"layer_lr_decay={layer_lr_decay} is outside (0, 1]")
        if isinstance(model_config, Transformer):
            backbone = model_config
        else:
            cfg = as_model_config(model_config)
            backbone = init_weights(Transformer(cfg), cfg)
        cfg = backbone.config
        pooling = pooling or DEFAULT_POOLING[cfg.arch]
        if attention not in ("causal", "bidirectional"):
            raise ValueError(f"attention={attention!r} is not one of ['causal', 'bidirectional']")
        if pooling not in ("first", "mean", "last"):
            raise ValueError(f"pooling={pooling!r} is not one of ['first', 'mean', 'last']")
        hparams = {
            "model_config": cfg.to_dict(),
            "num_labels": num_labels,
            "problem": problem,
            "pooling": pooling,
            "hidden_layer": hidden_layer,
            "classifier_dropout": classifier_dropout,
            "backbone_lr_ratio": backbone_lr_ratio,
            "layer_lr_decay": layer_lr_decay,
            "attention": attention,
        }
        super().__init__(model_config=cfg, optim=optim, max_steps=max_steps, hparams=hparams, **options)
        if cfg.arch == "encoder_decoder":
            backbone.decoder = None  # only the encoder is read: no dead parameters for DDP or AdamW
        self.backbone = backbone
        self.head = ClassificationHead(
            cfg.d_model, num_labels, pooling=pooling, hidden_layer=hidden_layer, dropout=classifier_dropout
        )
        init_weights(self.head, cfg)
        self.problem, self.num_labels, self.backbone_lr_ratio = problem, num_labels, backbone_lr_ratio
        self.layer_lr_decay = layer_lr_decay
        self.bidirectional_decoder = attention == "bidirectional" and cfg.arch == "decoder"
        self.eval_metrics["loss"] = TokenAverage()  # per example
        if problem == "single_label":
            self.eval_metrics["accuracy"] = MulticlassAccuracy(num_labels, average="micro")
            self.eval_metrics["macro_f1"] = MulticlassF1Score(num_labels, average="macro")
        elif problem == "multi_label":
            self.eval_metrics["accuracy"] = MultilabelAccuracy(num_labels, threshold=0.5, average="micro")
            self.eval_metrics["micro_f1"] = MultilabelF1Score(num_labels, threshold=0.5, average="micro")
            self.eval_metrics["macro_f1"] = MultilabelF1Score(num_labels, threshold=0.5, average="macro")
        else:
            self.eval_metrics["mse"] = MeanSquaredError()
            self.eval_metrics["pearson"] = PearsonCorrCoef()

    @classmethod
    def from_backbone(
        cls, transformer: Transformer, num_labels: int, problem: Problem = "single_label", **kwargs
    ) -> SequenceClassifier:
        """Fine-tune a pretrained core: `LanguageModel.transformer` from a run directory,
        checkpoint or `load_pretrained(...)`. The module is used (not copied); an
        encoder-decoder's decoder is dropped from it."""
        return cls(transformer, num_labels, problem, **kwargs)

    @classmethod
    def from_recipe(cls, name: str, cfg: RunConfig, model: TransformerConfig | LanguageModel, data: Any):
        """A head for the training data's labels on a fresh backbone (a config) or on a
        pretrained LanguageModel's Transformer."""
        if data.num_labels is None or (cfg.data.task == "single_label" and data.num_labels < 2):
            raise RunError(f"classification needs at least two labels; the training data has {data.label_names}")
        backbone = model.transformer if isinstance(model, LanguageModel) else model
        return cls(
            backbone,
            data.num_labels,
            cfg.data.task,
            pooling=cfg.finetune.pooling,
            classifier_dropout=cfg.finetune.head_dropout,
            backbone_lr_ratio=cfg.finetune.backbone_lr_ratio,
            layer_lr_decay=cfg.finetune.layer_lr_decay,
            attention=cfg.finetune.attention or "causal",
            **cls.recipe_options(cfg),
        )

    def final_model(self) -> LanguageModel:
        """The backbone as a LanguageModel (an encoder-decoder's encoder as an encoder), so that
        load_pretrained, finetune and export read it like a pretraining run; its LM head is the
        tied embedding, or untrained when the config unties it."""
        cfg = self.model_config
        if cfg.arch == "encoder_decoder":
            cfg = cfg.replace(arch="encoder", n_decoder_layers=None)
        lm = init_weights(LanguageModel(cfg), cfg)
        lm.transformer.load_state_dict(self.backbone.state_dict())
        return lm

    def final_head(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        spec = {
            key: self.hparams[key]
            for key in ("num_labels", "problem", "pooling", "hidden_layer", "classifier_dropout", "attention")
        }
        return spec, {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}

    @classmethod
    def from_final(
        cls,
        name: str,
        cfg: RunConfig,
        lm: LanguageModel,
        data: Any,
        head: tuple[dict[str, Any], dict[str, torch.Tensor]] | None,
    ):
        if head is None:
            raise RunError("a classification model needs its head; the model directory holds none")
        spec, weights = head
        module = cls.from_backbone(
            lm.transformer,
            spec["num_labels"],
            spec["problem"],
            pooling=spec["pooling"],
            hidden_layer=spec["hidden_layer"],
            classifier_dropout=spec["classifier_dropout"],
            attention=spec.get("attention", "causal"),
            optim=cfg.optim,
        )
        module.head.load_state_dict(weights)
        return module

    def evaluation_batches(self, batches: Any, data_labels: list | None, model_labels: list | None) -> Any:
        """Map the evaluation file's label indices to the model's (the data module numbers the
        labels it finds in the file, which may be fewer or in another order than in training)."""
        if self.problem == "regression" or data_labels is None or model_labels is None or data_labels == model_labels:
            yield from batches
            return
        unknown = [name for name in data_labels if name not in model_labels]
        if unknown:
            raise RunError(f"labels {unknown} are not among the model's labels {model_labels}")
        index = torch.tensor([model_labels.index(name) for name in data_labels])
        for batch in batches:
            labels = batch["labels"]
            if self.problem == "single_label":
                batch["labels"] = index[labels]
            else:  # multi-hot (B, N_data) -> (B, N_model)
                out = torch.zeros(labels.shape[0], len(model_labels), dtype=labels.dtype)
                out[:, index] = labels
                batch["labels"] = out
            yield batch

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, N); for regression the predictions (B,)."""
        hidden = backbone_hidden(self.backbone, input_ids, attention_mask, token_type_ids, self.bidirectional_decoder)
        out = self.head(hidden, attention_mask)  # (B, N)
        return out.squeeze(-1) if self.problem == "regression" else out

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        outputs = self(batch["input_ids"], batch.get("attention_mask"), batch.get("token_type_ids"))
        loss = self.loss(outputs, batch["labels"], self.optim.label_smoothing)
        metrics = {}
        if self.problem == "single_label":
            metrics["accuracy"] = (outputs.detach().argmax(-1) == batch["labels"]).float().mean()
        mask = batch.get("attention_mask")
        tokens = mask.sum() if mask is not None else batch["input_ids"].numel()
        return self.finish_training_step(loss, None, batch, flop_tokens=tokens, head_positions=0.0, metrics=metrics)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Class probabilities (B, N), per-label probabilities (B, N), or values (B,)."""
        outputs = self(batch["input_ids"], batch.get("attention_mask"), batch.get("token_type_ids"))
        if self.problem == "single_label":
            return outputs.softmax(-1)
        return outputs.sigmoid() if self.problem == "multi_label" else outputs

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
        outputs = outputs.float()
        if self.problem == "single_label":
            return F.cross_entropy(outputs, labels.long(), label_smoothing=label_smoothing)
        if self.problem == "multi_label":
            return F.binary_cross_entropy_with_logits(outputs, labels.to(outputs.dtype))
        return F.mse_loss(outputs, labels.to(outputs.dtype))

    def eval_update(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        outputs = self(batch["input_ids"], batch.get("attention_mask"), batch.get("token_type_ids")).float()
        labels = batch["labels"]
        n = torch.tensor(float(labels.shape[0]), device=outputs.device)
        self.eval_metrics["loss"].update(self.loss(outputs, labels) * n, n)
        if self.problem == "single_label":
            for name in ("accuracy", "macro_f1"):
                self.eval_metrics[name].update(outputs.argmax(-1), labels)
        elif self.problem == "multi_label":
            for name in ("accuracy", "micro_f1", "macro_f1"):
                self.eval_metrics[name].update(outputs.sigmoid(), labels.long())
        else:
            for name in ("mse", "pearson"):
                self.eval_metrics[name].update(outputs, labels.to(outputs.dtype))

    def eval_compute(self) -> dict[str, float]:
        return {name: float(metric.compute()) for name, metric in self.eval_metrics.items()}

    def lr_scales(self) -> dict[str, float]:
        """Module-name prefixes to lr factors, most specific first (the first match wins). With
        layer-wise decay (ELECTRA's layer ids: embeddings 0, block i i + 1, head L + 1), block i
        of the read stack's L gets ratio x decay^(L - i), the token, position and type
        embeddings ratio x decay^(L + 1); the rest of the backbone (final norm, T5's shared
        relative bias) ratio, and the head 1."""
        ratio, decay = self.backbone_lr_ratio, self.layer_lr_decay
        scales = {}
        if decay != 1.0:
            name = "encoder" if self.backbone.encoder is not None else "decoder"
            n_layers = len(self.backbone.get_submodule(name).blocks)
            for i in range(n_layers):
                scales[f"backbone.{name}.blocks.{i}."] = ratio * decay ** (n_layers - i)
            bottom = ratio * decay ** (n_layers + 1)
            scales |= {f"backbone.{name}.embed.": bottom, "backbone.tokens.": bottom}
        if ratio != 1.0 or scales:
            scales["backbone."] = ratio
        return scales

    def flops_config(self) -> TransformerConfig:
        cfg = self.model_config
        if cfg.arch == "encoder_decoder":  # only the encoder runs
            return cfg.replace(arch="encoder", n_decoder_layers=None)
        return cfg


def backbone_hidden(
    backbone: Transformer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    bidirectional_decoder: bool,
) -> torch.Tensor:
    """(B, T, C): what a classification head reads: an encoder-decoder's encoder output, a
    decoder's hidden states (every row fully visible when it reads bidirectionally), an encoder's."""
    if backbone.config.arch == "encoder_decoder":
        return backbone.encode(input_ids, attention_mask, token_type_ids=token_type_ids)
    if backbone.config.arch == "decoder" and bidirectional_decoder:  # every position sees the whole row
        B, T = input_ids.shape
        everything = torch.full((B,), T, dtype=torch.long, device=input_ids.device)  # (B,) prefix >= T
        return backbone(input_ids, attention_mask, token_type_ids=token_type_ids, prefix_lengths=everything)
    return backbone(input_ids, attention_mask, token_type_ids=token_type_ids)
