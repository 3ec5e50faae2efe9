"""TextDataModule: DDP shards, exact resume (with Lightning too), embedded tasks, properties."""

import collections
import json
import math
import pickle
import re

import numpy as np
import pytest
import torch

from lit_transformer.data.batches.sampler import ResumableBatchSampler
from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.modules.text_module import TextDataModule
from lit_transformer.data.sources import stdlib

TOK = TokenizerConfig(vocab_size=600, num_sentinels=20)


def lm_cfg(tmp_path, **kw):
    base = dict(
        cache_dir=str(tmp_path / "cache"), max_train_bytes=150_000, max_val_bytes=30_000, block_size=32, batch_size=8
    )
    return DataConfig(**{**base, **kw})


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [50, 61])
def test_shards_are_disjoint_and_cover(world, n):
    for epoch in (0, 1):
        shards = []
        for rank in range(world):
            s = ResumableBatchSampler(n, 4, seed=3, rank=rank, world_size=world, drop_last=False, pad_uneven=False)
            s.set_epoch(epoch)
            keys = list(s)
            assert len(keys) == len(s)
            shards.append([i for _, _, idx in keys for i in idx])
        flat = [i for s in shards for i in s]
        assert len(flat) == len(set(flat)) == n  # disjoint and covering

        train = []
        for rank in range(world):
            s = ResumableBatchSampler(n, 4, seed=3, rank=rank, world_size=world, drop_last=True)
            s.set_epoch(epoch)
            train.append([i for _, _, idx in s for i in idx])
        assert len({len(t) for t in train}) == 1  # same number of batches on every rank
        flat = [i for t in train for i in t]
        assert len(flat) == len(set(flat)) and n - len(flat) < world * 4


def test_padding_only_evens_out_uneven_ranks():
    lengths = []
    for rank in range(3):
        s = ResumableBatchSampler(10, 2, rank=rank, world_size=3, drop_last=False, shuffle=False)
        lengths.append(sum(len(idx) for _, _, idx in s))
    assert lengths == [4, 4, 4]


def test_module_shards_under_ddp(tmp_path):
    seen = []
    for rank in range(2):
        dm = TextDataModule(lm_cfg(tmp_path), TOK, "clm", seed=1, rank=rank, world_size=2)
        dm.prepare_data()
        dm.setup()
        loader = dm.train_dataloader()
        seen.append({i for _, _, idx in loader.sampler for i in idx})
        assert len(next(iter(loader))["input_ids"]) == 8
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) > 0.95 * len(dm._datasets["train"])


def _consume(dm, loader, k):
    it = iter(loader)
    out = []
    for _ in range(k):
        out.append(dm.on_before_batch_transfer(next(it), 0))  # what Lightning calls per training batch
    return out


@pytest.mark.parametrize("objective", ["mlm", "span"])
def test_resume_replays_exactly_the_remaining_batches(tmp_path, objective):
    cfg = lm_cfg(tmp_path)
    make = lambda: TextDataModule(cfg, TOK, objective, seed=11)  # noqa: E731
    ref = make()
    ref.prepare_data()
    ref.setup()
    epoch0, epoch1 = list(ref.train_dataloader()), list(ref.train_dataloader())
    assert len(epoch0) > 6 and not same(epoch0[0], epoch1[0])  # epochs reshuffle

    first = make()
    first.setup()
    seen = _consume(first, first.train_dataloader(), 5)
    state = first.state_dict()
    assert state["epoch"] == 0 and state["batches"] == 5

    resumed = make()
    resumed.load_state_dict(state)
    resumed.setup()
    rest = list(resumed.train_dataloader())
    assert len(seen) + len(rest) == len(epoch0)
    assert all(same(a, b) for a, b in zip(seen + rest, epoch0))
    assert all(same(a, b) for a, b in zip(list(resumed.train_dataloader()), epoch1))


def test_workers_do_not_change_batches(tmp_path):
    cfg = lm_cfg(tmp_path)
    a = TextDataModule(cfg, TOK, "mlm", seed=2)
    a.setup()
    b = TextDataModule(DataConfig(**{**cfg.__dict__, "num_workers": 2}), TOK, "mlm", seed=2)
    b.setup()
    batches_a, batches_b = list(a.train_dataloader())[:6], list(b.train_dataloader())[:6]
    assert all(same(x, y) for x, y in zip(batches_a, batches_b))
    blocks = a._datasets["train"]
    payload = pickle.dumps(blocks)  # what a spawned worker receives: the path, not the tokens
    assert len(payload) < 1000 and np.array_equal(pickle.loads(payload)[7], blocks[7])


def test_lightning_checkpoint_resume_sees_the_same_batches(tmp_path):
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(600, 8)
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["input_ids"].sum().item() * 1000003 + batch["labels"].clamp(min=0).sum().item())
            logits = self.emb(batch["input_ids"]) @ self.emb.weight.T  # (B, T, V)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

        def validation_step(self, batch, batch_idx):
            self.log("val", batch["input_ids"].float().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cfg = lm_cfg(tmp_path, max_train_bytes=10_000, batch_size=16)
    common = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        val_check_interval=3,
        num_sanity_val_steps=1,
    )
    dm = TextDataModule(cfg, TOK, "mlm", seed=5)
    full = Recorder()
    L.Trainer(max_steps=12, enable_checkpointing=False, **common).fit(full, datamodule=dm)
    per_epoch = len(dm.train_dataloader())
    assert per_epoch < 12  # the run crosses an epoch boundary

    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    part = Recorder()
    L.Trainer(max_steps=4, callbacks=[ckpt], **common).fit(part, datamodule=TextDataModule(cfg, TOK, "mlm", seed=5))
    path = next((tmp_path / "ckpt").glob("*step=4*.ckpt"))
    saved = torch.load(path, weights_only=False)
    assert saved["TextDataModule"]["batches"] == 4
    rest = Recorder()
    L.Trainer(max_steps=12, enable_checkpointing=False, **common).fit(
        rest, datamodule=TextDataModule(cfg, TOK, "mlm", seed=5), ckpt_path=str(path)
    )
    assert part.seen == full.seen[:4]
    assert rest.seen == full.seen[4:]


def test_training_needs_are_exposed(tmp_path):
    dm = TextDataModule(lm_cfg(tmp_path), TOK, "clm", run_dir=str(tmp_path / "run"))
    dm.prepare_data()
    dm.setup()
    assert (tmp_path / "run" / "tokenizer.json").exists()
    assert dm.special_tokens.eos_id is not None and dm.vocab_size == dm.tokenizer.get_vocab_size()
    assert 1.5 < dm.bytes_per_token < 8  # code with a 600-token BPE
    val = list(dm.val_dataloader())
    assert val and val[0]["input_ids"].shape[1] == 32
    assert dm.num_labels is None


def test_embedded_classification_task(tmp_path):
    splits = stdlib.classification_examples()
    labels = sorted({ex["label"] for ex in splits["train"]})
    assert labels == sorted(stdlib.CLASSIFY_PACKAGES) and len(labels) == 8
    for name, examples in splits.items():
        counts = collections.Counter(ex["label"] for ex in examples)
        assert len(set(counts.values())) == 1, (name, counts)  # balanced
    sizes = {k: len(v) for k, v in splits.items()}
    assert sizes["train"] >= 8 * 100 and sizes["validation"] >= 8 * 20
    texts = {k: {ex["text"] for ex in v} for k, v in splits.items()}
    assert not texts["train"] & texts["validation"] and not texts["train"] & texts["test"]
    assert stdlib._classification_examples() == splits  # a second build gives the same split

    # learnable well above the 12.5% majority baseline: multinomial naive Bayes on words
    words = lambda t: re.findall(r"[a-z]+", t.lower())  # noqa: E731
    counts = {c: collections.Counter() for c in labels}
    for ex in splits["train"]:
        counts[ex["label"]].update(words(ex["text"]))
    vocab = set().union(*counts.values())
    totals = {c: sum(counts[c].values()) + len(vocab) for c in labels}
    correct = 0
    for ex in splits["test"]:
        score = {c: sum(math.log((counts[c][w] + 1) / totals[c]) for w in words(ex["text"])) for c in labels}
        correct += max(score, key=score.get) == ex["label"]
    assert correct / len(splits["test"]) > 0.5

    dm = TextDataModule(
        DataConfig(cache_dir=str(tmp_path / "cache"), batch_size=16, max_length=64),
        TokenizerConfig(kind="wordpiece", vocab_size=2000, num_sentinels=0),
        "classify",
        run_dir=str(tmp_path / "run"),
    )
    dm.prepare_data()
    dm.setup()
    assert dm.num_labels == 8 and dm.label_names == labels
    assert json.loads((tmp_path / "run" / "labels.json").read_text())["labels"] == labels
    batch = next(iter(dm.train_dataloader()))
    assert batch["labels"].dtype == torch.long and batch["input_ids"].shape[1] <= 64
    assert sum(len(b["labels"]) for b in dm.test_dataloader()) == sizes["test"]


def test_embedded_seq2seq_task(tmp_path):
    splits = stdlib.seq2seq_examples()
    assert len(splits["train"]) > 1000 and len(splits["validation"]) > 50
    assert not {e["source"] for e in splits["train"]} & {e["source"] for e in splits["validation"]}
    assert all(re.fullmatch(r"\w+", e["target"]) for e in splits["train"])
    dm = TextDataModule(
        DataConfig(cache_dir=str(tmp_path / "cache"), batch_size=4, max_length=24, max_target_length=8),
        TokenizerConfig(kind="unigram", vocab_size=1500, num_sentinels=0),
        "seq2seq",
    )
    dm.prepare_data()
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels"}
    assert batch["input_ids"].shape[1] <= 24 and batch["labels"].shape[1] <= 8
    assert (batch["decoder_input_ids"][:, 0] == dm.special_tokens.pad_id).all()


def test_the_embedded_tasks_are_kept_whole_between_processes(tmp_path, monkeypatch):
    """The parsed tasks are written once to the cache folder, read back by the next process
    (here: the next call), rebuilt where the file is damaged, and only built where the folder
    cannot be written."""
    monkeypatch.setenv("LIT_TRANSFORMER_CACHE", str(tmp_path / "cache"))
    builds = []

    def build():
        builds.append(1)
        return {"train": [{"source": "Return the sum.", "target": f"add{len(builds)}"}]}

    first = stdlib._kept("seq2seq", build)
    (kept,) = (tmp_path / "cache" / "stdlib-tasks").iterdir()
    assert kept.name.startswith("seq2seq-") and json.loads(kept.read_text()) == first
    assert stdlib._kept("seq2seq", build) == first and len(builds) == 1  # read, not built
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]  # no temporary file left
    kept.write_text('{"train": [')  # cut short
    assert stdlib._kept("seq2seq", build)["train"][0]["target"] == "add2" and len(builds) == 2
    assert json.loads(kept.read_text())["train"][0]["target"] == "add2"
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LIT_TRANSFORMER_CACHE", str(tmp_path / "file" / "cache"))  # not a folder
    assert stdlib._kept("seq2seq", build)["train"][0]["target"] == "add3"


def test_bytes_per_token_counts_documents_not_padding(tmp_path):
    dm = TextDataModule(lm_cfg(tmp_path), TOK, "mlm")
    dm.setup()
    meta = dm._prepared.entries["validation"].meta
    assert dm.bytes_per_token == pytest.approx(meta["bytes"] / meta["tokens"])
    tokens = np.asarray(dm._prepared.entries["validation"]["tokens"])
    text = dm.tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
    assert abs(len(text.encode()) - meta["bytes"]) < 0.01 * meta["bytes"]
