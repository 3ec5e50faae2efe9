"""Mixture data layer: rates, per-step task draws, the mixture sampler, prefix-LM and task
collators, mode tokens in the tokenizer, and MixtureDataModule (resume, Lightning)."""

import collections
import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lit_transformer.data.batches.collate import (
    IGNORE_INDEX,
    CLMCollator,
    MLMCollator,
    Seq2SeqCollator,
    example_generators,
)
from lit_transformer.data.batches.mixture_sampling import MixtureBatchSampler, mixture_rates, task_for_step
from lit_transformer.data.batches.prefix import DecoderPrefixCollator, EncoderDecoderPrefixCollator, TaskCollator
from lit_transformer.data.batches.progress import ScheduleProgress
from lit_transformer.data.batches.sampler import ResumableBatchSampler
from lit_transformer.data.data_config import DataConfig, TokenizerConfig
from lit_transformer.data.modules.mixture_module import MixtureDataModule, MixtureTask
from lit_transformer.data.modules.text_module import TextDataModule
from lit_transformer.data.tokens.tokenizer import (
    SpecialTokens,
    check_extra_special_tokens,
    save_tokenizer,
    train_tokenizer,
)
from lit_transformer.errors import DataError

V = 99  # odd vocabulary so a transposed axis fails loudly
NLU, NLG = 90, 91
SPECIAL = SpecialTokens(
    pad_id=0,
    unk_id=1,
    bos_id=2,
    eos_id=3,
    cls_id=4,
    sep_id=5,
    mask_id=6,
    sentinel_ids=tuple(range(98, 92, -1)),
    extra_ids=(NLU, NLG),
)


def same(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def ragged(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(7, 80, size=n) for n in lengths]


# ----------------------------------------------------------------------------- rates and draws


def test_mixture_rates_hand_computed():
    assert mixture_rates([5, 5], "weights", weights=[1, 3]) == pytest.approx([0.25, 0.75])
    assert mixture_rates([5, 7, 9], "weights") == pytest.approx([1 / 3] * 3)
    assert mixture_rates([100, 300, 600], "proportional") == pytest.approx([0.1, 0.3, 0.6])
    # T5's artificial limit K = 200: min(n, K) = 100, 200, 200
    assert mixture_rates([100, 300, 600], "proportional", cap=200) == pytest.approx([0.2, 0.4, 0.4])
    # temperature 2: sqrt(100), sqrt(400) = 10, 20
    assert mixture_rates([100, 400], "temperature", temperature=2.0) == pytest.approx([1 / 3, 2 / 3])
    assert mixture_rates([100, 400, 900], "temperature", temperature=2.0, cap=400) == pytest.approx([0.2, 0.4, 0.4])
    sizes = [10, 1000, 50_000]
    for cap in (None, 500):
        assert mixture_rates(sizes, "temperature", temperature=1.0, cap=cap) == pytest.approx(
            mixture_rates(sizes, "proportional", cap=cap)
        )
    assert mixture_rates(sizes, "temperature", temperature=1000.0) == pytest.approx([1 / 3] * 3, abs=0.01)
    assert sum(mixture_rates(sizes, "temperature", temperature=0.05)) == pytest.approx(1.0)  # no overflow
    assert mixture_rates([0, 10], "proportional") == [0.0, 1.0]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: mixture_rates([1, 2], "uniform"), "method='uniform'"),
        (lambda: mixture_rates([1, 2], "weights", weights=[1.0]), "1 weights for 2 tasks"),
        (lambda: mixture_rates([1, 2], "weights", weights=[1.0, -1.0]), "non-negative"),
        (lambda: mixture_rates([1, -2], "proportional"), "non-negative integers"),
        (lambda: mixture_rates([1, 2], "proportional", cap=0), "cap=0"),
        (lambda: mixture_rates([1, 2], "temperature", temperature=0.0), "temperature=0.0"),
        (lambda: mixture_rates([0, 0], "proportional"), "no training examples"),
        (lambda: mixture_rates([], "weights"), "no tasks"),
    ],
)
def test_mixture_rates_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "rates",
    [
        mixture_rates([1, 1, 1], "weights", weights=[1.0, 2.0, 5.0]),
        mixture_rates([300, 40_000, 2_000], "proportional", cap=5_000),
        mixture_rates([300, 40_000, 2_000], "temperature", temperature=3.0),
    ],
)
def test_task_frequencies_match_rates(rates):
    steps = 20_000
    counts = collections.Counter(task_for_step(7, s, rates) for s in range(steps))
    assert set(counts) <= set(range(len(rates)))
    for t, r in enumerate(rates):
        assert abs(counts[t] - steps * r) <= 4 * math.sqrt(steps * r * (1 - r)), (t, counts[t], steps * r)


def test_task_draws_are_keyed_by_seed_and_step_only():
    rates = [0.5, 0.5]
    first = [task_for_step(1, s, rates) for s in range(200)]
    assert [task_for_step(1, s, rates) for s in reversed(range(200))] == first[::-1]  # no hidden state
    assert [task_for_step(2, s, rates) for s in range(200)] != first
    assert all(task_for_step(3, s, [0.0, 1.0, 0.0]) == 1 for s in range(200))  # rate 0: never drawn


# ----------------------------------------------------------------------------- the mixture sampler


def mixture_sampler(rank=0, world=1, accumulate=1, sizes=(40, 25), batch=3, rates=(0.3, 0.7), seed=5):
    tasks = [ResumableBatchSampler(n, batch, seed=seed + t, rank=rank, world_size=world) for t, n in enumerate(sizes)]
    progress = ScheduleProgress(max_steps=1000)
    return MixtureBatchSampler(tasks, list(rates), seed=seed, accumulate=accumulate, progress=progress)


def take(sampler, k):
    it = iter(sampler)
    return [next(it) for _ in range(k)]


def test_ranks_draw_the_same_tasks_from_disjoint_shards():
    keys = [take(mixture_sampler(rank=r, world=2), 80) for r in range(2)]
    assert [k[0] for k in keys[0]] == [k[0] for k in keys[1]]
    assert [(t, e, b) for t, (e, b, _), _ in keys[0]] == [(t, e, b) for t, (e, b, _), _ in keys[1]]
    for (t, (_, _, a), _), (_, (_, _, b), _) in zip(*keys):
        assert len(a) == len(b) == 3 and not set(a) & set(b)
    assert {k[0] for k in keys[0]} == {0, 1}


def test_each_task_cycles_through_its_own_epochs():
    sampler = mixture_sampler(sizes=(40, 25), batch=3)
    keys = take(sampler, 100)
    for t, n in enumerate((40, 25)):
        # what a single-objective run with seed + t iterates, epoch after epoch
        single = ResumableBatchSampler(n, 3, seed=5 + t)
        expected = []
        for epoch in range(10):
            single.set_epoch(epoch)
            expected += list(single)
        mine = [key for task, key, _ in keys if task == t]
        assert mine == expected[: len(mine)]
        assert mine[-1][0] >= 2  # crossed epoch boundaries (13 and 8 batches per epoch)


def test_resumed_sampler_continues_exactly():
    full = take(mixture_sampler(accumulate=2), 90)
    for n in (0, 17, 40):
        counts = collections.Counter(t for t, _, _ in full[:n])
        resumed = mixture_sampler(accumulate=2)
        resumed.resume(n, [counts[0], counts[1]])
        assert take(resumed, 50) == full[n : n + 50]


def test_accumulated_micro_batches_share_their_step_task():
    keys = take(mixture_sampler(accumulate=2, rates=(0.5, 0.5)), 200)
    tasks = [t for t, _, _ in keys]
    # the share of the run done at its optimizer step rides with each key
    assert [done for _, _, done in keys] == [i // 2 / 1000 for i in range(200)]
    assert all(tasks[2 * k] == tasks[2 * k + 1] for k in range(100))
    assert tasks[::2] == [task_for_step(5, s, [0.5, 0.5]) for s in range(100)]
    assert len(set(tasks[::2])) == 2


def test_sampler_has_no_length_so_lightning_sees_an_infinite_loader():
    from lightning.fabric.utilities.data import has_len

    sampler = mixture_sampler()
    with pytest.raises(TypeError):
        len(sampler)
    loader = DataLoader(range(100), sampler=sampler, batch_size=None, collate_fn=lambda x: x)
    assert not has_len(loader)
    with pytest.raises(ValueError, match="task 1 is drawn"):
        mixture_sampler(sizes=(40, 2), batch=3)


# ----------------------------------------------------------------------------- collators


def test_decoder_prefix_collator():
    blocks = ragged([17, 17, 11, 17])  # T + 1 tokens; row 2 shorter (padded)
    collator = DecoderPrefixCollator(SPECIAL, 0.5)
    batch = collator(blocks, example_generators(0, 0, range(4)))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (4, 16)
    assert batch["prefix_lengths"].dtype == torch.long and batch["prefix_lengths"].shape == (4,)
    for row, block in enumerate(blocks):
        n, p = len(block) - 1, int(batch["prefix_lengths"][row])
        assert 1 <= p <= n - 1
        assert batch["input_ids"][row, :n].tolist() == block[:-1].tolist()
        labels = batch["labels"][row]
        assert (labels[: p - 1] == IGNORE_INDEX).all()  # targets inside the prefix
        assert labels[p - 1 : n].tolist() == block[p:].tolist()  # the tokens after the prefix
        assert (labels[n:] == IGNORE_INDEX).all()
    again = collator(blocks, example_generators(0, 0, range(4)))
    assert same(batch, again)
    alone = collator(blocks[2:3], example_generators(0, 0, [2]))  # a row is its own generator's
    assert alone["prefix_lengths"].tolist() == batch["prefix_lengths"][2:3].tolist()


def test_prefix_lengths_spread_around_the_fraction():
    collator = DecoderPrefixCollator(SPECIAL, 0.75)  # UL2's S-denoiser share
    blocks = ragged([101] * 400)
    p = collator(blocks, example_generators(1, 0, range(400)))["prefix_lengths"].float()
    # f uniform in [0.625, 0.875] over n = 100 tokens
    assert p.min() >= 62 and p.max() <= 88 and abs(p.mean().item() - 75) < 2 and p.std() > 5


def test_encoder_decoder_prefix_collator_splits_the_block():
    blocks = ragged([16, 16, 16])
    collator = EncoderDecoderPrefixCollator(SPECIAL, 0.5)
    batch = collator(blocks, example_generators(0, 0, range(3)))
    assert set(batch) == {"input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels"}
    for row, block in enumerate(blocks):
        enc_len = int(batch["attention_mask"][row].sum())
        dec_len = int(batch["decoder_attention_mask"][row].sum())
        p = enc_len - 1
        assert 1 <= p <= 15 and dec_len == 16 - p + 1
        source = batch["input_ids"][row, :enc_len].tolist()
        target = batch["labels"][row, :dec_len].tolist()
        assert source[-1] == target[-1] == SPECIAL.eos_id
        assert source[:-1] + target[:-1] == block.tolist()  # the split reconstructs the block
        assert (batch["labels"][row, dec_len:] == IGNORE_INDEX).all()
        assert batch["decoder_input_ids"][row, 0] == SPECIAL.decoder_start_id
        assert batch["decoder_input_ids"][row, 1:dec_len].tolist() == target[:-1]
    assert same(batch, collator(blocks, example_generators(0, 0, range(3))))
    assert (
        len({int(m.sum()) for m in collator(ragged([16] * 20), example_generators(2, 0, range(20)))["attention_mask"]})
        > 2
    )  # the split point varies by row


def test_task_collator_on_a_decoder():
    blocks = ragged([13, 13])
    gens = lambda: example_generators(0, 0, range(2))  # noqa: E731
    base = CLMCollator(special=SPECIAL)
    plain = base(blocks, gens())
    batch = TaskCollator(base, task=3, objective="clm", arch="decoder", mode_token_id=NLG)(blocks, gens())
    assert batch["task"] == 3 and batch["input_ids"].shape == (2, 13)
    assert (batch["input_ids"][:, 0] == NLG).all() and (batch["attention_mask"][:, 0] == 1).all()
    assert (batch["labels"][:, 0] == IGNORE_INDEX).all()
    assert torch.equal(batch["input_ids"][:, 1:], plain["input_ids"]) and torch.equal(
        batch["labels"][:, 1:], plain["labels"]
    )
    assert "prefix_lengths" not in batch

    prefix = DecoderPrefixCollator(SPECIAL, 0.5)
    p = prefix(blocks, gens())["prefix_lengths"]
    batch = TaskCollator(prefix, task=1, objective="prefix_lm", arch="decoder", mode_token_id=NLG)(blocks, gens())
    assert torch.equal(batch["prefix_lengths"], p + 1)  # the mode token is inside the prefix

    mlm = MLMCollator(special=SPECIAL, vocab_size=V)
    masked = mlm(ragged([12, 12]), gens())
    for mode, width in ((NLU, 13), (None, 12)):
        batch = TaskCollator(mlm, task=0, objective="mlm", arch="decoder", mode_token_id=mode)(ragged([12, 12]), gens())
        assert batch["prefix_lengths"].tolist() == [width, width]  # fully bidirectional rows
        assert torch.equal(batch["labels"][:, width - 12 :], masked["labels"])


def test_task_collator_on_an_encoder_and_an_encoder_decoder():
    gens = lambda n: example_generators(0, 0, range(n))  # noqa: E731
    mlm = MLMCollator(special=SPECIAL, vocab_size=V)
    blocks = ragged([12, 9])
    plain = mlm(blocks, gens(2))
    batch = TaskCollator(mlm, task=0, objective="mlm", arch="encoder", mode_token_id=NLU)(blocks, gens(2))
    assert (batch["input_ids"][:, 0] == NLU).all() and (batch["labels"][:, 0] == IGNORE_INDEX).all()
    assert torch.equal(batch["attention_mask"][:, 1:], plain["attention_mask"])
    assert torch.equal(batch["input_ids"][:, 1:], plain["input_ids"]) and "prefix_lengths" not in batch

    pairs = [(ragged([6])[0], ragged([4])[0]), (ragged([3], 1)[0], ragged([5], 1)[0])]
    s2s = Seq2SeqCollator(special=SPECIAL)
    plain = s2s(pairs)
    batch = TaskCollator(s2s, task=2, objective="seq2seq", arch="encoder_decoder", mode_token_id=NLU)(pairs)
    assert batch["input_ids"][:, 0].tolist() == [NLU, NLU] and batch["attention_mask"][:, 0].tolist() == [1, 1]
    assert torch.equal(batch["input_ids"][:, 1:], plain["input_ids"])
    assert torch.equal(batch["attention_mask"][:, 1:], plain["attention_mask"])
    for key in ("labels", "decoder_input_ids", "decoder_attention_mask"):
        assert torch.equal(batch[key], plain[key])  # the decoder side is untouched
    assert batch["task"] == 2 and same(
        {
            k: v
            for k, v in TaskCollator(s2s, task=2, objective="seq2seq", arch="encoder_decoder")(pairs).items()
            if k != "task"
        },
        plain,
    )


def test_mlm_never_masks_or_inserts_extra_special_tokens():
    rng = np.random.default_rng(0)
    blocks = [rng.integers(7, 92, size=64) for _ in range(200)]  # includes NLU and NLG
    batch = MLMCollator(special=SPECIAL, vocab_size=V, probability=0.5)(blocks, example_generators(0, 0, range(200)))
    original = torch.as_tensor(np.stack(blocks))
    extra = torch.isin(original, torch.tensor([NLU, NLG]))
    assert extra.any() and (batch["labels"][extra] == IGNORE_INDEX).all()
    assert torch.equal(torch.isin(batch["input_ids"], torch.tensor([NLU, NLG])), extra)


# ----------------------------------------------------------------------------- mode tokens in the tokenizer


TEXTS = [f"the quick brown fox {i} jumps over the lazy dog [NLU]" for i in range(400)]


def test_trained_tokenizer_gets_mode_tokens_as_single_ids(tmp_path):
    cfg = TokenizerConfig(vocab_size=400, num_sentinels=3, extra_special_tokens=["[NLU]", "[NLG]"])
    tok = train_tokenizer(TEXTS, cfg)
    sp = SpecialTokens.from_tokenizer(tok)
    assert sp.extra_ids == (10, 11) and sp.sentinel_ids == (7, 8, 9)  # after the roles and sentinels
    assert check_extra_special_tokens(tok, ["[NLU]", "[NLG]"], "here") == {"[NLU]": 10, "[NLG]": 11}
    assert 10 not in tok.encode("text that spells [NLU]").ids  # text never yields the control id
    assert sp.never_masked() >= {10, 11}
    # the vocabulary floor counts them: 7 roles + 2 extra + 256 bytes
    with pytest.raises(DataError, match=r"9 special tokens .* use >= 265"):
        train_tokenizer(TEXTS, TokenizerConfig(vocab_size=264, num_sentinels=0, extra_special_tokens=["[A]", "[B]"]))
    train_tokenizer(TEXTS, TokenizerConfig(vocab_size=264, num_sentinels=0))
    with pytest.raises(DataError, match="'<mask>' is already a special token"):
        train_tokenizer(TEXTS, TokenizerConfig(vocab_size=400, extra_special_tokens=["<mask>"]))
    with pytest.raises(DataError, match="listed twice"):
        TokenizerConfig(extra_special_tokens=["[A]", "[A]"])


def test_loaded_tokenizer_without_a_mode_token_is_a_clear_error(tmp_path):
    path = save_tokenizer(
        train_tokenizer(TEXTS, TokenizerConfig(vocab_size=400, num_sentinels=0, extra_special_tokens=["[NLU]"])),
        tmp_path / "tok" / "tokenizer.json",
    )
    data = DataConfig(cache_dir=str(tmp_path / "cache"), max_train_bytes=20_000, max_val_bytes=5_000)
    cfg = TokenizerConfig(path=str(path), extra_special_tokens=["[NLU]", "[S2S]"])
    dm = MixtureDataModule(
        [MixtureTask("a", "clm", "clm", data, mode_token="[S2S]")], arch="decoder", tokenizer=cfg, tokenizer_data=data
    )
    with pytest.raises(DataError, match=rf"'\[S2S\]' is not a special token of {path}") as info:
        dm.prepare_data()
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match=r"mode_token='\[X\]' is not in tokenizer.extra_special_tokens"):
        MixtureDataModule(
            [MixtureTask("a", "clm", "clm", data, mode_token="[X]")], arch="decoder", tokenizer=cfg, tokenizer_data=data
        )


# ----------------------------------------------------------------------------- the data module


DATA = dict(max_train_bytes=300_000, max_val_bytes=50_000, block_size=32, batch_size=4)
MODE_TOK = TokenizerConfig(
    vocab_size=1000, max_train_bytes=300_000, num_sentinels=0, extra_special_tokens=["[NLU]", "[NLG]"]
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mixture") / "cache")


def unilm(cache, run_dir=None, **kw):
    data = DataConfig(cache_dir=cache, **DATA)
    tasks = [
        MixtureTask("bidirectional", "mlm", "mlm", data, mode_token="[NLU]"),
        MixtureTask("prefix", "prefix_lm", "clm", data, prefix_fraction=0.5, mode_token="[NLG]"),
    ]
    return MixtureDataModule(
        tasks, arch="decoder", tokenizer=MODE_TOK, tokenizer_data=data, seed=3, run_dir=run_dir, **kw
    )


def consume(dm, it, k):
    return [dm.on_before_batch_transfer(next(it), 0) for _ in range(k)]  # what Lightning calls per batch


def test_mixture_module_on_the_embedded_corpus(cache, tmp_path):
    dm = unilm(cache, run_dir=str(tmp_path / "run"), weights=[1.0, 3.0])
    dm.prepare_data()
    dm.setup()
    assert (tmp_path / "run" / "tokenizer.json").is_file()
    nlu, nlg = (dm.tokenizer.token_to_id(t) for t in ("[NLU]", "[NLG]"))
    assert {nlu, nlg} == set(dm.special_tokens.extra_ids) and dm.mode_token_ids == {"[NLU]": nlu, "[NLG]": nlg}
    assert dm.rates == pytest.approx([0.25, 0.75]) and dm.task_names == ["bidirectional", "prefix"]
    assert min(dm.train_sizes) > 1000 and dm.vocab_size == dm.tokenizer.get_vocab_size()
    assert 1.5 < dm.bytes_per_token_of(0) < 8 and dm.label_names is None and dm.num_labels is None

    batches = consume(dm, iter(dm.train_dataloader()), 12)
    for b in batches:
        assert b["input_ids"].shape == (4, 33)
        assert (b["input_ids"][:, 0] == (nlu, nlg)[b["task"]]).all()
        assert (b["labels"][:, 0] == IGNORE_INDEX).all()
        if b["task"] == 0:
            assert b["prefix_lengths"].tolist() == [33] * 4
        else:
            assert ((b["prefix_lengths"] >= 2) & (b["prefix_lengths"] <= 32)).all()
    assert {b["task"] for b in batches} == {0, 1}
    assert dm.state_dict()["micro_batches"] == 12
    assert dm.state_dict()["task_batches"] == [sum(b["task"] == t for b in batches) for t in (0, 1)]

    val = dm.val_dataloader()
    assert len(val) == 2 and dm.val_tasks == [0, 1] and dm.test_dataloader() == []
    for t, loader in zip(dm.val_tasks, val):
        b = next(iter(loader))
        assert b["task"] == t and (b["input_ids"][:, 0] == (nlu, nlg)[t]).all()


def test_mixture_module_resumes_exactly(cache):
    first = unilm(cache)
    first.setup()
    it = iter(first.train_dataloader())
    consume(first, it, 7)
    state = first.state_dict()
    expected = consume(first, it, 6)

    resumed = unilm(cache)
    resumed.load_state_dict(state)
    resumed.setup()
    got = consume(resumed, iter(resumed.train_dataloader()), 6)
    assert all(same(a, b) for a, b in zip(got, expected))
    assert resumed.state_dict() == first.state_dict()


@pytest.mark.parametrize("weights, task", [(None, 0), ([0.0, 1.0], 1)])
def test_a_task_draws_what_its_single_objective_run_draws(cache, weights, task):
    tok = dataclasses.replace(MODE_TOK, extra_special_tokens=[])
    data = DataConfig(cache_dir=cache, **DATA)
    single = TextDataModule(data, tok, "mlm", seed=9 + task)  # task t of a mixture seeded 9 uses seed 9 + t
    single.setup()
    tasks = [MixtureTask(f"mlm{t}", "mlm", "mlm", data) for t in range(task + 1)]
    mix = MixtureDataModule(tasks, arch="encoder", tokenizer=tok, tokenizer_data=data, seed=9, weights=weights)
    mix.setup()
    it = iter(mix.train_dataloader())
    for a in list(single.train_dataloader())[:8]:
        b = next(it)
        assert b.pop("task") == task and same(a, b)


def test_lightning_trains_on_the_infinite_mixture_and_resumes(cache, tmp_path):
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self, vocab):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, 8)
            self.seen, self.val_seen = [], set()

        def training_step(self, batch, batch_idx):
            self.seen.append((batch["task"], batch["input_ids"].sum().item()))
            logits = self.emb(batch["input_ids"]) @ self.emb.weight.T  # (B, T, V)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.val_seen.add((dataloader_idx, batch["task"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    common = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        accumulate_grad_batches=2,
    )
    full = Recorder(1000)
    L.Trainer(max_steps=6, enable_checkpointing=False, **common).fit(full, datamodule=unilm(cache, accumulate=2))
    assert len(full.seen) == 12 and full.val_seen == {(0, 0), (1, 1)}
    assert all(full.seen[2 * k][0] == full.seen[2 * k + 1][0] for k in range(6))

    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    part = Recorder(1000)
    L.Trainer(max_steps=2, callbacks=[ckpt], **common).fit(part, datamodule=unilm(cache, accumulate=2))
    path = next((tmp_path / "ckpt").glob("*step=2*.ckpt"))
    assert torch.load(path, weights_only=False)["MixtureDataModule"]["micro_batches"] == 4
    rest = Recorder(1000)
    L.Trainer(max_steps=6, enable_checkpointing=False, **common).fit(
        rest, datamodule=unilm(cache, accumulate=2), ckpt_path=str(path)
    )
    assert part.seen == full.seen[:4] and rest.seen == full.seen[4:]
