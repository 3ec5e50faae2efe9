"""A mixture of tasks on one model: how often each task is drawn, which task each optimizer
step trains, and `MixtureDataModule`, which feeds every task from its own token cache. The
rates, the draws and the sampler are in data/batches/mixture_sampling.py.

- Rates (`mixture_rates`): the tasks' weights, or T5's examples-proportional mixing with an
  artificial limit K, optionally temperature-scaled (Raffel et al. 2020, 3.5.2).
- Draws (`task_for_step`): the task of optimizer step s is a function of (seed, s) alone, so every
  DDP rank draws the same task, a resumed run the same sequence, and all micro-batches of a step
  (gradient accumulation) share its task.
- Batches (`MixtureBatchSampler`): task t's batches come from its own rank-sharded sampler, which
  cycles through its own epochs: its c-th batch is batch c % per_epoch of epoch c // per_epoch.
  Task t seeds its permutation and its collator generators with seed + t, so a mixture of one
  task draws exactly the batches a single-objective run with the same seed draws. Each key
  carries the schedule's share done at its optimizer step, for a collator that schedules by it
  (mntp.py's mask rate): `schedule_progress` (data/batches/progress.py) over trainer.max_time
  where it is set, else trainer.max_steps, fed the training clock by training.TimeBudget.
- Per-row mixing (`mixing="row"`, data/batches/row_mixing.py): instead of one task per step,
  every micro-batch stacks data.batch_size rows of a decoder's tasks, apportioned by the rates;
  task t's sampler then takes one row at a time, and its count is its rows so far.
- Resume: the module's state is (micro-batches used, batches used per task), counted in
  `on_before_batch_transfer` as in text_module.py, so prefetched batches are not counted, with the
  layout they were counted on (ranks, batch sizes, accumulation). On another layout each task
  goes on from the position in its epoch's order that its global micro-batches reached (sampler.
  cursor: any position, so a step that crossed a task's epoch boundary resumes too), and the
  micro-batch count becomes the same optimizer step's.

The training loader is infinite (its sampler has no length): Lightning then runs by steps,
with validation every `val_check_interval` batches (an int) and check_val_every_n_epoch=None.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from lit_transformer.data.batches.collate import example_generators
from lit_transformer.data.batches.mixture_sampling import MixtureBatchSampler, mixture_rates
from lit_transformer.data.batches.prefix import ARCHS, task_collator
from lit_transformer.data.batches.progress import ScheduleProgress
from lit_transformer.data.batches.row_mixing import RowMixtureBatches, RowMixtureBatchSampler
from lit_transformer.data.batches.sampler import ResumableBatchSampler, cursor
from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.data_plan import MixtureTask
from lit_transformer.data.modules.text_module import EpochLoader, RankedDataModule, TextDataModule, agree_on_data
from lit_transformer.data.sources.corpus import build_sources, objective_kind
from lit_transformer.data.tokens.cache import cache_lock, cache_root
from lit_transformer.data.tokens.prepare import Prepared, resolve_tokenizer, write_run_files
from lit_transformer.data.tokens.tokenizer import SpecialTokens, check_extra_special_tokens, save_tokenizer
from lit_transformer.errors import DataError

# what the data state records of the layout it was counted on: ranks, each task's batch, accumulation
MIXTURE_LAYOUT_KEYS = ("world_size", "batch_sizes", "accumulate")
# prefix LM reads next-token blocks on a decoder, plain blocks that it splits on an encoder-decoder
PREFIX_PIPELINES = {"decoder": "clm", "encoder_decoder": "mlm"}
MIXINGS = ("step", "row")
# the task objectives whose decoder batches have one shape: (B, T) inputs and labels, (B,) modes
ROW_OBJECTIVES = ("clm", "mlm", "mntp", "prefix_lm")


class _MixtureBatches(torch.utils.data.Dataset):
    """Map-style dataset whose keys are MixtureBatchSampler's: (task, (epoch, batch index, indices), progress)."""

    def __init__(self, examples: list, collators: list, seed: int):
        self.examples, self.collators, self.seed = examples, collators, seed

    def __len__(self) -> int:
        return sum(len(e) for e in self.examples)

    def __getitem__(self, key) -> dict:
        t, (epoch, _, indices), done = key
        gens = example_generators(self.seed + t, epoch, indices)  # task t's own seed (module docstring)
        return self.collators[t]([self.examples[t][i] for i in indices], gens, done)


class MixtureDataModule(RankedDataModule):
    """Every task's data on one shared tokenizer; train batches from the mixture, one validation
    (and test) loader per task that has the split.

    The tokenizer is trained (or loaded) once from `tokenizer_data` (the recipe's data section),
    read as `tokenizer_pipeline` (default: the pipeline of the first task whose data is
    `tokenizer_data`, else of the first task). Every task then gets a TextDataModule that loads
    that one file, so tasks with the same data and pipeline share one token cache.

    `mixing`: "step" (one task per optimizer step) or "row" (every batch stacks rows of the
    tasks by their rates: a decoder's tasks of one shape, with one data.batch_size). `max_steps`
    and `max_time` (trainer.max_time, which wins where set): the run's end, which an mntp task's
    mask rate falls over (`schedule_progress`).
    """

    def __init__(
        self,
        tasks: Sequence[MixtureTask],
        *,
        arch: str,
        tokenizer: TokenizerConfig,
        tokenizer_data: DataConfig,
        rates: str = "weights",
        weights: Sequence[float] | None = None,
        cap: int | None = None,
        temperature: float = 1.0,
        seed: int = 0,
        accumulate: int = 1,
        run_dir: str | None = None,
        model_vocab_size: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        tokenizer_pipeline: str | None = None,
        mixing: str = "step",
        max_steps: int | None = None,
        max_time: float | None = None,
    ):
        super().__init__()
        if not tasks:
            raise DataError("a mixture needs at least one task")
        if arch not in ARCHS:
            raise DataError(f"model.arch={arch!r} is not one of {list(ARCHS)}")
        for task in tasks:
            if task.objective == "prefix_lm" and PREFIX_PIPELINES.get(arch) != task.pipeline:
                raise DataError(
                    f"tasks.{task.name}: prefix_lm on model.arch={arch} needs pipeline "
                    f"{PREFIX_PIPELINES.get(arch)!r}, got {task.pipeline!r}"
                )
            if task.objective == "mntp" and (arch, task.pipeline) != ("decoder", "clm"):
                raise DataError(
                    f"tasks.{task.name}: mntp needs model.arch=decoder and pipeline 'clm', "
                    f"got {arch} and {task.pipeline!r}"
                )
            if mixing == "row" and (arch != "decoder" or task.objective not in ROW_OBJECTIVES):
                raise DataError(
                    f"tasks.{task.name}: mixture.mixing=row stacks rows of {list(ROW_OBJECTIVES)} tasks of a "
                    f"decoder, not {task.objective} on model.arch={arch}; use mixture.mixing=step"
                )
            if task.mode_token is not None and task.mode_token not in tokenizer.extra_special_tokens:
                raise DataError(
                    f"tasks.{task.name}.mode_token={task.mode_token!r} is not in "
                    f"tokenizer.extra_special_tokens={list(tokenizer.extra_special_tokens)}"
                )
        if mixing not in MIXINGS:
            raise DataError(f"mixture.mixing={mixing!r} is not one of {list(MIXINGS)}")
        if mixing == "row" and len({t.data.batch_size for t in tasks}) > 1:
            sizes = {t.name: t.data.batch_size for t in tasks}
            raise DataError(f"mixture.mixing=row shares one data.batch_size among the tasks' rows, got {sizes}")
        self.tasks, self.arch, self.mixing = list(tasks), arch, mixing
        self.schedule_progress = ScheduleProgress(max_steps=max_steps, max_time=max_time)
        self.tokenizer_cfg, self.tokenizer_data = tokenizer, tokenizer_data
        self.rate_options = dict(
            method=rates, weights=None if weights is None else list(weights), cap=cap, temperature=temperature
        )
        mixture_rates([1] * len(self.tasks), rates, weights=weights, cap=cap, temperature=temperature)  # fail early
        self.seed, self.accumulate, self.run_dir, self.model_vocab_size = seed, accumulate, run_dir, model_vocab_size
        self._rank, self._world = rank, world_size
        same_data = [t.pipeline for t in self.tasks if t.data == tokenizer_data]
        self.tokenizer_pipeline = tokenizer_pipeline or (same_data or [self.tasks[0].pipeline])[0]
        self._tokenizer = None
        self._tokenizer_path: str | None = None
        self._mode_ids: dict[str, int] = {}
        self._modules: list[TextDataModule] | None = None
        self._rates: list[float] | None = None
        self._sampler: MixtureBatchSampler | None = None
        self._micro = 0  # training micro-batches used so far
        self._saved_layout: dict | None = None  # the layout a resumed position was counted on
        self._origins = [(0, 0, 0)] * len(self.tasks)  # per task, where its count started (sampler.cursor)
        self.carried: tuple[int, int] | None = None  # (saved, carried) micro-batches of a resume on another layout
        self._task_batches = [0] * len(self.tasks)  # of which each task's (mixing="row": its rows)

    # ------------------------------------------------------------------ Lightning hooks

    def prepare_data(self) -> None:
        with cache_lock(cache_root(self.tokenizer_data.cache_dir)):  # one process of the node trains it
            self._resolve_tokenizer(build=True)
        self._write_run_files()
        for dm in self._task_modules():
            dm.prepare_data()

    def setup(self, stage: str | None = None) -> None:
        if self._tokenizer is None:
            # a single process may build what is missing; other ranks rely on prepare_data
            self._resolve_tokenizer(build=self.world_size == 1)
        if self.rank == 0 and self.run_dir is not None and not (Path(self.run_dir) / "tokenizer.json").exists():
            self._write_run_files()
        for t, (task, dm) in enumerate(zip(self.tasks, self._task_modules())):
            dm.setup(stage)  # sets dm.collator to its pipeline's own collator
            dm.collator = task_collator(
                task,
                t,
                arch=self.arch,
                base=dm.collator,
                special=dm.special_tokens,
                vocab_size=dm.vocab_size,
                mode_token_id=self._mode_ids[task.mode_token] if task.mode_token is not None else None,
            )
        self._rates = mixture_rates(self.train_sizes, **self.rate_options)
        if self.trainer is not None:  # Lightning's setup hook: every rank compares what it read
            joined = hashlib.sha256(" ".join(dm.fingerprint() for dm in self._task_modules()).encode()).hexdigest()
            agree_on_data(joined[:16], self.trainer.node_rank, str(cache_root(self.tokenizer_data.cache_dir)))

    def train_dataloader(self) -> DataLoader:
        modules = self._ready()
        samplers = []
        sizes = self._batch_sizes()
        for t, (task, dm) in enumerate(zip(self.tasks, modules)):
            n = len(self._train_examples(t))
            sampler = ResumableBatchSampler(
                n,
                sizes[t],
                seed=self.seed + t,
                shuffle=task.data.shuffle,
                drop_last=True,
                rank=self.rank,
                world_size=self.world_size,
            )
            if self.rates[t] > 0 and len(sampler) == 0:
                raise DataError(
                    f"tasks.{task.name}: {n} training examples make no full batch of "
                    f"{sizes[t]} examples on each of {self.world_size} ranks"
                )
            samplers.append(sampler)
        examples = [self._train_examples(t) for t in range(len(modules))]
        collators = [dm.collator for dm in modules]
        if self.mixing == "row":
            rows = self.tasks[0].data.batch_size
            self._sampler = RowMixtureBatchSampler(
                samplers,
                self.rates,
                batch_size=rows,
                seed=self.seed,
                accumulate=self.accumulate,
                progress=self.schedule_progress,
            )
            dataset = RowMixtureBatches(examples, collators, self.seed)
        else:
            self._sampler = MixtureBatchSampler(
                samplers, self.rates, seed=self.seed, accumulate=self.accumulate, progress=self.schedule_progress
            )
            dataset = _MixtureBatches(examples, collators, self.seed)
        return EpochLoader(
            dataset,
            sampler=self._sampler,
            owner=self,
            batch_size=None,
            num_workers=self.tokenizer_data.num_workers,
            pin_memory=torch.cuda.is_available(),
        )

    def val_dataloader(self) -> list:
        modules = self._ready()
        return [modules[t].val_dataloader() for t in self.val_tasks]

    def test_dataloader(self) -> list:
        modules = self._ready()
        return [modules[t].test_dataloader() for t in self.test_tasks]

    def generation_dataloader(self):
        """Validation batches whose texts prompt the sample generations: those of the first task
        that writes text left to right (clm, prefix_lm, seq2seq), else of the first task."""
        tasks = self.val_tasks
        if not tasks:
            return []
        writes = [t for t in tasks if self.tasks[t].objective in ("clm", "prefix_lm", "seq2seq")]
        return self._ready()[(writes or tasks)[0]].val_dataloader()

    def summaries(self) -> dict[str, dict]:
        """{task: {split: what preparing it did}} (prepare.format_summary prints each; `kind` says
        whether its units are packed blocks or examples)."""
        return {
            task.name: {
                split: dict(summary, kind="lm" if objective_kind(task.pipeline) == "lm" else "examples")
                for split, summary in dm._prepared.summaries.items()
            }
            for task, dm in zip(self.tasks, self._ready())
        }

    def state_dict(self) -> dict:
        return {
            "micro_batches": self._micro,
            "task_batches": list(self._task_batches),
            "seed": self.seed,
            "origins": [list(o) for o in self._origins],
            **self._layout(),
        }

    def load_state_dict(self, state: dict) -> None:
        counts = [int(c) for c in state["task_batches"]]
        if len(counts) != len(self.tasks):
            raise DataError(
                f"the checkpoint's data state counts {len(counts)} tasks but this mixture has "
                f"{len(self.tasks)}; resume a mixture with the tasks it was trained with"
            )
        self._micro, self._task_batches = int(state["micro_batches"]), counts
        # checkpoints written before the layout was saved resume as on this layout
        self._saved_layout = {k: state[k] for k in MIXTURE_LAYOUT_KEYS} if "world_size" in state else None
        self._origins = [tuple(int(x) for x in o) for o in state.get("origins", [(0, 0, 0)] * len(self.tasks))]

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if self.trainer is None or self.trainer.training:
            self._micro += 1
            if "row_task" in batch:  # mixing="row": each task's rows
                for t, rows in enumerate(torch.bincount(batch["row_task"], minlength=len(self.tasks)).tolist()):
                    self._task_batches[t] += rows
            else:
                self._task_batches[batch["task"]] += 1
        return batch

    # ------------------------------------------------------------------ what training needs

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self.setup()
        return self._tokenizer

    @property
    def special_tokens(self) -> SpecialTokens:
        return SpecialTokens.from_tokenizer(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def mode_token_ids(self) -> dict[str, int]:
        """{token: id} of tokenizer.extra_special_tokens."""
        self.tokenizer  # noqa: B018  (resolves it)
        return dict(self._mode_ids)

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    @property
    def rates(self) -> list[float]:
        if self._rates is None:
            self.setup()
        return list(self._rates)

    @property
    def train_sizes(self) -> list[int]:
        """Training examples (blocks, or pairs) per task, over all ranks."""
        return [len(self._train_examples(t)) for t in range(len(self.tasks))]

    @property
    def val_tasks(self) -> list[int]:
        """The task of each val_dataloader() entry."""
        return self._tasks_with("validation")

    @property
    def test_tasks(self) -> list[int]:
        return self._tasks_with("test")

    def bytes_per_token_of(self, t: int, split: str = "validation") -> float | None:
        return self._ready()[t].split_bytes_per_token(split)

    @property
    def label_names(self) -> None:
        return None

    @property
    def num_labels(self) -> None:
        return None

    # ------------------------------------------------------------------ internals

    def _resolve_tokenizer(self, *, build: bool) -> None:
        cfg, data = self.tokenizer_cfg, self.tokenizer_data
        tok, _, _ = resolve_tokenizer(data, cfg, build_sources(data, self.tokenizer_pipeline), build=build)
        self._mode_ids = check_extra_special_tokens(tok, cfg.extra_special_tokens, cfg.path or "the trained tokenizer")
        if cfg.path:
            path = Path(cfg.path)
        else:
            # a file named by its content: every rank and every later run finds the same one
            text = tok.to_str(pretty=True)
            digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
            path = cache_root(data.cache_dir).expanduser().resolve() / "tokenizers" / f"shared-{digest}.json"
            if not path.is_file():
                save_tokenizer(tok, path)
        self._tokenizer, self._tokenizer_path = tok, str(path)

    def _write_run_files(self) -> None:
        if self.run_dir is not None:
            prepared = Prepared(
                self.tokenizer_pipeline, self._tokenizer, SpecialTokens.from_tokenizer(self._tokenizer), sources={}
            )
            write_run_files(prepared, self.run_dir, self.tokenizer_data.task)

    def _task_modules(self) -> list[TextDataModule]:
        if self._modules is None:
            tok_cfg = dataclasses.replace(self.tokenizer_cfg, path=self._tokenizer_path)
            # rank and world size as given, else read when each loader is built (torch.distributed is
            # initialised by then under DDP/FSDP; commands/train.py prepares data before the trainer exists)
            self._modules = [
                TextDataModule(
                    task.data,
                    tok_cfg,
                    task.pipeline,
                    seed=self.seed + t,
                    run_dir=None,
                    model_vocab_size=self.model_vocab_size,
                    rank=self._rank,
                    world_size=self._world,
                )
                for t, task in enumerate(self.tasks)
            ]
        return self._modules

    def _ready(self) -> list[TextDataModule]:
        if self._rates is None:
            self.setup()
        return self._modules

    def _train_examples(self, t: int):
        return self._ready_module(t)._datasets["train"]

    def _ready_module(self, t: int) -> TextDataModule:
        if self._modules is None or self._modules[t]._prepared is None:
            self.setup()
        return self._modules[t]

    def _tasks_with(self, split: str) -> list[int]:
        return [t for t in range(len(self.tasks)) if split in self._ready_module(t)._prepared.sources]

    def _begin_train_epoch(self) -> None:
        if self._saved_layout is not None and self._sampler is not None:
            self._carry(self._saved_layout)
        self._saved_layout = None
        if self._sampler is not None:
            self._sampler.resume(self._micro, self._task_batches, self._origins)

    def _layout(self) -> dict:
        """How this run cuts its data into optimizer steps (MIXTURE_LAYOUT_KEYS)."""
        batch_sizes = [task.data.batch_size for task in self.tasks]  # examples per micro-batch (row: of all tasks)
        return dict(world_size=self.world_size, batch_sizes=batch_sizes, accumulate=self.accumulate)

    def _batch_sizes(self) -> list[int]:
        """Examples per batch of each task's sampler: its data.batch_size, or one row (mixing="row")."""
        return [1 if self.mixing == "row" else task.data.batch_size for task in self.tasks]

    def _carry(self, saved: dict) -> None:
        """The resumed position, counted on the `saved` layout, as this layout's (module docstring)."""
        if saved == self._layout():
            return
        micro, world, accumulate = self._micro, saved["world_size"], saved["accumulate"]
        if micro % accumulate:
            raise DataError(
                f"the checkpoint stopped after {micro} micro-batches on each of {world} ranks, inside an optimizer "
                f"step of trainer.accumulate_grad_batches={accumulate}; resume it on that layout"
            )
        # each task goes on from the position its global micro-batches reached, in steps of this layout;
        # with mixing="row" a task's count is rows, each the next position on every rank
        steps = [1] * len(self.tasks) if self.mixing == "row" else saved["batch_sizes"]
        self._origins = [
            (count, *cursor(count, origin, sampler.num_examples, size * world))
            if sampler.num_examples >= size * world
            else origin  # no whole micro-batch: never drawn
            for sampler, count, origin, size in zip(self._sampler.samplers, self._task_batches, self._origins, steps)
        ]
        self.carried = (micro, micro // accumulate * self.accumulate)  # training.checkpoints.ResumeCounters
        self._micro = self.carried[1]
