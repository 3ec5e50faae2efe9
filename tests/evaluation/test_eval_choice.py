"""The `choice` evaluation kind (evaluation/choice.py): log-likelihoods equal a direct forward of
the model (decoder, prefix-LM decoder, encoder-decoder, truncated contexts, a mode token first), a
model trained on the right answers scores far above chance where random weights do not, the
embedded sets, and the one-line errors for an encoder scored causally, an unknown mode token and bad rows. The
harness's side is test_eval_harness.py."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from helpers import seeded_model, tiny_config

from lit_transformer.data.batches.collate import pad
from lit_transformer.data.sources import stdlib
from lit_transformer.data.tokens.tokenizer import SpecialTokens, train_tokenizer
from lit_transformer.errors import RunError
from lit_transformer.evaluation import choice
from lit_transformer.evaluation.choice import ChoiceEval, ChoiceRow, encode_pair, loglikelihoods
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.schema import RunConfig, TokenizerConfig

SUBJECTS = "fox owl cat bee elk yak ant cod emu gnu ram doe".split()
OBJECTS = "apples pebbles lanterns violins carpets rockets mittens barrels kettles tulips hammers anchors".split()
SENTENCES = [f"the {s} {o}" for s, o in zip(SUBJECTS, OBJECTS)]  # the subject names the object

REQUESTS = [
    ("the fox carries ", "apples"),  # trailing space moves onto the continuation
    ("the owl", " carries pebbles and more"),
    ("", "the cat carries lanterns"),  # empty context: predicted from the separator
    ("def load(path):\n", "    return open(path).read()"),
    ("the bee carries violins " * 6, "the elk"),  # longer than the context: the last tokens kept
    ("x", "é ünïcode"),
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = SENTENCES * 20 + [p.read_text("utf-8", "replace") for _, p in stdlib.corpus_split("train")[:3]]
    return train_tokenizer(texts, TokenizerConfig(kind="bpe", vocab_size=400, num_sentinels=0))


@pytest.fixture(scope="module")
def mode_tokenizer():
    """The fixture's texts, with a UL2 mode token among the special tokens (as a mixture's run has it)."""
    texts = SENTENCES * 20 + [p.read_text("utf-8", "replace") for _, p in stdlib.corpus_split("train")[:3]]
    return train_tokenizer(
        texts, TokenizerConfig(kind="bpe", vocab_size=400, num_sentinels=0, extra_special_tokens=["[S2S]"])
    )


def target_for(model, tokenizer, **kwargs) -> EvalTarget:
    special = SpecialTokens.from_tokenizer(tokenizer)
    return EvalTarget(model=model, tokenizer=tokenizer, special=special, cfg=RunConfig(), **kwargs)


def model_for(tokenizer, arch="decoder", seed=0, **overrides):
    return seeded_model(tiny_config(arch, vocab_size=tokenizer.get_vocab_size(), **overrides), seed=seed)


def direct_decoder(target: EvalTarget, context: str, continuation: str, prefix: bool = False, mode=None):
    """The continuation's log-probability from one unpadded full forward, no batching; with a
    mode token, the input starts with it (before the separator) whatever the truncation cuts."""
    ctx, cont = encode_pair(target.tokenizer, context, continuation)
    L = target.model.config.max_seq_len
    lead = [mode] if mode is not None else []
    whole = lead + ([target.special.separator_id] + ctx + cont)[-(L + 1 - len(lead)) :]
    ids = torch.tensor([whole[:-1]])
    kwargs = {"prefix_lengths": torch.tensor([len(whole) - len(cont)])} if prefix else {}
    with torch.no_grad():
        logp = torch.log_softmax(target.model(ids, **kwargs)[0].float(), -1)  # (T, V)
    picked = [(logp[t - 1, whole[t]].item(), logp[t - 1].argmax().item() == whole[t]) for t in range(1, len(whole))]
    picked = picked[-len(cont) :]
    return sum(p for p, _ in picked), all(g for _, g in picked)


def test_encode_pair_moves_trailing_whitespace_and_splits_the_whole_encoding(tokenizer):
    ctx, cont = encode_pair(tokenizer, "the fox carries ", "apples")
    assert tokenizer.decode(ctx) == "the fox carries"
    assert ctx + cont == tokenizer.encode("the fox carries apples", add_special_tokens=False).ids
    src, tgt = encode_pair(tokenizer, "the fox carries ", "apples", causal=False)
    assert tgt == tokenizer.encode(" apples", add_special_tokens=False).ids and src == ctx


@pytest.mark.parametrize("prefix_lm", [False, True])
def test_decoder_loglikelihoods_equal_a_direct_forward(tokenizer, prefix_lm):
    model = model_for(tokenizer, max_seq_len=16)
    target = target_for(model, tokenizer, prefix_lm=prefix_lm)
    got = loglikelihoods(target, REQUESTS, batch_size=2)  # batches of two: rows of unequal length padded
    for request, (score, greedy) in zip(REQUESTS, got):
        want, want_greedy = direct_decoder(target, *request, prefix=prefix_lm)
        assert score == pytest.approx(want, abs=1e-4), request
        assert greedy == want_greedy
    assert model.training is False


def test_prefix_mode_reads_the_context_both_ways(tokenizer):
    model = model_for(tokenizer)
    causal = loglikelihoods(target_for(model, tokenizer), REQUESTS[:2])
    prefix = loglikelihoods(target_for(model, tokenizer, prefix_lm=True), REQUESTS[:2])
    for (a, _), (b, _) in zip(causal, prefix):
        assert abs(a - b) > 1e-5  # float32 noise is ~1e-6 here; the modes differ by ~1e-4 at init


def test_encoder_decoder_loglikelihoods_equal_a_direct_forward(tokenizer):
    model = model_for(tokenizer, "encoder_decoder", max_seq_len=16)
    target = target_for(model, tokenizer)
    special = target.special
    got = loglikelihoods(target, REQUESTS, batch_size=4)
    for (context, continuation), (score, greedy) in zip(REQUESTS, got):
        src, cont = encode_pair(tokenizer, context, continuation, causal=False)
        src = (src + [special.eos_id])[-16:]  # the encoder keeps the source's last tokens, eos among them
        cont = cont[-16:]  # the harness's seq2seq truncation: a continuation's last tokens
        dec = [special.decoder_start_id] + cont[:-1]
        with torch.no_grad():
            logits = model(torch.tensor([src]), decoder_input_ids=torch.tensor([dec]))[0]  # (T, V)
        logp = torch.log_softmax(logits, -1)
        assert score == pytest.approx(sum(logp[t, c].item() for t, c in enumerate(cont)), abs=1e-4)
        assert greedy == bool((logp.argmax(-1) == torch.tensor(cont)).all())


@pytest.mark.parametrize("prefix_lm", [False, True])
def test_decoder_mode_token_leads_every_input(mode_tokenizer, prefix_lm):
    """The mode token first, before the separator, inside the prefix, and kept when the context
    is cut (REQUESTS[4] is longer than the 16-token context)."""
    model = model_for(mode_tokenizer, max_seq_len=16)
    target = target_for(model, mode_tokenizer, prefix_lm=prefix_lm)
    mode = mode_tokenizer.token_to_id("[S2S]")
    got = loglikelihoods(target, REQUESTS, batch_size=2, mode_token_id=mode)
    plain = loglikelihoods(target, REQUESTS, batch_size=2)
    for request, (score, greedy), (without, _) in zip(REQUESTS, got, plain):
        want, want_greedy = direct_decoder(target, *request, prefix=prefix_lm, mode=mode)
        assert score == pytest.approx(want, abs=1e-4), request
        assert greedy == want_greedy
        assert abs(score - without) > 1e-5  # the token is read
    ctx, cont = encode_pair(mode_tokenizer, *REQUESTS[4])
    assert 2 + len(ctx) + len(cont) > 17  # mode, separator and the text overflow the window: it was cut


def test_encoder_decoder_mode_token_leads_the_source(mode_tokenizer):
    model = model_for(mode_tokenizer, "encoder_decoder", max_seq_len=16)
    target = target_for(model, mode_tokenizer)
    special, mode = target.special, mode_tokenizer.token_to_id("[S2S]")
    got = loglikelihoods(target, REQUESTS, batch_size=4, mode_token_id=mode)
    for (context, continuation), (score, _) in zip(REQUESTS, got):
        src, cont = encode_pair(mode_tokenizer, context, continuation, causal=False)
        src = [mode] + (src + [special.eos_id])[-15:]  # first, whatever the encoder's cut keeps
        cont = cont[-16:]
        dec = [special.decoder_start_id] + cont[:-1]
        with torch.no_grad():
            logits = model(torch.tensor([src]), decoder_input_ids=torch.tensor([dec]))[0]  # (T, V)
        logp = torch.log_softmax(logits, -1)
        assert score == pytest.approx(sum(logp[t, c].item() for t, c in enumerate(cont)), abs=1e-4)


def test_choice_entry_reads_its_mode_token_and_refuses_an_unknown_one(mode_tokenizer, monkeypatch):
    rows = [ChoiceRow("the fox ", ("apples", "pebbles"), 0)]
    target = target_for(model_for(mode_tokenizer), mode_tokenizer)
    seen = []

    def fake(target, requests, *, batch_size, mode_token_id=None):
        seen.append(mode_token_id)
        return [(-1.0, True), (-2.0, False)]

    monkeypatch.setattr(choice, "loglikelihoods", fake)
    ChoiceEval(EvalConfig(name="q", kind="choice", files=["x"], mode_token="[S2S]"), rows)(target)
    ChoiceEval(EvalConfig(name="q", kind="choice", files=["x"]), rows)(target)
    assert seen == [mode_tokenizer.token_to_id("[S2S]"), None]
    # an added token the tokenizer lacks, and plain text
    for token in ("[NLU]", "the"):
        evaluation = ChoiceEval(EvalConfig(name="q", kind="choice", files=["x"], mode_token=token), rows)
        with pytest.raises(RunError) as e:
            evaluation(target)
        assert str(e.value) == f"eval.q.mode_token={token}: not a special token of the run's tokenizer"


def test_an_encoder_asked_for_causal_scoring_is_refused_in_one_line(tokenizer, tmp_path):
    """By default an encoder is scored masked (test_eval_masked.py); causally it has no scores."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "label": 0}) + "\n")
    entry = EvalConfig(name="quiz", kind="choice", files=[str(path)], scoring="causal")
    evaluation = choice.build(entry, RunConfig())
    target = target_for(model_for(tokenizer, "encoder"), tokenizer)
    with pytest.raises(RunError, match=r"^eval\.quiz\.scoring=causal: an encoder predicts masked tokens") as e:
        evaluation(target)
    assert "\n" not in str(e.value)


def quiz_rows(rng: random.Random, repeats: int = 4) -> list[ChoiceRow]:
    """Each training sentence's subject as context, its object among three other objects: 48 rows."""
    rows = []
    for r in range(repeats):
        for n, (subject, obj) in enumerate(zip(SUBJECTS, OBJECTS)):
            wrong = rng.sample([o for o in OBJECTS if o != obj], 3)
            slot = (n + r) % 4
            rows.append(ChoiceRow(f"the {subject} ", tuple(wrong[:slot] + [obj] + wrong[slot:]), slot))
    return rows


def train_decoder(model, tokenizer, steps: int) -> None:
    """Plain next-token training on the sentences, each after the separator as packed documents are."""
    special = SpecialTokens.from_tokenizer(tokenizer)
    rows = [[special.separator_id] + tokenizer.encode(s, add_special_tokens=False).ids for s in SENTENCES]
    ids = pad(rows, special.pad_id)  # (B, T)
    labels = ids[:, 1:].masked_fill(ids[:, 1:] == special.pad_id, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    model.train()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def test_a_model_trained_on_the_answers_beats_chance(tokenizer):
    rows = quiz_rows(random.Random(0))
    entry = EvalConfig(name="quiz", kind="choice", files=["unused.jsonl"])
    evaluation = ChoiceEval(entry, rows)
    model = model_for(tokenizer, seed=1)
    before = evaluation(target_for(model, tokenizer))
    train_decoder(model, tokenizer, steps=60)
    after = evaluation(target_for(model, tokenizer))
    assert before["examples"] == after["examples"] == 48
    assert before["acc"] <= 0.45 and before["acc_norm"] <= 0.45  # chance is 0.25
    assert after["acc"] >= 0.9 and after["acc_norm"] >= 0.9


def test_acc_norm_divides_by_the_choice_length(tokenizer, monkeypatch):
    """Scores -6 and -4 for a 3-character, 3-byte choice and a 1-character, 2-byte one: the sum
    prefers the short one (acc 0), per character the long one (acc_norm 1: -2 against -4), per
    byte still the long one (acc_bytes 1: -2 against -2, the first on a tie); "é" tips acc_bytes
    the other way when the scores are -6 and -3 (-2 against -1.5) while acc_norm stays with "abc"."""
    row = [ChoiceRow("c", ("abc", "é"), 0)]
    evaluation = ChoiceEval(EvalConfig(name="q", kind="choice", files=["x"]), row)
    target = target_for(model_for(tokenizer), tokenizer)
    monkeypatch.setattr(choice, "loglikelihoods", lambda target, requests, **_: [(-6.0, False), (-4.0, True)])
    assert evaluation(target) == {"acc": 0.0, "acc_norm": 1.0, "acc_bytes": 1.0, "examples": 1.0}
    monkeypatch.setattr(choice, "loglikelihoods", lambda target, requests, **_: [(-6.0, False), (-3.0, True)])
    assert evaluation(target) == {"acc": 0.0, "acc_norm": 1.0, "acc_bytes": 0.0, "examples": 1.0}


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"context": "the fox carries ", "choices": ["apples", "pebbles"], "label": 1})


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "line 2 is not JSON"),
        (json.dumps({"context": "a", "label": 0}), "line 2: no key 'choices'"),
        (json.dumps({"context": "a", "choices": "ab", "label": 0}), "line 2: choices must be a list"),
        (json.dumps({"context": "a", "choices": ["only"], "label": 0}), "line 2: choices must be a list of at least 2"),
        (json.dumps({"context": "a", "choices": ["x", 3], "label": 0}), "line 2: choices must be a list"),
        (json.dumps({"context": "a", "choices": ["x", "y"], "label": "x"}), "line 2: label must be an integer"),
        (json.dumps({"context": "a", "choices": ["x", "y"], "label": True}), "line 2: label must be an integer"),
        (json.dumps({"context": "a", "choices": ["x", "y"], "label": 2}), r"line 2: label=2 is out of range for 2"),
        (json.dumps({"context": 5, "choices": ["x", "y"], "label": 0}), "line 2: context must be a string"),
        (json.dumps(["a", "b"]), "line 2: expected a JSON object"),
    ],
)
def test_bad_rows_are_one_line_errors_naming_file_line_and_key(tmp_path, bad, message):
    path = write(tmp_path / "rows.jsonl", [GOOD, bad])
    with pytest.raises(RunError, match=message) as e:
        choice.build(EvalConfig(name="quiz", kind="choice", files=[str(path)]), RunConfig())
    assert str(e.value).startswith(f"eval.quiz.files: {path} line 2") and "\n" not in str(e.value)


def test_missing_file_and_max_examples(tmp_path):
    with pytest.raises(RunError, match=r"eval\.quiz\.files: no such file: .*nope\.jsonl"):
        choice.build(EvalConfig(name="quiz", kind="choice", files=[str(tmp_path / "nope.jsonl")]), RunConfig())
    rows = [json.dumps({"context": f"c{n}", "choices": ["a", "b"], "label": n % 2}) for n in range(5)]
    path = write(tmp_path / "rows.jsonl", ["", *rows, "{broken"])  # blank lines skipped; the broken row is past N
    evaluation = choice.build(EvalConfig(name="quiz", kind="choice", files=[str(path)], max_examples=3), RunConfig())
    assert [r.context for r in evaluation.rows] == ["c0", "c1", "c2"] and evaluation.rows[1].label == 1


def test_embedded_docstring_function_pairs_each_summary_with_its_name():
    evaluation = choice.build(EvalConfig(name="doc", kind="choice", embedded="docstring_function"), RunConfig())
    examples = stdlib.seq2seq_examples()["validation"]
    assert 50 <= len(evaluation.rows) <= 300
    for row, ex in zip(evaluation.rows, examples):
        assert row.context == f"# {ex['source']}\ndef " and row.choices[row.label] == ex["target"]
        assert len(set(row.choices)) == 4
    assert {r.label for r in evaluation.rows} == {0, 1, 2, 3}
    again = choice.build(EvalConfig(name="doc", kind="choice", embedded="docstring_function"), RunConfig())
    assert again.rows == evaluation.rows


def test_embedded_next_line_continues_the_validation_files():
    evaluation = choice.build(EvalConfig(name="nl", kind="choice", embedded="next_line", max_examples=60), RunConfig())
    assert len(evaluation.rows) == 60
    # every file's non-blank lines, in order: the context and its right line follow each other there
    text = "\n".join(
        line.rstrip()
        for _, path in stdlib.corpus_split("validation")
        for line in path.read_text("utf-8", "replace").splitlines()
        if line.strip()
    )
    for row in evaluation.rows:
        # the def line, then (after an elision) the lines right before the answer
        *_, last = row.context.rstrip("\n").split("\n")
        assert last + "\n" + row.choices[row.label] in text
        assert len(set(row.choices)) == 4 and row.context.lstrip().startswith(("def ", "async def "))
        # the wrong choices hold the right line's words in other orders
        words = sorted(re.findall(r"\w+", row.choices[row.label]))
        assert all(sorted(re.findall(r"\w+", c)) == words for c in row.choices)
    assert [r.label for r in evaluation.rows[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
