"""What each `lit-transformer` subcommand does, as plain functions the CLI (and tests, and
notebooks) call: train (pretrain and finetune), prepare, info, evaluate, generate, export.

Shape legend: B prompts, T prompt length, G generated length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from .config import ARCH_FOR, RecipeError, RunConfig, model_config, model_overrides, save_config
from .rundir import (
    CONFIG_YAML, CLASSIFIER_JSON, RunError, Source, label_names, load_backbone, load_checkpoint_module,
    load_classifier, load_language_model, open_run_dir, resolve_source, save_final, with_overrides,
)
from .checkpointing import check_architecture, read_checkpoint
from .training import SampleGenerations, build_trainer, consolidated, finish_wandb

GENERATIVE = ("clm", "span", "seq2seq")


# ----------------------------------------------------------------------------- train


def resolve(cfg: RunConfig) -> RunConfig:
    """Fill what a recipe may leave to its fine-tuning source: the source's tokenizer."""
    if cfg.finetune.from_ is not None and cfg.tokenizer.path is None:
        source = resolve_source(cfg.finetune.from_)
        if source.tokenizer is None:
            raise RunError(f"finetune.from={cfg.finetune.from_} has no tokenizer.json; set tokenizer.path")
        cfg = dataclasses.replace(cfg, tokenizer=dataclasses.replace(cfg.tokenizer, path=str(source.tokenizer)))
    return cfg


def data_module(cfg: RunConfig, run_dir: Path | None, model_vocab_size: int | None = None):
    from .data import TextDataModule

    dm = TextDataModule(cfg.data, cfg.tokenizer, cfg.objective.name, seed=cfg.trainer.seed,
                        run_dir=str(run_dir) if run_dir is not None else None, model_vocab_size=model_vocab_size)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def build_objective(cfg: RunConfig, dm, source: Source | None = None):
    """The objective LightningModule: from scratch (preset + overrides, vocabulary from the
    tokenizer), or from finetune.from's weights with the recipe's model fields applied on top."""
    from .model.language_model import LanguageModel
    from .objectives import CausalLM, MaskedLM, Seq2SeqLM, SequenceClassifier

    name = cfg.objective.name
    if source is None:
        model: Any = model_config(cfg, vocab_size=dm.vocab_size, source="recipe")
    else:
        model = with_overrides(load_backbone(source), model_overrides(cfg)).train()  # loaded in eval mode
    mcfg = model.config if source is not None else model
    if mcfg.arch not in ARCH_FOR[name]:
        raise RunError(f"objective.name={name} needs model.arch in {list(ARCH_FOR[name])}, "
                       f"but the model is {mcfg.arch!r}")
    length = {"classify": cfg.data.max_length, "seq2seq": max(cfg.data.max_length, cfg.data.max_target_length)
              }.get(name, cfg.data.block_size)
    if mcfg.position == "learned" and length > mcfg.max_seq_len:
        raise RecipeError(f"data length {length} exceeds model.max_seq_len={mcfg.max_seq_len} (learned positions)")
    common = dict(optim=cfg.optim, max_steps=cfg.trainer.max_steps, compile=cfg.trainer.compile,
                  activation_checkpointing=cfg.trainer.activation_checkpointing)
    if name == "classify":
        if dm.num_labels is None or (cfg.data.task == "single_label" and dm.num_labels < 2):
            raise RunError(f"classification needs at least two labels; the training data has {dm.label_names}")
        head = dict(pooling=cfg.finetune.pooling, classifier_dropout=cfg.finetune.head_dropout,
                    backbone_lr_ratio=cfg.finetune.backbone_lr_ratio, **common)
        backbone = model.transformer if source is not None else model
        return SequenceClassifier(backbone, dm.num_labels, cfg.data.task, **head)
    lm_args = dict(bytes_per_token=dm.bytes_per_token, **common)
    if source is None and cfg.trainer.strategy == "fsdp":
        # shapes only: each rank allocates and initialises its shards in configure_model, so a
        # model larger than one device's memory can be built (exactly the weights of an eager init)
        model = LanguageModel.from_config(model, device="meta")
        model.init_rng_state = torch.get_rng_state()  # the draws an eager init would take now
    if name == "mlm":
        return MaskedLM(model, **lm_args)
    if name == "clm":
        return CausalLM(model, **lm_args)
    if name == "span":
        return Seq2SeqLM(model, task="span", **lm_args)
    return Seq2SeqLM(model, task="seq2seq", **seq2seq_bleu(cfg, dm.tokenizer, dm.special_tokens), **lm_args)


def seq2seq_bleu(cfg: RunConfig, tokenizer, special) -> dict[str, Any]:
    if not cfg.objective.bleu:
        return {}
    return dict(bleu=True, detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                bleu_max_batches=cfg.objective.bleu_batches,
                generate_kwargs=dict(max_new_tokens=cfg.data.max_target_length, eos_token_id=special.eos_id,
                                     pad_token_id=special.pad_id or 0, decoder_start_token_id=special.decoder_start_id))


def train(cfg: RunConfig, *, callbacks: Sequence[Any] = (), progress_bar: bool = True) -> dict[str, float]:
    """Pretrain or fine-tune as the recipe says; returns the final validation metrics. The run
    directory ends up holding everything `rundir` lists."""
    cfg = resolve(cfg)
    with cpu_threads(cfg.trainer.num_threads):
        return _train(cfg, callbacks, progress_bar)


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """torch.set_num_threads(n) for the duration (it is process-wide)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def autocast(cfg: RunConfig):
    """Evaluation in the precision the run trained with (bf16 autocast for bf16-mixed)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.trainer.precision == "bf16-mixed")


def _train(cfg: RunConfig, callbacks: Sequence[Any], progress_bar: bool) -> dict[str, float]:
    import lightning as L

    run_dir, ckpt = open_run_dir(cfg)
    if ckpt is None:
        save_config(cfg, run_dir / CONFIG_YAML)  # first, so that a run that fails later can be started again
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    source = resolve_source(cfg.finetune.from_) if cfg.finetune.from_ is not None else None
    dm = data_module(cfg, run_dir, cfg.model.vocab_size)
    module = build_objective(cfg, dm, source)
    if ckpt is not None:
        if ckpt.is_file():  # a one-line error naming the fields, not a load_state_dict traceback
            check_architecture(read_checkpoint(ckpt, mmap=True), module.model_config.to_dict(), ckpt)
        save_config(cfg, run_dir / CONFIG_YAML)  # after the checks: a refused resume changes nothing
    extra = list(callbacks)
    try:
        with worker_errors():
            if cfg.objective.name in GENERATIVE and cfg.generation.enabled:
                extra.append(SampleGenerations(sample_fn(cfg, dm), run_dir))
            trainer = build_trainer(cfg, run_dir, resume=ckpt is not None, callbacks=extra,
                                    progress_bar=progress_bar)
            trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt is not None else None)
        interrupted = trainer.interrupted or trainer.global_step < cfg.trainer.max_steps
        validated_last = cfg.trainer.max_steps % cfg.trainer.val_check_interval == 0 and any(
            k.startswith("val/") for k in trainer.callback_metrics)  # not so after resuming a finished run
        if not interrupted and not validated_last:
            with worker_errors():
                trainer.validate(module, datamodule=dm, verbose=False)  # the final model's metrics
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if not interrupted:
            final = consolidated(module, trainer.global_rank)  # FSDP: every rank gathers, rank 0 saves
            if trainer.is_global_zero:
                save_final(final, run_dir, metrics)
    finally:
        finish_wandb()
    return metrics


@contextlib.contextmanager
def worker_errors():
    """A data-loader worker that dies (killed, out of memory, os._exit) makes torch raise
    "DataLoader worker (pid X) exited unexpectedly / is killed by signal"; as a one-line RunError."""
    try:
        yield
    except RuntimeError as error:
        if "DataLoader worker" not in str(error):
            raise
        first = str(error).strip().splitlines()[0]
        raise RunError(f"a data-loader worker died ({first}); data.num_workers=0 loads in the main process, "
                       "where the cause shows; resume=auto continues from the newest checkpoint") from None


def finetune(cfg: RunConfig, **kwargs: Any) -> dict[str, float]:
    """`train` for a recipe that starts from finetune.from or trains a classifier."""
    if cfg.finetune.from_ is None and cfg.objective.name != "classify":
        raise RunError("finetune needs finetune.from (or objective.name=classify); use pretrain to train from scratch")
    return train(cfg, **kwargs)


# ----------------------------------------------------------------------------- prompts


def encode_prompt(text: str, tokenizer, special, objective: str) -> list[int]:
    """A prompt as the objective saw inputs in training: decoders read documents that follow a
    separator; encoders read a source ending in eos; a span model fills the sentinels in its
    input (one is appended when the prompt has none)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if objective == "clm":
        return ([special.separator_id] if special.separator_id is not None else []) + ids
    end = special.eos_id if special.eos_id is not None else special.sep_id
    if objective == "span" and not set(ids) & set(special.sentinel_ids) and special.sentinel_ids:
        ids = ids + [special.sentinel_ids[0]]
    return ids + ([end] if end is not None else [])


def decode_new(tokenizer, special, objective: str, row: list[int]) -> str:
    """Text of generated ids up to eos; a span model's sentinels are kept to show the spans."""
    stop = {special.eos_id} if special.eos_id is not None else set()
    if objective == "clm" and special.separator_id is not None:
        stop.add(special.separator_id)
    out = []
    for token in row:
        if token in stop:
            break
        if token != special.pad_id:
            out.append(token)
    return tokenizer.decode(out, skip_special_tokens=objective != "span")


def complete(model, tokenizer, special, objective: str, prompts: list[list[int]], *, max_new_tokens: int,
             generator: torch.Generator | None = None, **options) -> list[str]:
    """Generate from token-id prompts; returns the new text of each."""
    from .data.collate import pad
    from .model.generate import generate

    device = next(model.parameters()).device
    ids = pad(prompts, special.pad_id or 0).to(device)  # (B, T)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        mask[i, : len(p)] = 1
    limit = model.config.max_seq_len - (ids.shape[1] if objective == "clm" else 0)
    out = generate(model, ids, mask, max_new_tokens=max(1, min(max_new_tokens, limit)),
                   eos_token_id=special.eos_id if objective != "clm" else special.separator_id,
                   pad_token_id=special.pad_id or 0, decoder_start_token_id=special.decoder_start_id
                   if objective != "clm" else None, generator=generator, **options)
    new = out[:, ids.shape[1]:] if objective == "clm" else out[:, 1:]  # (B, G)
    return [decode_new(tokenizer, special, objective, row) for row in new.tolist()]


def sample_fn(cfg: RunConfig, dm):
    """The SampleGenerations callback's sampler: fixed prompts (the recipe's, else the starts
    of the first validation examples as the collator builds them), decoded with a seeded
    generator so sampling never touches the global one."""
    g = cfg.generation
    tokenizer, special, objective = dm.tokenizer, dm.special_tokens, cfg.objective.name
    if g.prompts:
        prompts = [encode_prompt(p, tokenizer, special, objective) for p in g.prompts]
    else:
        loader = dm.val_dataloader()
        batch = next(iter(loader), None) if loader else None
        prompts = []
        if batch is not None:
            for ids, mask in zip(batch["input_ids"][: g.num_prompts], batch["attention_mask"][: g.num_prompts]):
                row = ids[mask.bool()].tolist()
                prompts.append(row[: g.prompt_tokens] if objective == "clm" else row)
    shown = [tokenizer.decode(p, skip_special_tokens=objective != "span") for p in prompts]
    options = dict(do_sample=g.do_sample, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)

    def sample(module) -> list[tuple[str, str]]:
        if not prompts:
            return []
        device = next(module.parameters()).device
        generator = torch.Generator(device=device).manual_seed(cfg.trainer.seed)
        texts = complete(module.model, tokenizer, special, objective, prompts, max_new_tokens=g.max_new_tokens,
                         generator=generator, **options)
        return list(zip(shown, texts))

    return sample


# ----------------------------------------------------------------------------- other commands


def prepare(cfg: RunConfig) -> dict[str, Any]:
    """Train or load the tokenizer and fill the token cache; writes tokenizer.json and config.yaml."""
    from .data import prepare as prepare_data

    cfg = resolve(cfg)
    run_dir = Path(cfg.run.dir)
    summary = prepare_data(cfg.data, cfg.tokenizer, cfg.objective.name, run_dir, seed=cfg.trainer.seed,
                           model_vocab_size=cfg.model.vocab_size)
    if not (run_dir / CONFIG_YAML).exists():
        save_config(cfg, run_dir / CONFIG_YAML)
    return summary


def info(target: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Size, FLOPs and KV-cache accounting for a preset or a recipe (its extends and overrides
    applied; the vocabulary is the recipe's tokenizer.vocab_size unless model.vocab_size is set)."""
    from . import info as accounting
    from .config import load_recipe

    if not Path(target).is_file():
        if overrides:
            raise RunError("key=value overrides apply to recipes, not presets")
        return accounting.info(target)
    cfg = load_recipe(target, overrides)
    if cfg.finetune.from_ is not None:
        mcfg = load_backbone(resolve_source(cfg.finetune.from_)).config
    else:
        mcfg = model_config(cfg, source=target)
    with tempfile.TemporaryDirectory() as tmp:  # info() reads a model section from a file
        flat = Path(tmp) / Path(target).name
        flat.write_text(json.dumps({"model": mcfg.to_dict()}))
        out = accounting.info(str(flat))
    return {**out, "preset": cfg.model.preset, "source": str(Path(target).resolve())}


def _objective_of(source: Source) -> str:
    cfg = source.run_config
    if cfg is not None:
        return cfg.objective.name
    if source.kind == "model" and (source.path / CLASSIFIER_JSON).is_file():
        return "classify"
    arch = load_language_model(source).config.arch
    return {"encoder": "mlm", "decoder": "clm", "encoder_decoder": "span"}[arch]


def evaluate(target: str, data: str | None = None, *, max_batches: int | None = None) -> dict[str, Any]:
    """Validation metrics of a run (its final model) or checkpoint on its validation split or
    on `data` (a file in the run's data format). Keys: loss, perplexity, bits_per_byte,
    accuracy, macro_f1, bleu, ... as fit the objective."""
    from .objectives import CausalLM, MaskedLM, Seq2SeqLM, evaluate_batches

    source = resolve_source(target)
    cfg = source.run_config
    if cfg is None or source.tokenizer is None:
        raise RunError(f"{target}: evaluate needs a run directory (or a checkpoint inside one) with "
                       f"{CONFIG_YAML} and tokenizer.json")
    objective = cfg.objective.name
    data_cfg = cfg.data
    if data is not None:
        if not Path(data).exists():
            raise RunError(f"--data {data}: no such file")
        data_cfg = dataclasses.replace(data_cfg, train_files=[data], val_files=[data], source_files=[],
                                       target_files=[], val_source_files=[], val_target_files=[])
    cfg = dataclasses.replace(cfg, data=data_cfg, tokenizer=dataclasses.replace(cfg.tokenizer, path=str(source.tokenizer)))
    dm = data_module(cfg, None)
    if objective == "classify":
        module = load_classifier(source)
    elif source.kind == "checkpoint":
        extra = seq2seq_bleu(cfg, dm.tokenizer, dm.special_tokens) if objective == "seq2seq" else {}
        module = load_checkpoint_module(source.path, objective, bytes_per_token=dm.bytes_per_token, **extra)
    else:
        lm = load_language_model(source)
        args = dict(bytes_per_token=dm.bytes_per_token, optim=cfg.optim)
        if objective == "mlm":
            module = MaskedLM(lm, **args)
        elif objective == "clm":
            module = CausalLM(lm, **args)
        else:
            extra = seq2seq_bleu(cfg, dm.tokenizer, dm.special_tokens) if objective == "seq2seq" else {}
            module = Seq2SeqLM(lm, task=objective, **extra, **args)
    batches = dm.val_dataloader()
    if not batches:
        raise RunError(f"{target}: the data has no validation split")
    if objective == "classify":
        batches = _relabel(batches, dm.label_names, label_names(source), cfg.data.task)
    with cpu_threads(cfg.trainer.num_threads), autocast(cfg):
        values = evaluate_batches(module, batches, max_batches)
    names = {"ppl": "perplexity", "bpb": "bits_per_byte", "masked_accuracy": "accuracy", "token_accuracy": "accuracy"}
    return {"objective": objective, **{names.get(k, k): v for k, v in values.items()}}


def _relabel(batches, data_labels: list | None, model_labels: list | None, task: str):
    """Map the evaluation file's label indices to the model's (the data module numbers the
    labels it finds in the file, which may be fewer or in another order than in training)."""
    if task == "regression" or data_labels is None or model_labels is None or data_labels == model_labels:
        yield from batches
        return
    unknown = [name for name in data_labels if name not in model_labels]
    if unknown:
        raise RunError(f"labels {unknown} are not among the model's labels {model_labels}")
    index = torch.tensor([model_labels.index(name) for name in data_labels])
    for batch in batches:
        labels = batch["labels"]
        if task == "single_label":
            batch["labels"] = index[labels]
        else:  # multi-hot (B, N_data) -> (B, N_model)
            out = torch.zeros(labels.shape[0], len(model_labels), dtype=labels.dtype)
            out[:, index] = labels
            batch["labels"] = out
        yield batch


def generate(target: str, prompt: str, *, max_new_tokens: int = 64, greedy: bool = False, temperature: float = 0.8,
             top_k: int | None = 50, top_p: float | None = None, num_beams: int = 1, seed: int = 0) -> str:
    """Continue (decoder) or transform (encoder-decoder) a prompt with a run's model."""
    from .data.tokenizer import SpecialTokens, load_tokenizer

    source = resolve_source(target)
    if source.tokenizer is None:
        raise RunError(f"{target}: no tokenizer.json next to the model")
    objective = _objective_of(source)
    if objective not in GENERATIVE:
        raise RunError(f"{target}: a {objective} model does not generate text; generate needs a clm, span or "
                       "seq2seq run")
    model = load_language_model(source).eval()
    tokenizer = load_tokenizer(source.tokenizer)
    special = SpecialTokens.from_tokenizer(tokenizer)
    ids = encode_prompt(prompt, tokenizer, special, objective)
    sampling = not greedy and num_beams == 1
    options = dict(do_sample=sampling, num_beams=num_beams)
    if sampling:
        options.update(temperature=temperature, top_k=top_k, top_p=top_p)
    generator = torch.Generator().manual_seed(seed)
    (text,) = complete(model, tokenizer, special, objective, [ids], max_new_tokens=max_new_tokens,
                       generator=generator, **options)
    return text


def export(target: str, out: str, fmt: str = "hf") -> Path:
    """A transformers directory (config.json, model.safetensors, tokenizer.json) of a run's model."""
    from .data.tokenizer import SpecialTokens, load_tokenizer
    from .model.interop import InteropError, export_hf

    if fmt != "hf":
        raise RunError(f"--format {fmt}: the only export format is hf")
    source = resolve_source(target)
    if _objective_of(source) == "classify":
        raise RunError(f"{target}: a classification run; export writes language models (BERT, GPT-2, T5, LLaMA)")
    model = load_language_model(source)
    extra: dict[str, Any] = {}
    if source.tokenizer is not None:
        special = SpecialTokens.from_tokenizer(load_tokenizer(source.tokenizer))
        ids = {"pad_token_id": special.pad_id, "eos_token_id": special.eos_id, "bos_token_id": special.bos_id}
        if model.config.arch == "encoder_decoder":
            ids["decoder_start_token_id"] = special.decoder_start_id
        extra = {k: v for k, v in ids.items() if v is not None}
    try:
        path = export_hf(model, out, extra_config=extra)
    except InteropError as error:
        raise RunError(str(error)) from None
    if source.tokenizer is not None:
        shutil.copyfile(source.tokenizer, path / "tokenizer.json")
    return path
