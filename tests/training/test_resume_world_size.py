"""Resuming on another world size: a run saved on 2 ranks continues on 1 and a run saved on 1
continues on 2, under DDP and FSDP2 and for a mixture, as if it had run on the new layout from
the start: the same examples in every optimizer step (each step's rows, as a multiset), the same
epochs and validation steps, and the same losses.

The sampler's invariant (data/batches/sampler.py): the union of every rank's first K batches of an epoch
is the epoch order's first K x batch x ranks examples, so the new ranks skip that prefix. With
data.max_train_bytes=950 the corpus packs into 25 blocks: 4 optimizer steps of 6 blocks per epoch
on either layout (1 x 3 x 2 accumulated, or 2 ranks x 3), so the 7 steps cross an epoch's end,
with validation every 2 steps. Runs happen in processes of their own (a DDP or FSDP trainer on one
process still starts a process group, which must not outlive the run inside pytest), forked by the
launcher (tests/launcher.py): one for the references and the 1-rank starts, two for every 2-rank
run, one for the 1-rank resumes.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml
from helpers import RECIPES, TINY_RUN

from lit_transformer.data.batches.mixture_sampling import MixtureBatchSampler, task_for_step
from lit_transformer.data.batches.sampler import ResumableBatchSampler, TokenBatchSampler, cursor
from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.modules.text_module import TextDataModule
from lit_transformer.errors import DataError, RunError
from lit_transformer.training.checkpoints import accumulate_for

STEPS = 7
TOK = TokenizerConfig(vocab_size=400, num_sentinels=0)
COMMON = [
    *TINY_RUN,
    "data.max_train_bytes=950",
    "model.dropout=0.0",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.checkpoint_every_n_steps=1",
    f"trainer.keep_checkpoints={STEPS}",
]
ONE = ["trainer.devices=1", "data.batch_size=3", "trainer.accumulate_grad_batches=2"]  # global batch 6
TWO = ["trainer.devices=2", "data.batch_size=3"]  # global batch 6, accumulation left to resume
WIDE = ["trainer.devices=1", "data.batch_size=6"]  # global batch 6 in one micro-batch

# Each rank records, per training micro-batch: the optimizer step it belongs to, the epoch, its
# loss as Lightning returns it (divided by the accumulation) and its rows without padding; and
# the steps after which validation ran.
_SCRIPT = r"""
import json
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from lit_transformer.commands.train import train
from lit_transformer.recipe.load import load_recipe
from helpers import StopAt  # tests/ is on the scripts' path (helpers.job_env)


class Record(Callback):
    def __init__(self, out):
        self.out, self.rows, self.validated = Path(out), [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.at = (trainer.global_step, trainer.current_epoch)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", torch.ones_like(ids))
        rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        self.rows.append({"step": self.at[0], "epoch": self.at[1], "loss": float(outputs["loss"]), "rows": rows})

    def on_validation_end(self, trainer, module):
        self.validated.append(trainer.global_step)

    def on_train_end(self, trainer, module):
        self.out.mkdir(parents=True, exist_ok=True)
        done = {"rows": self.rows, "validated": self.validated, "step": trainer.global_step}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(done))


for recipe, overrides, stop, record in json.loads(Path(sys.argv[1]).read_text()):
    callbacks = [Record(record)] + ([StopAt(stop)] if stop else [])
    train(load_recipe(recipe, overrides), callbacks=callbacks, progress_bar=False)
"""


def _job(out: Path, name: str, recipe: str, layout: list[str], *, stop: int | None = None, resume: bool = False):
    part = "resumed" if resume else "first"
    overrides = [*COMMON, *layout, f"run.dir={out / name}", *(["resume=auto"] if resume else [])]
    return [str(RECIPES / f"tiny-{recipe}.yaml"), overrides, stop, str(out / name / f"record-{part}")]


def _launch(launcher, out: Path, cache: Path, label: str, jobs: list, ranks: int) -> None:
    (out / f"{label}.json").write_text(json.dumps(jobs))
    script = out / "run.py"
    script.write_text(_SCRIPT)
    launcher.run(script, [str(out / f"{label}.json")], cache, out, timeout=400, ranks=ranks)


def _cut(run: Path, copy: Path, step: int) -> None:
    """`copy`: the run `run` as if killed after `step` (its step-N checkpoints after it removed)."""
    shutil.copytree(run, copy)
    for ckpt in (copy / "checkpoints").glob("*.ckpt"):
        if ckpt.name == "last.ckpt" or int(ckpt.stem.split("-")[1]) > step:
            shutil.rmtree(ckpt) if ckpt.is_dir() else ckpt.unlink()
    shutil.rmtree(copy / "record-first")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launcher) -> Path:
    out, cache = tmp_path_factory.mktemp("world"), tmp_path_factory.mktemp("cache")
    ddp, fsdp = ["trainer.strategy=ddp"], ["trainer.strategy=fsdp"]
    _launch(
        launcher,
        out,
        cache,
        "one-first",
        [
            _job(out, "clm", "clm", [*ONE, *ddp]),  # the reference, and (cut at 3) the 1 -> 2 start
            _job(out, "mix-wide", "unilm", [*WIDE, *ddp]),
            _job(out, "mix", "unilm", [*ONE, *ddp]),
            _job(out, "fsdp-1to2", "clm", [*ONE, *fsdp], stop=4),  # stopped at the end of epoch 0
        ],
        ranks=1,
    )
    _cut(out / "clm", out / "ddp-1to2", 3)
    _cut(out / "mix", out / "mix-accumulated-1to2", 3)
    _cut(out / "mix-wide", out / "mix-1to2", 3)
    _launch(
        launcher,
        out,
        cache,
        "two",
        [
            _job(out, "ddp-1to2", "clm", [*ONE, *ddp, *TWO], resume=True),
            _job(out, "ddp-2to1", "clm", [*TWO, *ddp], stop=3),
            _job(out, "mix-accumulated-1to2", "unilm", [*ONE, *ddp, *TWO], resume=True),
            _job(out, "mix-1to2", "unilm", [*WIDE, *ddp, *TWO], resume=True),
            _job(out, "mix-2to1", "unilm", [*TWO, *ddp], stop=3),
            _job(out, "fsdp-1to2", "clm", [*ONE, *fsdp, *TWO], resume=True),
            _job(out, "fsdp-2to1", "clm", [*TWO, *fsdp], stop=4),
        ],
        ranks=2,
    )
    _launch(
        launcher,
        out,
        cache,
        "one-resumed",
        [
            _job(out, "ddp-2to1", "clm", [*TWO, *ddp, "trainer.devices=1"], resume=True),
            _job(out, "mix-2to1", "unilm", [*TWO, *ddp, *WIDE], resume=True),
            _job(out, "fsdp-2to1", "clm", [*TWO, *fsdp, "trainer.devices=1"], resume=True),
        ],
        ranks=1,
    )
    return out


def _steps(record: Path) -> dict[int, dict]:
    """Per optimizer step over all ranks: its rows (a multiset), epoch and loss (the ranks' mean
    of the summed micro-batch losses, each already divided by the accumulation)."""
    ranks = [json.loads(p.read_text()) for p in sorted(record.glob("rank*.json"))]
    steps: dict[int, dict] = {}
    for rank in ranks:
        for row in rank["rows"]:
            step = steps.setdefault(row["step"], {"rows": Counter(), "epochs": set(), "loss": 0.0})
            step["rows"].update(tuple(r) for r in row["rows"])
            step["epochs"].add(row["epoch"])
            step["loss"] += row["loss"] / len(ranks)
    return steps


def _validated(record: Path) -> list[int]:
    return json.loads((record / "rank0.json").read_text())["validated"]


# name: (reference run, where the resumed run stopped, its accumulation after resuming, loss tolerance)
CASES = {
    "ddp-2to1": ("clm", 3, 2, 1e-5),
    "ddp-1to2": ("clm", 3, 1, 1e-5),
    "fsdp-2to1": ("clm", 4, 2, 1e-5),
    "fsdp-1to2": ("clm", 4, 1, 1e-5),
    "mix-2to1": ("mix-wide", 3, 1, 1e-5),
    "mix-1to2": ("mix-wide", 3, 1, 1e-5),
    # the same examples, but not the same losses: an accumulated step averages its micro-batches'
    # token means, where 2 ranks take one mean over both, and MLM masks (and prefix LM targets)
    # differ in count between micro-batches (docs/scaling.md, "Limits"): only the examples compare
    "mix-accumulated-1to2": ("mix", 3, 1, None),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_resume_on_another_world_size_continues_the_run_exactly(runs, name):
    reference, stop, accumulate, tolerance = CASES[name]
    expected = _steps(runs / reference / "record-first")
    assert sorted(expected) == list(range(STEPS))
    if reference == "clm":  # 4 steps an epoch (a mixture's loader is endless: one epoch)
        assert {s: e["epochs"] for s, e in expected.items()} == {s: {s // 4} for s in range(STEPS)}
    first = runs / name / "record-first"  # absent where the start is the reference's own steps
    resumed = _steps(runs / name / "record-resumed")
    assert sorted(resumed) == list(range(stop, STEPS)), sorted(resumed)
    got = {**(_steps(first) if first.is_dir() else {}), **resumed}
    for step in range(0 if first.is_dir() else stop, STEPS):
        assert got[step]["rows"] == expected[step]["rows"], f"step {step}: other examples"
        assert got[step]["epochs"] == expected[step]["epochs"], step
    if tolerance is not None:
        losses = [got[s]["loss"] for s in range(stop, STEPS)]
        assert losses == pytest.approx([expected[s]["loss"] for s in range(stop, STEPS)], abs=tolerance, rel=0)
    # validation every 2 steps, as in the reference (which validated at 2, 4, 6 and after the end)
    assert _validated(runs / name / "record-resumed") == [
        s for s in _validated(runs / reference / "record-first") if s > stop
    ]
    saved = yaml.safe_load((runs / name / "config.yaml").read_text())
    assert saved["trainer"]["accumulate_grad_batches"] == accumulate  # what the resume chose, recorded


# ----------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("world, batch, new_world, new_batch", [(2, 3, 1, 3), (1, 3, 2, 3), (2, 3, 1, 6), (3, 2, 2, 3)])
def test_carry_skips_the_prefix_every_rank_had_used(world, batch, new_world, new_batch):
    n, done = 100, 4  # batches per rank on the saved layout

    def union(w, b, skip):
        keys = []
        for r in range(w):
            sampler = ResumableBatchSampler(n, b, seed=3, rank=r, world_size=w)
            sampler.set_epoch(1)
            sampler.resume(1, skip)
            keys += [i for _, _, idx in sampler for i in idx]
        return keys

    seen = set(union(world, batch, 0)) - set(union(world, batch, done))
    carried = ResumableBatchSampler(n, new_batch, rank=0, world_size=new_world).carry(done, world, batch)
    rest = union(new_world, new_batch, carried)
    assert not seen & set(rest) and len(seen) == done * batch * world
    start = ResumableBatchSampler(n, 1, seed=3)
    start.set_epoch(1)
    order = [i for _, _, (i,) in start]
    assert set(order[: len(seen)]) == seen and set(rest) == set(order[len(seen) : len(seen) + len(rest)])


def test_carry_refuses_a_prefix_that_splits_a_global_micro_batch_and_keeps_a_finished_epoch_finished():
    sampler = ResumableBatchSampler(100, 3, world_size=4)  # 12 examples a global micro-batch
    assert sampler.carry(3, 1, 6) is None  # 18 examples
    assert sampler.carry(4, 1, 6) == 2
    assert sampler.carry(16, 1, 6) == len(sampler) == 8  # 16 x 6 = 96: the saved epoch had ended
    tokens = TokenBatchSampler([5] * 20 + [9] * 20, 20, world_size=2)  # whole batches are the unit
    assert tokens.carry(3, 1, 1) is None and tokens.carry(4, 1, 1) == 2 and tokens.carry(3, 4, 1) == len(tokens) == 7


def test_accumulation_keeps_the_global_batch_or_says_what_to_set():
    state = {"world_size": 2, "batch_size": 3, "batch_tokens": None, "accumulate": 1, "epoch": 0, "batches": 3}
    assert accumulate_for(state, world_size=1, units=[3], accumulate=1, path="x") == 2  # adjusted
    assert accumulate_for(state, world_size=1, units=[6], accumulate=1, path="x") == 1  # already kept
    with pytest.raises(RunError, match="set trainer.accumulate_grad_batches=2$"):
        accumulate_for(state, world_size=1, units=[3], accumulate=3, path="x")  # set by hand, wrongly
    with pytest.raises(RunError, match="so that batch x accumulation x 4 = 6"):
        accumulate_for(state, world_size=4, units=[3], accumulate=1, path="x")
    old = {"epoch": 0, "batches": 3, "seed": 0}  # written before layouts were saved: as before
    assert accumulate_for(old, world_size=1, units=[3], accumulate=1, path="x") == 1
    mixture = {"world_size": 1, "batch_sizes": [2, 4], "accumulate": 4, "micro_batches": 8}
    assert accumulate_for(mixture, world_size=2, units=[2, 4], accumulate=4, path="x") == 2
    with pytest.raises(RunError, match="choose data.batch_size"):
        accumulate_for(mixture, world_size=2, units=[4, 4], accumulate=4, path="x")


def _module(tmp_path, world: int, rank: int = 0, **data):
    cfg = dict(cache_dir=str(tmp_path / "cache"), max_train_bytes=30_000, max_val_bytes=5_000, block_size=24)
    dm = TextDataModule(DataConfig(**{**cfg, "batch_size": 3, **data}), TOK, "clm", seed=7, rank=rank, world_size=world)
    dm.prepare_data()
    dm.setup()
    return dm


def _rows(batches) -> Counter:
    return Counter(tuple(row.tolist()) for batch in batches for row in batch["input_ids"])


def test_module_resumes_on_one_rank_where_two_stopped(tmp_path):
    used, state = Counter(), None
    for rank in range(2):  # both ranks of a 2-rank run take 4 batches of 3
        dm = _module(tmp_path, 2, rank)
        it = iter(dm.train_dataloader())
        used += _rows(dm.on_before_batch_transfer(next(it), 0) for _ in range(4))
        state = dm.state_dict()
    assert state["world_size"] == 2 and state["batches"] == 4 and state["batch_size"] == 3
    whole = list(_module(tmp_path, 1).train_dataloader())  # one rank of 3 from the start
    resumed = _module(tmp_path, 1)
    resumed.load_state_dict(state)
    rest = list(resumed.train_dataloader())
    assert resumed.carried == (4, 8) and resumed.state_dict()["batches"] == 8
    assert used == _rows(whole[:8]) and _rows(rest) == _rows(whole[8:])

    old = _module(tmp_path, 1)  # a checkpoint from before layouts were saved: skips as it always did
    old.load_state_dict({"epoch": 0, "batches": 4, "seed": 7})
    assert _rows(old.train_dataloader()) == _rows(whole[4:]) and old.carried is None

    split = _module(tmp_path, 4)  # 24 examples used; 4 ranks of 3 take 12 a micro-batch: 2 each
    split.load_state_dict(state)
    assert len(list(split.train_dataloader())) == len(split._train_sampler) - 2
    uneven = _module(tmp_path, 4)
    uneven.load_state_dict({**state, "batches": 3})  # 18 examples: not a whole number of 12
    with pytest.raises(
        DataError, match=r"18 examples, not a whole number of global micro-batches of 12 examples on 4 ranks"
    ):
        iter(uneven.train_dataloader())


def test_streaming_refuses_another_layout(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i} of a small streamed corpus to read\n" for i in range(2000)))
    stream = _module(tmp_path, 1, train_files=[str(corpus)], text_format="lines", streaming=True, val_fraction=0.01)
    stream.load_state_dict(
        {"epoch": 0, "batches": 4, "seed": 7, "world_size": 2, "batch_size": 3, "batch_tokens": None, "accumulate": 1}
    )
    with pytest.raises(DataError, match="data.streaming=true resumes only on the layout it was saved with"):
        iter(stream.train_dataloader())


def test_a_mixture_resumes_on_two_ranks_inside_a_task_epoch_that_a_step_crossed():
    """One rank accumulating 2 micro-batches of 3 crosses a task's epoch end inside a step when
    the epoch holds an odd number of batches (40 examples: 13); on 2 ranks of 3 the task goes on
    from that odd position of its new epoch, every example of which is then used once."""
    sizes, seed, rates = (25, 40), 5, [0.5, 0.5]

    def samplers(world, rank):
        return [ResumableBatchSampler(n, 3, seed=seed + t, rank=rank, world_size=world) for t, n in enumerate(sizes)]

    one = MixtureBatchSampler(samplers(1, 0), rates, seed=seed, accumulate=2)
    keys = list(itertools.islice(iter(one), 200))
    counts = [0, 0]
    for stop in range(1, 100):  # the first step after which task 1 stands at an odd position
        counts = [sum(t == task for t, _, _ in keys[: 2 * stop]) for task in (0, 1)]
        if cursor(counts[1], (0, 0, 0), 40, 3)[1] % 6:
            break
    epoch, position = cursor(counts[1], (0, 0, 0), 40, 3)
    assert position % 6 and epoch >= 1
    ranks = []
    for rank in range(2):
        sampler = MixtureBatchSampler(samplers(2, rank), rates, seed=seed, accumulate=1)
        origins = [(c, *cursor(c, (0, 0, 0), n, 3)) for c, n in zip(counts, sizes)]
        sampler.resume(stop, counts, origins)  # 2 x stop micro-batches of 1 rank: `stop` steps
        ranks.append(list(itertools.islice(iter(sampler), 60)))
    assert [t for t, _, _ in ranks[0]] == [task_for_step(seed, s, rates) for s in range(stop, stop + 60)]
    order = ResumableBatchSampler(40, 1, seed=seed + 1).order(epoch)
    before = [i for t, (e, _, idx), _ in keys[: 2 * stop] if t == 1 and e == epoch for i in idx]
    after = [i for r in (0, 1) for t, (e, _, idx), _ in ranks[r] if t == 1 and e == epoch for i in idx]
    assert sorted(before) == sorted(order[:position].tolist())  # the epoch's first `position` examples
    assert sorted(after) == sorted(order[position : position + len(after)].tolist())  # then the rest, once
    assert len(after) == (40 - position) // 6 * 6
