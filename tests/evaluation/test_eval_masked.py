"""Masked scoring (evaluation/masked_scoring.py): the batched pseudo-log-likelihood equals masking
each token in turn with one forward call each, on an encoder and on a decoder's bidirectional rows,
read in place (mlm) and at the position before (mntp); choice on an encoder gives a number; heldout
with scoring masked reports the set's pseudo-perplexity over masked LM's blocks; which scoring an
entry gets, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import RECIPES, seeded_model, tiny_config

from lit_transformer.data.sources import stdlib
from lit_transformer.data.tokens.tokenizer import SpecialTokens, train_tokenizer
from lit_transformer.errors import RunError
from lit_transformer.evaluation import heldout
from lit_transformer.evaluation.choice import ChoiceEval, ChoiceRow, encode_pair, masked_loglikelihoods
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.evaluation.masked_scoring import Scoring, pseudo_loglikelihoods, resolve_scoring
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.load import load_recipe
from lit_transformer.recipe.schema import RunConfig, TokenizerConfig

TEXTS = ["the fox carries apples", "the owl carries pebbles and lanterns", "def load(path):\n    return path"]


@pytest.fixture(scope="module")
def tokenizer():
    texts = TEXTS * 20 + [p.read_text("utf-8", "replace") for _, p in stdlib.corpus_split("train")[:2]]
    return train_tokenizer(texts, TokenizerConfig(kind="bpe", vocab_size=300, num_sentinels=0))


@pytest.fixture(scope="module")
def recipes() -> dict[str, RunConfig]:
    """The resolved configs of a causal-only decoder, a UniLM mixture (mlm among its tasks), an
    encoder and an encoder-decoder: what a loaded run's config.yaml says it trained."""
    names = ("tiny-clm", "tiny-unilm", "tiny-mlm", "tiny-span")
    return {name: load_recipe(RECIPES / f"{name}.yaml") for name in names}


def target_for(model, tokenizer, cfg=None) -> EvalTarget:
    special = SpecialTokens.from_tokenizer(tokenizer)
    return EvalTarget(model=model, tokenizer=tokenizer, special=special, cfg=cfg or RunConfig())


def model_for(tokenizer, arch, seed=0, **overrides):
    return seeded_model(tiny_config(arch, vocab_size=tokenizer.get_vocab_size(), **overrides), seed=seed)


def brute_force(target: EvalTarget, ids: list[int], positions, read: int) -> float:
    """Each scored token masked alone, one unpadded forward call each (a decoder's row fully
    visible), its log-probability read `read` positions before it."""
    total = 0.0
    for p in positions:
        row = list(ids)
        row[p] = target.special.mask_id
        x = torch.tensor([row])
        rows = {"prefix_lengths": torch.tensor([len(row)])} if target.arch == "decoder" else {}
        with torch.no_grad():
            logp = torch.log_softmax(target.model(x, **rows)[0].float(), -1)  # (T, V)
        total += logp[p - read, ids[p]].item()
    return total


def items_of(tokenizer) -> list[tuple[list[int], list[int]]]:
    """Texts of unequal lengths (padding inside a chunk), every token scored or a few."""
    special = SpecialTokens.from_tokenizer(tokenizer)
    out = []
    for n, text in enumerate(TEXTS):
        ids = [special.separator_id] + tokenizer.encode(text, add_special_tokens=False).ids + [special.separator_id]
        out.append((ids, list(range(1, len(ids) - 1)) if n != 1 else [2, 5, 3]))
    return out


@pytest.mark.parametrize("arch, read", [("encoder", 0), ("decoder", 0), ("decoder", 1)])
def test_batched_pll_equals_masking_each_token_alone(tokenizer, arch, read):
    """Chunks of 4 rows cut across texts, so rows of several lengths share a padded forward pass.
    A decoder's rows read causally, or its prediction read at the wrong position, fail it."""
    model = model_for(tokenizer, arch)
    target = target_for(model, tokenizer)
    items = items_of(tokenizer)
    got = pseudo_loglikelihoods(target, items, read=read, batch_size=4)
    for (ids, positions), value in zip(items, got):
        assert value == pytest.approx(brute_force(target, ids, positions, read), abs=1e-5)
    assert model.training is False
    if arch == "decoder":  # in place and one before are different numbers on the same rows
        other = pseudo_loglikelihoods(target, items, read=1 - read, batch_size=4)
        assert all(abs(a - b) > 1e-3 for a, b in zip(got, other))


def test_masked_loglikelihoods_score_the_continuation_between_separators(tokenizer):
    """The text as a packed document ([sep] context continuation [sep], the mode token first); a
    text longer than the model keeps its last tokens."""
    model = model_for(tokenizer, "encoder", max_seq_len=12)
    target = target_for(model, tokenizer)
    sep = target.special.separator_id
    requests = [("the fox carries ", "apples"), ("", "the owl carries pebbles"), ("the owl carries " * 4, "pebbles")]
    got = masked_loglikelihoods(target, requests, read=0, batch_size=5, mode_token_id=target.special.cls_id)
    for (context, continuation), value in zip(requests, got):
        ctx, cont = encode_pair(tokenizer, context, continuation)
        ids = [target.special.cls_id, sep] + (ctx + cont)[-9:] + [sep]  # 12 positions in all
        scored = range(len(ids) - 1 - min(len(cont), 9), len(ids) - 1)  # a long continuation loses its start
        assert value == pytest.approx(brute_force(target, ids, scored, 0), abs=1e-5)


def test_choice_on_an_encoder_gives_a_number(tokenizer):
    """An encoder's natural scoring is masked: choice scores it (it was refused before)."""
    rows = [ChoiceRow("the fox carries ", ("apples", "pebbles", "lanterns"), 0), ChoiceRow("the owl ", ("a", "b"), 1)]
    evaluation = ChoiceEval(EvalConfig(name="quiz", kind="choice", files=["x"]), rows)
    metrics = evaluation(target_for(model_for(tokenizer, "encoder"), tokenizer))
    assert metrics["examples"] == 2.0 and set(metrics) == {"acc", "acc_norm", "acc_bytes", "examples"}
    assert all(0.0 <= metrics[k] <= 1.0 for k in ("acc", "acc_norm", "acc_bytes"))


def test_the_natural_scoring_and_the_read_position(recipes):
    unilm = recipes["tiny-unilm"]
    # a mixture whose masked task is mntp (GPT-BERT's) instead of mlm
    tasks = [dataclasses.replace(t, objective="mntp") if t.objective == "mlm" else t for t in unilm.tasks]
    configs = {**recipes, "gptbert": dataclasses.replace(unilm, tasks=tasks)}

    def scoring(name: str, asked=None, **entry):
        cfg = configs[name]
        return resolve_scoring(
            EvalConfig(name="e", kind="heldout", files=["x"], scoring=asked, **entry), cfg.model.arch, cfg
        )

    assert scoring("tiny-mlm") == Scoring("masked", 0)
    assert scoring("tiny-clm") == scoring("tiny-unilm") == scoring("tiny-span") == Scoring("causal")
    assert scoring("tiny-unilm", "masked") == Scoring("masked", 0)  # its mlm task reads in place
    assert scoring("tiny-unilm", "masked", task="mlm") == Scoring("masked", 0)
    # mntp reads each prediction one position before its token
    assert scoring("gptbert", "masked") == Scoring("masked", 1) and scoring("gptbert") == Scoring("causal")


@pytest.mark.parametrize(
    "name, asked, entry, message",
    [
        (
            "tiny-clm",
            "masked",
            {},
            "eval.e.scoring=masked: this decoder trained no masked prediction (it trained clm), so it has no masked "
            "scores; use scoring: causal",
        ),
        ("tiny-unilm", "masked", {"task": "clm"}, "eval.e.scoring=masked: task clm trained no masked prediction"),
        ("tiny-mlm", "causal", {}, "eval.e.scoring=causal: an encoder predicts masked tokens, not the next one"),
        ("tiny-span", "masked", {}, "eval.e.scoring=masked: an encoder_decoder scores text causally"),
    ],
)
def test_refusals_are_one_line_naming_the_entry(recipes, name, asked, entry, message):
    cfg = recipes[name]
    with pytest.raises(RunError) as e:
        resolve_scoring(EvalConfig(name="e", kind="heldout", files=["x"], scoring=asked, **entry), cfg.model.arch, cfg)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_choice_refuses_a_causal_only_decoder_asked_for_masked_scoring(tokenizer, recipes):
    evaluation = ChoiceEval(
        EvalConfig(name="quiz", kind="choice", files=["x"], scoring="masked"), [ChoiceRow("a", ("b", "c"), 0)]
    )
    target = target_for(model_for(tokenizer, "decoder"), tokenizer, recipes["tiny-clm"])
    with pytest.raises(RunError, match=r"^eval\.quiz\.scoring=masked: this decoder trained no masked prediction"):
        evaluation(target)


# ----------------------------------------------------------------------------- heldout, masked


@pytest.fixture(scope="module")
def encoder_run(tmp_path_factory, recipes):
    """tiny-mlm's config with a saved wordpiece tokenizer, blocks of 16 tokens, batches of 3; a
    random tiny encoder of its vocabulary; a text file."""
    tmp = tmp_path_factory.mktemp("masked-heldout")
    texts = [p.read_text("utf-8", "replace") for _, p in stdlib.corpus_split("train")[:3]]
    tok = train_tokenizer(texts, TokenizerConfig(kind="wordpiece", vocab_size=300, num_sentinels=0))
    tok.save(str(tmp / "tokenizer.json"))
    cfg = recipes["tiny-mlm"]
    data = dataclasses.replace(cfg.data, block_size=16, batch_size=3, eval_batch_size=3, cache_dir=str(tmp / "cache"))
    cfg = dataclasses.replace(
        cfg, data=data, tokenizer=dataclasses.replace(cfg.tokenizer, path=str(tmp / "tokenizer.json"))
    )
    text = tmp / "held.txt"
    text.write_text("def load(path):\n    return open(path).read()\n\nclass Owl:\n    pass\n" * 8)
    model = model_for(tok, "encoder")
    return cfg, target_for(model, tok, cfg), text


def test_masked_heldout_is_the_pll_of_masked_lms_blocks(encoder_run):
    cfg, target, text = encoder_run
    entry = EvalConfig(
        name="held", kind="heldout", files=[str(text)], text_format="lines", scoring="masked", max_examples=2
    )
    metrics = heldout.build(entry, cfg)(target)
    # the file as pack.py packs it for masked LM: each line a document, then the separator; blocks of 16
    special = target.special
    stream = []
    for line in text.read_text().splitlines():
        if line.strip():
            stream += target.tokenizer.encode(line, add_special_tokens=False).ids + [special.separator_id]
    blocks = [stream[i : i + 16] for i in range(0, 3 * 16, 16)]  # max_examples 2: one whole batch of 3 blocks
    never = special.never_masked()
    scored = [[p for p, t in enumerate(block) if t not in never] for block in blocks]
    total = sum(brute_force(target, block, positions, 0) for block, positions in zip(blocks, scored))
    tokens = sum(len(positions) for positions in scored)
    assert metrics["tokens"] == tokens == 48 - sum(block.count(special.separator_id) for block in blocks)
    assert metrics["pll_per_token"] == pytest.approx(total / tokens, abs=1e-5)
    assert metrics["pseudo_perplexity"] == pytest.approx(math.exp(-total / tokens))
    assert set(metrics) == {"pll_per_token", "pseudo_perplexity", "tokens"}


def test_heldout_refusals(encoder_run, recipes):
    cfg, _, text = encoder_run
    entry = EvalConfig(name="held", kind="heldout", files=[str(text)], scoring="causal")
    with pytest.raises(RunError, match=r"^eval\.held\.scoring=causal: an encoder predicts masked tokens"):
        heldout.build(entry, cfg)
    clm = dataclasses.replace(recipes["tiny-clm"], tokenizer=cfg.tokenizer)
    with pytest.raises(RunError, match=r"^eval\.held\.scoring=masked: this decoder trained no masked prediction"):
        heldout.build(dataclasses.replace(entry, scoring="masked"), clm)
