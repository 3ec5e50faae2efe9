"""The `pairs` kind (evaluation/pairs.py): BLiMP's jsonl read with its own or configured columns,
accuracy per group and the mean over groups, ties counted wrong, each sentence scored whole with an
empty context (causal on a decoder, masked on an encoder); a model trained on the good sentences
prefers them both ways; the one-line refusals of bad rows."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import seeded_model, tiny_config

from lit_transformer.data.batches.collate import pad
from lit_transformer.data.tokens.tokenizer import SpecialTokens, train_tokenizer
from lit_transformer.errors import RunError
from lit_transformer.evaluation import pairs
from lit_transformer.evaluation.choice import loglikelihoods, masked_loglikelihoods
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.evaluation.suite import build_suite
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.schema import RunConfig, TokenizerConfig

SUBJECTS = "fox owl cat bee elk yak ant cod emu gnu ram doe".split()
OBJECTS = "apples pebbles lanterns violins carpets rockets mittens barrels kettles tulips hammers anchors".split()
GOOD = [f"the {s} carries {o}" for s, o in zip(SUBJECTS, OBJECTS)]
BAD = [f"{o} carries the {s}" for s, o in zip(SUBJECTS, OBJECTS)]  # the same words in another order


def write_rows(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def entry(path, **keys) -> EvalConfig:
    return EvalConfig(name="blimp", kind="pairs", files=[path], **keys)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer((GOOD + BAD) * 10, TokenizerConfig(kind="bpe", vocab_size=300, num_sentinels=0))


def target_for(model, tokenizer) -> EvalTarget:
    special = SpecialTokens.from_tokenizer(tokenizer)
    return EvalTarget(model=model, tokenizer=tokenizer, special=special, cfg=RunConfig())


def test_blimps_rows_grouped_and_the_mean_over_groups(tmp_path, monkeypatch, tokenizer):
    """Scores set by hand: group a right 2 of 2, group b 1 of 3 (its tie is wrong), and one pair of
    group c right: the mean over groups is (1 + 1/3 + 1) / 3, the share of pairs 4/6."""
    rows = [
        {"sentence_good": f"good {n}", "sentence_bad": f"bad {n}", "UID": uid, "pair_id": n}
        for n, uid in enumerate(["a", "b", "a", "b", "b", "c"])
    ]
    path = write_rows(tmp_path / "blimp.jsonl", [rows[0], "", *rows[1:]])  # a blank line is skipped
    evaluation = pairs.build(entry(path, group_column="UID"), RunConfig())
    assert [p.group for p in evaluation.pairs] == ["a", "b", "a", "b", "b", "c"]
    score = {"good 0": -1, "bad 0": -2, "good 1": -5, "bad 1": -4, "good 2": -1, "bad 2": -3}
    score |= {"good 3": -2, "bad 3": -2, "good 4": -1, "bad 4": -9, "good 5": -3, "bad 5": -4}
    seen = []

    def scores(target, requests, scoring, **_):
        seen.extend(requests)
        return [float(score[text]) for _, text in requests]

    monkeypatch.setattr(pairs, "continuation_scores", scores)
    target = target_for(seeded_model(tiny_config("decoder")), tokenizer)
    metrics = evaluation(target)
    assert seen == [("", f"{kind} {n}") for n in range(6) for kind in ("good", "bad")]  # an empty context
    assert metrics == pytest.approx(
        {
            "accuracy": (1 + 1 / 3 + 1) / 3,
            "pair_accuracy": 4 / 6,
            "examples": 6.0,
            "groups": 3.0,
            "group/a": 1.0,
            "group/b": 1 / 3,
            "group/c": 1.0,
        }
    )
    # without group_column: the share of pairs alone; other column names; max_examples
    renamed = [{"ok": r["sentence_good"], "no": r["sentence_bad"]} for r in rows]
    path = write_rows(tmp_path / "renamed.jsonl", renamed)
    evaluation = pairs.build(entry(path, good_column="ok", bad_column="no", max_examples=4), RunConfig())
    assert evaluation(target) == {"accuracy": 2 / 4, "examples": 4.0}


def train(model, tokenizer, rows: list[list[int]], targets: list[list[int]], steps: int) -> None:
    """Full-batch AdamW on (inputs, labels) rows, -100 where nothing is predicted."""
    special = SpecialTokens.from_tokenizer(tokenizer)
    ids, labels = pad(rows, special.pad_id), pad(targets, -100)  # (B, T)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(
            model(ids, (ids != special.pad_id).long()).flatten(0, 1), labels.flatten()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="module")
def good_rows(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    return write_rows(path, [{"sentence_good": g, "sentence_bad": b} for g, b in zip(GOOD, BAD)])


def test_a_decoder_trained_on_the_good_sentences_prefers_them(tokenizer, good_rows):
    """Causal: next-token training on the good sentences, each after the separator as packed
    documents are; random weights sit near chance, the trained model gets (nearly) every pair."""
    special = SpecialTokens.from_tokenizer(tokenizer)
    model = seeded_model(tiny_config("decoder", vocab_size=tokenizer.get_vocab_size()), seed=1)
    evaluation = pairs.build(entry(good_rows), RunConfig())
    before = evaluation(target_for(model, tokenizer))
    docs = [[special.separator_id] + tokenizer.encode(g, add_special_tokens=False).ids for g in GOOD]
    train(model, tokenizer, [d[:-1] for d in docs], [d[1:] for d in docs], steps=60)
    after = evaluation(target_for(model, tokenizer))
    assert before["examples"] == after["examples"] == 12
    assert after["accuracy"] >= 0.9 and after["accuracy"] > before["accuracy"]
    # each sentence scored whole after the separator: the decoder's score of an empty context
    target = target_for(model, tokenizer)
    good, bad = (s for s, _ in loglikelihoods(target, [("", GOOD[0]), ("", BAD[0])]))
    assert good > bad


def test_an_encoder_trained_on_the_good_sentences_prefers_them_masked(tokenizer, good_rows):
    """Masked (an encoder's natural scoring): each row of the good sentences with one token masked,
    between separators as masked_loglikelihoods reads a sentence; then every pair goes its way."""
    special = SpecialTokens.from_tokenizer(tokenizer)
    model = seeded_model(tiny_config("encoder", vocab_size=tokenizer.get_vocab_size()), seed=1)
    evaluation = pairs.build(entry(good_rows), RunConfig())
    before = evaluation(target_for(model, tokenizer))
    rows, targets = [], []
    for g in GOOD:
        doc = [special.separator_id] + tokenizer.encode(g, add_special_tokens=False).ids + [special.separator_id]
        for p in range(1, len(doc) - 1):
            rows.append(doc[:p] + [special.mask_id] + doc[p + 1 :])
            targets.append([-100] * p + [doc[p]] + [-100] * (len(doc) - p - 1))
    train(model, tokenizer, rows, targets, steps=60)
    target = target_for(model, tokenizer)
    after = evaluation(target)
    assert after["accuracy"] >= 0.9 and after["accuracy"] > before["accuracy"]
    good, bad = masked_loglikelihoods(target, [("", GOOD[0]), ("", BAD[0])], read=0)
    assert good > bad


def test_the_kind_is_in_the_suite(good_rows):
    (evaluation,) = build_suite([entry(good_rows)], RunConfig())
    assert isinstance(evaluation, pairs.PairsEval) and len(evaluation.pairs) == 12


@pytest.mark.parametrize(
    "row, message",
    [
        ({"sentence_good": "a b"}, "line 2: no column 'sentence_bad' (the row has ['sentence_good'])"),
        ({"sentence_good": "a b", "sentence_bad": "b a"}, "line 2: no column 'UID' (the row has"),
        ({"sentence_good": " ", "sentence_bad": "b a", "UID": "x"}, "line 2: sentence_good is an empty sentence"),
        ({"sentence_good": "a", "sentence_bad": 3, "UID": "x"}, "line 2: sentence_bad must be a string, got int"),
        ({"sentence_good": "a", "sentence_bad": "b", "UID": None}, "line 2: UID must be a group's name, got None"),
        (["a", "b"], "line 2: expected a JSON object with sentence_good, sentence_bad, UID, got list"),
        ("{not json", "line 2 is not JSON"),
    ],
)
def test_bad_rows_are_one_line_errors_naming_file_line_and_column(tmp_path, row, message):
    ok = {"sentence_good": "a b", "sentence_bad": "b a", "UID": "x"}
    path = write_rows(tmp_path / "rows.jsonl", [ok, row])
    with pytest.raises(RunError) as e:
        pairs.build(entry(path, group_column="UID"), RunConfig())
    assert str(e.value).startswith(f"eval.blimp.files: {path} line 2") and "\n" not in str(e.value)
    assert message in str(e.value)


def test_no_rows_and_no_file(tmp_path):
    path = write_rows(tmp_path / "empty.jsonl", [""])
    with pytest.raises(RunError, match=rf"^eval\.blimp\.files: no rows in {path}$"):
        pairs.build(entry(path), RunConfig())
    with pytest.raises(RunError, match=r"^eval\.blimp\.files: no such file: .*nope\.jsonl$"):
        pairs.build(entry(str(tmp_path / "nope.jsonl")), RunConfig())
