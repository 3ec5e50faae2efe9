"""The lm-evaluation-harness adapter (evaluation/harness.py): a multiple_choice task written as a
local YAML over a local jsonl file scores as our `choice` kind on the same rows; our pairs are
tokenised as the harness's TemplateLM._encode_pair tokenises them; loglikelihood_rolling and
generate_until against direct computations; and the one-line error without lm-eval."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import optional, seeded_model, tiny_config

from lit_transformer.data.sources import stdlib
from lit_transformer.data.tokens.tokenizer import SpecialTokens, train_tokenizer
from lit_transformer.errors import RunError
from lit_transformer.evaluation import choice, harness
from lit_transformer.evaluation.choice import encode_pair
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.schema import RunConfig, TokenizerConfig

lm_eval = optional("lm_eval", "eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

ROWS = [
    {
        "context": "def read_lines(path):\n    ",
        "choices": ["return open(path).readlines()", "pass", "yield"],
        "label": 0,
    },
    {"context": "import os\nimport ", "choices": ["sys", "collections.abc", "é"], "label": 1},
    {"context": "for i in range(", "choices": ["10):", "len(items)):", "n)"], "label": 2},
    {"context": "class Point:", "choices": ["\n    x: int", " pass", "(object):"], "label": 0},
    {"context": "x = ", "choices": ["[]", "{}", "None", "dict()"], "label": 3},
    {"context": "# the end\n", "choices": ["print('done')", "if __name__ == '__main__':", "main()"], "label": 1},
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [p.read_text("utf-8", "replace") for _, p in stdlib.corpus_split("train")[:6]]
    return train_tokenizer(texts, TokenizerConfig(kind="bpe", vocab_size=420, num_sentinels=0))


def target_for(tokenizer, arch="decoder", seed=0, **overrides) -> EvalTarget:
    model = seeded_model(tiny_config(arch, vocab_size=tokenizer.get_vocab_size(), **overrides), seed=seed)
    special = SpecialTokens.from_tokenizer(tokenizer)
    return EvalTarget(model=model, tokenizer=tokenizer, special=special, cfg=RunConfig())


def test_our_pairs_are_the_harness_pairs(tokenizer):
    class Encoder(TemplateLM):
        eot_token_id = 0

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return tokenizer.encode(string, add_special_tokens=False).ids

        def _loglikelihood_tokens(self, requests, **kwargs):
            return []

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            return []

        def generate_until(self, requests, disable_tqdm=False):
            return []

    theirs = Encoder()
    pairs = [(row["context"], c) for row in ROWS for c in row["choices"]] + [("a  \n", "b"), ("x", " y z")]
    for context, continuation in pairs:
        for backend in ("causal", "seq2seq"):
            theirs.backend = backend
            assert encode_pair(tokenizer, context, continuation, causal=backend == "causal") == theirs._encode_pair(
                context, continuation
            ), (context, continuation, backend)


def write_task(folder, rows) -> str:
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tiny_quiz.yaml").write_text(
        "\n".join(
            [
                "task: tiny_quiz",
                "dataset_path: json",
                "dataset_kwargs:",
                f"  data_files: {{test: {json.dumps(str(data))}}}",
                "test_split: test",
                "output_type: multiple_choice",
                'doc_to_text: "{{context}}"',
                "doc_to_choice: choices",
                "doc_to_target: label",
                'target_delimiter: ""',  # a choice row's continuation is the choice as written
                "metric_list:",
                "  - metric: acc",
                "  - metric: acc_norm",
                "  - metric: acc_bytes",
                "",
            ]
        )
    )
    return str(data)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_a_local_harness_task_scores_as_our_choice_kind(tokenizer, tmp_path, monkeypatch, arch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = ROWS * 3
    data = write_task(tmp_path, rows)
    ours = choice.build(EvalConfig(name="quiz", kind="choice", files=[data]), RunConfig())
    assert len(ours.rows) == len(rows)
    for seed in (0, 1):
        target = target_for(tokenizer, arch, seed=seed)
        before = torch.random.get_rng_state()
        theirs = harness.run_harness(target, ["tiny_quiz"], include_path=str(tmp_path))
        assert torch.equal(torch.random.get_rng_state(), before)  # the harness's seeding is undone
        mine = ours(target)
        assert theirs["tiny_quiz/acc"] == pytest.approx(mine["acc"])
        assert theirs["tiny_quiz/acc_norm"] == pytest.approx(mine["acc_norm"])
        assert theirs["tiny_quiz/acc_bytes"] == pytest.approx(mine["acc_bytes"])
        assert "tiny_quiz/acc_stderr" in theirs
    limited = harness.run_harness(target, ["tiny_quiz"], include_path=str(tmp_path), limit=6)
    assert limited["tiny_quiz/acc"] == pytest.approx(choice.ChoiceEval(ours.entry, ours.rows[:6])(target)["acc"])


def instance(kind, args, n=0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=n)


def test_loglikelihood_rolling_sums_every_tokens_log_probability(tokenizer):
    target = target_for(tokenizer, max_seq_len=16)
    lm = harness.harness_model(target, batch_size=3)
    texts = ["def f(x):\n    return x + 1\n" * 3, "short", "import os"]
    got = lm.loglikelihood_rolling([instance("loglikelihood_rolling", (t,), n) for n, t in enumerate(texts)])
    sep = target.special.separator_id
    for text, score in zip(texts, got):
        tokens = tokenizer.encode(text, add_special_tokens=False).ids
        want = 0.0
        # the harness's own windows; each scored with one full forward of the model
        for context, pred in map(make_disjoint_window, get_rolling_token_windows(tokens, sep, 16, 1)):
            whole = context + pred
            with torch.no_grad():
                logp = torch.log_softmax(target.model(torch.tensor([whole[:-1]]))[0], -1)  # (T, V)
            want += sum(logp[t - 1, whole[t]].item() for t in range(len(whole) - len(pred), len(whole)))
        assert score == pytest.approx(want, abs=1e-3)
    assert len(tokenizer.encode(texts[0]).ids) > 32  # three windows at least: the rolling path is exercised


def greedy(target, context: str, new: int) -> str:
    """Greedy decoding without a cache: argmax of a full forward, token by token, until the separator."""
    sep = target.special.separator_id
    ids = [sep] + tokenizer_ids(target, context)
    out = []
    with torch.no_grad():
        for _ in range(new):
            token = int(target.model(torch.tensor([ids]))[0, -1].argmax())
            if token == sep:
                break
            ids.append(token)
            out.append(token)
    return target.tokenizer.decode(out)


def tokenizer_ids(target, text):
    return target.tokenizer.encode(text, add_special_tokens=False).ids


def test_generate_until_decodes_greedily_and_stops_at_the_until_string(tokenizer):
    target = target_for(tokenizer, seed=3, max_seq_len=40)
    lm = harness.harness_model(target)
    contexts = ["def main():\n", "import", "class A:\n    def"]
    full = lm.generate_until([instance("generate_until", (c, {"until": [], "max_gen_toks": 8})) for c in contexts])
    assert full == [greedy(target, c, 8) for c in contexts]
    text = max(full, key=len)
    assert len(text) >= 4
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = lm.generate_until([instance("generate_until", (contexts[full.index(text)], {"until": [stop, "\x00"]}))])
    assert cut == [text[: text.index(stop)]]


@pytest.mark.slow  # a name missing from include_path is looked up among the harness's own ~15k tasks
def test_an_unknown_task_is_named(tokenizer, tmp_path):
    with pytest.raises(RunError, match=r"^lm-eval: no task named no_such_task in the harness \(nor under"):
        harness.run_harness(target_for(tokenizer), ["no_such_task"], include_path=str(tmp_path))


def test_harness_refusals(tokenizer, monkeypatch):
    with pytest.raises(RunError, match="loglikelihood_rolling .* needs a decoder"):
        harness.harness_model(target_for(tokenizer, "encoder_decoder")).loglikelihood_rolling(
            [instance("loglikelihood_rolling", ("text",))]
        )
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: the import fails
    with pytest.raises(RunError, match=r'pip install "lit-transformer\[eval\]"'):
        harness.run_harness(target_for(tokenizer), ["x"])
