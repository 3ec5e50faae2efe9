"""The classification probe (`kind: classify`): how well the backbone's features tell a labelled
dev set's classes apart, after learning them from a labelled train set.

- linear: frozen features (pooled as the `finetune` objective pools them), standardised with
  the train rows' mean and deviation, then multinomial logistic regression, full batch. No
  randomness at all: the same weights give the same numbers.
- finetune: a copy of the backbone and a fresh ClassificationHead trained `steps` AdamW
  steps on shuffled train batches of the run's global batch size (data.batch_size on every
  device), then read on the dev rows. The copy is thrown away; the shuffling comes from a
  private generator and the head's initialisation and dropout from a forked, fixed-seed RNG,
  so the run's weights and RNG streams come out as they went in.

The rows are read by the data pipeline's own reader (`data.corpus.build_sources` with the entry's
files as a classify run's train and validation files: every format, column and blank-row rule
of `finetune`), once, in `build`, before training starts; they are tokenised at the first call,
when the tokenizer is known. Metrics: accuracy, macro_f1, examples (dev rows).

With the entry's `mode_token` every row starts with it, as data/batches/prefix.py's TaskCollator put it
before a mixture task's inputs: the row's first token (type 0, attention 1, inside a bidirectional
decoder's prefix, first in an encoder-decoder's encoder), the text truncated one token shorter.

Shape legend: B batch, T length, C model width, N rows, K classes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lit_transformer.data.batches.collate import ClassifyCollator
from lit_transformer.data.data_config import DataConfig
from lit_transformer.data.sources.corpus import SplitSource, build_sources
from lit_transformer.data.sources.files import ReadStats
from lit_transformer.data.tokens import examples
from lit_transformer.errors import DataError
from lit_transformer.evaluation.choice import ModeToken
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.model.heads import ClassificationHead, pool
from lit_transformer.model.init import init_weights
from lit_transformer.model.transformer import Transformer
from lit_transformer.objectives.classifier import DEFAULT_POOLING
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.schema import RunConfig

# A fixed seed for the finetune probe's shuffling, head initialisation and dropout: every
# evaluation of a run draws the same, so a change between two steps is the weights' doing.
PROBE_SEED = 24
# The linear probe's L2 penalty on the weights, per sample-mean loss: small enough not to bias a
# separable task, large enough to keep the optimum finite when the train rows are separable.
L2 = 1e-3
LBFGS_ITERATIONS = 100  # scikit-learn LogisticRegression's max_iter
HEAD_LR_RATIO = 10.0  # EvalConfig.lr: a fresh head needs larger steps than pretrained weights
GRAD_CLIP = 1.0  # as trainer.gradient_clip_val's default


@dataclass(frozen=True)
class Rows:
    texts: list[str]
    pairs: list[str] | None  # the second segments, when the entry reads pairs
    labels: torch.Tensor  # (N,) long: indices into the probe's label names


# ----------------------------------------------------------------------------- reading


def build(entry: EvalConfig, cfg: RunConfig) -> ClassifyProbe:
    """Read and check the entry's train and dev rows (or the embedded docstring_package task)."""
    where = f"eval.{entry.name}"
    with _entry_keys(entry):
        data = _data_config(entry, cfg.data)
        sources = build_sources(data, "classify", streaming=False)
        train = _read(sources["train"], entry.max_examples)
        dev = _read(sources["validation"], entry.max_examples)
        train_key = f"{where}.train_files" if entry.embedded is None else f"{where}.embedded"
        dev_key = f"{where}.files" if entry.embedded is None else f"{where}.embedded"
        names = examples.label_names_for(
            "single_label", [r[2] for r in train], f"{train_key} ({sources['train'].describe})"
        )
        if len(names) < 2:
            raise DataError(
                f"{train_key}: a classification probe needs at least 2 classes; "
                f"{sources['train'].describe} has {[str(n) for n in names]}"
            )
        pairs = data.text_pair_column is not None

        def rows(items: list[tuple], key: str, source: SplitSource) -> Rows:
            labels = examples.encode_labels("single_label", [r[2] for r in items], names, f"{key} ({source.describe})")
            return Rows([r[0] for r in items], [r[1] for r in items] if pairs else None, torch.from_numpy(labels))

        return ClassifyProbe(
            entry,
            rows(train, train_key, sources["train"]),
            rows(dev, dev_key, sources["validation"]),
            label_names=[str(n) for n in names],
            max_length=data.max_length,
            batch_size=data.batch_size,
            ranks=cfg.trainer.devices * cfg.trainer.num_nodes if isinstance(cfg.trainer.devices, int) else None,
            eval_batch_size=data.eval_batch_size or data.batch_size,
        )


def _data_config(entry: EvalConfig, run: DataConfig) -> DataConfig:
    """The run's data section with the entry's files as a classify run's train and validation
    files (none: the embedded stdlib task) and the entry's columns and format where it names them."""

    def pick(key: str):
        value = getattr(entry, key)
        return value if value is not None else getattr(run, key)

    return dataclasses.replace(
        run,
        train_files=list(entry.train_files),
        val_files=list(entry.files),
        test_files=[],
        hub_name=None,
        source_files=[],
        target_files=[],
        val_source_files=[],
        val_target_files=[],
        format=pick("format"),
        text_column=pick("text_column"),
        # the embedded task has no pairs, whatever the run's own data reads
        text_pair_column=pick("text_pair_column") if entry.embedded is None else None,
        label_column=pick("label_column"),
        task="single_label",
        # the entry's max_examples is its only cap: the run's caps are for its training text
        max_documents=None,
        max_train_bytes=None,
        max_val_bytes=None,
        streaming=False,
        store="cache",  # the probe's small set; a run's litdata store is for its training blocks
    )


@contextlib.contextmanager
def _entry_keys(entry: EvalConfig) -> Iterator[None]:
    """The data pipeline's errors name its own keys (data.train_files, data.label_column); where a
    value came from the entry, name the entry's key instead, and name the entry first."""
    where = f"eval.{entry.name}"
    own = {"train_files": "train_files", "val_files": "files"}
    own.update({k: k for k in ("format", "text_column", "text_pair_column", "label_column") if getattr(entry, k)})
    try:
        yield
    except DataError as error:
        message = re.sub(
            r"\bdata\.(\w+)\b", lambda m: f"{where}.{own[m[1]]}" if m[1] in own else m[0], str(error).splitlines()[0]
        )
        if not message.startswith(where):
            message = f"{where}: {message}"
        raise DataError(message) from None


def _read(source: SplitSource, limit: int | None) -> list[tuple]:
    """(text, pair or None, raw label) rows: the first `limit` (None: all)."""
    stats = ReadStats()
    rows = list(itertools.islice(source.iterate(stats), limit))
    if not rows:
        raise DataError(f"{source.describe}: no labelled rows ({stats.skipped_examples} blank ones skipped)")
    return rows


# ----------------------------------------------------------------------------- the probe


class ClassifyProbe:
    def __init__(
        self,
        entry: EvalConfig,
        train: Rows,
        dev: Rows,
        *,
        label_names: list[str],
        max_length: int,
        batch_size: int,
        eval_batch_size: int,
        ranks: int | None = 1,
    ):
        self.entry = entry
        self.train, self.dev = train, dev
        self.label_names = label_names
        self.max_length, self.batch_size, self.eval_batch_size = max_length, batch_size, eval_batch_size
        self.ranks = ranks  # the run's processes (None: devices "auto", known once they run)
        self._encoded: tuple | None = None  # (tokenizer, length, train examples, dev examples)
        self.mode_token = ModeToken(entry)

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        train, dev = self._examples(target)
        # A frozen probe reads the mean of the tokens (SentEval's and sentence-transformers' choice):
        # an MLM encoder's first token is not trained to summarise the row, and on the embedded
        # docstring task its first-token probe fell from 0.53 (random weights) to 0.28 after
        # tiny-mlm's 300 steps. Fine-tuning trains its pooled token, as finetune does.
        default = "mean" if self.entry.mode == "linear" else DEFAULT_POOLING[target.arch]
        pooling = self.entry.pooling or default
        model = target.model
        was_training = model.training
        # Lightning runs validation hooks under inference_mode, whose tensors autograd refuses:
        # both modes fit something, so leave it for this call.
        with torch.inference_mode(False):
            try:
                model.eval()
                if self.entry.mode == "linear":
                    predicted = self._linear(target, train, dev, pooling)
                else:
                    predicted = self._finetune(target, train, dev, pooling)
            finally:
                model.train(was_training)
        return scores(predicted, self.dev.labels, self.num_classes)

    def _examples(self, target: EvalTarget) -> tuple[list[dict], list[dict]]:
        """The rows as ClassifyCollator's examples, tokenised once per tokenizer."""
        mode = self.mode_token.id(target.tokenizer)
        lead = [mode] if mode is not None else []
        # the row, mode token included, fits the model; the text is cut as data.max_length cuts it
        length = min(self.max_length, target.model.config.max_seq_len - len(lead))
        if self._encoded is None or self._encoded[0] is not target.tokenizer or self._encoded[1] != length:

            def encode(rows: Rows) -> list[dict]:
                ids, types = examples.segment_ids(target.tokenizer, target.special, rows.texts, rows.pairs, length)
                return [
                    {"ids": lead + i, "type_ids": [0] * len(lead) + t, "label": y}
                    for i, t, y in zip(ids, types, rows.labels.tolist())
                ]

            self._encoded = (target.tokenizer, length, encode(self.train), encode(self.dev))
        return self._encoded[2], self._encoded[3]

    def _linear(self, target: EvalTarget, train: list[dict], dev: list[dict], pooling: str) -> torch.Tensor:
        x_train = features(target, target.model.transformer, train, pooling, self.eval_batch_size)  # (N, C)
        x_dev = features(target, target.model.transformer, dev, pooling, self.eval_batch_size)
        mean = x_train.mean(0)
        std = x_train.std(0, correction=0)
        std = torch.where(std > 1e-12, std, torch.ones_like(std))  # a constant feature stays 0
        weight, bias = fit_logistic((x_train - mean) / std, self.train.labels, self.num_classes)
        return (((x_dev - mean) / std) @ weight + bias).argmax(-1)

    def _finetune(self, target: EvalTarget, train: list[dict], dev: list[dict], pooling: str) -> torch.Tensor:
        device = target.device
        collate = ClassifyCollator(special=target.special)
        # The run's global batch, not data.batch_size (per device): a probe trained on the
        # per-device batch gave a 2-device run other numbers than one device with the same
        # global batch (tests/evaluation/test_eval_distributed.py).
        ranks = self.ranks
        if ranks is None:
            ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        batch_size = min(self.batch_size * ranks, len(train))
        shuffle = torch.Generator().manual_seed(PROBE_SEED)  # never the global RNG
        with private_rng(device, PROBE_SEED), torch.enable_grad():
            backbone = trainable_copy(target.model.transformer, device)
            if backbone.config.arch == "encoder_decoder":
                backbone.decoder = None  # only the encoder is read, as finetune reads it
            head = ClassificationHead(
                backbone.config.d_model,
                self.num_classes,
                pooling=pooling,
                dropout=target.cfg.finetune.head_dropout,
            )
            head = init_weights(head, backbone.config).to(device)
            optimizer = torch.optim.AdamW(
                [
                    {"params": list(backbone.parameters()), "lr": self.entry.lr},
                    {"params": list(head.parameters()), "lr": self.entry.lr * HEAD_LR_RATIO},
                ]
            )
            params = [p for group in optimizer.param_groups for p in group["params"]]
            backbone.train()
            head.train()
            for index in shuffled_batches(len(train), batch_size, self.entry.steps, shuffle):
                batch = _to(collate([train[i] for i in index]), device)
                with target.autocast():
                    hidden = hidden_states(backbone, batch, target.bidirectional)  # (B, T, C)
                    logits = head(hidden, batch["attention_mask"])  # (B, K)
                loss = F.cross_entropy(logits.float(), batch["labels"])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
                optimizer.step()
            backbone.eval()
            head.eval()
            predicted = torch.zeros(len(dev), dtype=torch.long)
            with torch.no_grad():
                for index, batch in length_batches(dev, self.eval_batch_size, collate):
                    batch = _to(batch, device)
                    with target.autocast():
                        logits = head(hidden_states(backbone, batch, target.bidirectional), batch["attention_mask"])
                    predicted[index] = logits.float().argmax(-1).cpu()
        return predicted


# ----------------------------------------------------------------------------- pieces


def trainable_copy(source: Transformer, device: torch.device) -> Transformer:
    """A float32 copy of `source` with its own parameters, built fresh from its config and
    filled from its tensors, not `copy.deepcopy`: under FSDP2 the blocks are FSDP modules, which
    refuse deepcopy (and a copy would carry their hooks, whose backward reduce-scatters gradients
    across ranks). Inside `gathered_parameters` their parameters are whole tensors, which is what
    is copied here; one process and DDP take the same path."""
    from torch.distributed.tensor import DTensor

    with torch.random.fork_rng(devices=[]):  # the default init's draws, undone: the head draws as before
        backbone = Transformer(source.config)
    tensors = dict(itertools.chain(source.named_parameters(), source.named_buffers()))
    own = dict(itertools.chain(backbone.named_parameters(), backbone.named_buffers()))
    if own.keys() != tensors.keys():
        raise RuntimeError(
            f"the probe's copy of the backbone differs from it: {sorted(own.keys() ^ tensors.keys())[:3]}"
        )
    with torch.no_grad():
        for name, value in own.items():
            if isinstance(tensors[name], DTensor):
                raise RuntimeError(
                    f"{name} is a shard: the finetune probe reads gathered weights (gathered_parameters)"
                )
            value.copy_(tensors[name])
    return backbone.to(device).requires_grad_(True)


def hidden_states(transformer: Transformer, batch: dict[str, torch.Tensor], bidirectional: bool) -> torch.Tensor:
    """(B, T, C): what SequenceClassifier.forward gives its head: an encoder-decoder's encoder
    output, a decoder's hidden states (every row fully visible when it trained a bidirectional
    mode, as finetune reads it), an encoder's hidden states."""
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    arch = transformer.config.arch
    if arch == "encoder_decoder":
        return transformer.encode(ids, mask, token_type_ids=types)
    if arch == "decoder" and bidirectional:
        B, T = ids.shape
        everything = torch.full((B,), T, dtype=torch.long, device=ids.device)  # (B,) prefix >= T
        return transformer(ids, mask, token_type_ids=types, prefix_lengths=everything)
    return transformer(ids, mask, token_type_ids=types)


@torch.no_grad()
def features(
    target: EvalTarget, transformer: Transformer, examples: list[dict], pooling: str, batch_size: int
) -> torch.Tensor:
    """(N, C) float64 on the CPU: each example's pooled hidden states."""
    collate = ClassifyCollator(special=target.special)
    out = torch.zeros(len(examples), transformer.config.d_model, dtype=torch.float64)
    for index, batch in length_batches(examples, batch_size, collate):
        batch = _to(batch, target.device)
        with target.autocast():
            hidden = hidden_states(transformer, batch, target.bidirectional)  # (B, T, C)
        out[index] = pool(hidden, batch["attention_mask"], pooling).double().cpu()
    return out


def fit_logistic(
    x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float = L2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression on (N, C) features and (N,) labels -> weight (C, K), bias (K,).

    Full-batch L-BFGS in float64 from zeros, a fixed number of iterations: deterministic, and
    written here because scikit-learn's LogisticRegression would add a dependency for ~20 lines.
    Minimises mean cross-entropy + l2 / 2 * |weight|^2 (the bias is not penalised)."""
    x = x.detach().to(torch.float64).cpu()
    y = y.detach().long().cpu()
    weight = torch.zeros(x.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [weight, bias],
        lr=1.0,
        max_iter=LBFGS_ITERATIONS,
        history_size=20,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, y) + 0.5 * l2 * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        optimizer.step(closure)
    return weight.detach(), bias.detach()


def scores(predicted: torch.Tensor, gold: torch.Tensor, num_classes: int) -> dict[str, float]:
    """accuracy; macro_f1: the mean F1 over the classes that occur in the dev labels or the
    predictions (scikit-learn's f1_score(average='macro') convention); examples."""
    predicted, gold = predicted.cpu().long(), gold.cpu().long()
    f1 = []
    for c in range(num_classes):
        p, g = predicted == c, gold == c
        if not (p.any() or g.any()):
            continue
        tp = (p & g).sum().item()
        f1.append(2 * tp / (p.sum().item() + g.sum().item()))  # 2TP / (2TP + FP + FN)
    return {
        "accuracy": (predicted == gold).double().mean().item(),
        "macro_f1": sum(f1) / len(f1),
        "examples": float(len(gold)),
    }


def length_batches(examples: list[dict], batch_size: int, collate) -> Iterator[tuple[torch.Tensor, dict]]:
    """(row indices, collated batch), rows of similar length together (less padding)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        yield torch.tensor(index), collate([examples[i] for i in index])


def shuffled_batches(n: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[list[int]]:
    """`steps` batches of row indices: epochs of permutations drawn from `generator`, in order."""
    pending: list[int] = []
    for _ in range(steps):
        while len(pending) < batch_size:
            pending += torch.randperm(n, generator=generator).tolist()
        yield pending[:batch_size]
        pending = pending[batch_size:]


@contextlib.contextmanager
def private_rng(device: torch.device, seed: int) -> Iterator[None]:
    """The global CPU RNG (and the device's CUDA RNG) seeded with `seed` inside, restored after:
    module construction and dropout draw from it without moving the run's streams."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
