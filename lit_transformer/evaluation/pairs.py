"""The `pairs` kind: minimal pairs, as BLiMP tests grammar (Warstadt et al. 2020, "BLiMP: The
Benchmark of Linguistic Minimal Pairs for English").

Each row holds a good and a bad sentence (BLiMP's own jsonl: `sentence_good`, `sentence_bad`;
the entry's good_column and bad_column name others). Each sentence is scored by its whole
log-probability with an empty context, as the lm-evaluation-harness scores BLiMP: causally after
the separator a decoder's documents followed in training, the decoder of an encoder-decoder after
an empty source, or masked (its pseudo-log-likelihood, masked_scoring.py; an encoder's default).
A pair is right when the good sentence scores higher; a tie is wrong (a model that gives both the
same number has not told them apart).

`accuracy` is the share of right pairs; with group_column (BLiMP's `UID`, one per paradigm) each
group's share is reported as `group/<value>` and `accuracy` is their mean, as BLiMP reports its
overall score (the mean over the 67 paradigms), with the share over all pairs as `pair_accuracy`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from lit_transformer.errors import RunError
from lit_transformer.evaluation.choice import BATCH_SIZE, ModeToken, continuation_scores, jsonl_rows
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.evaluation.masked_scoring import resolve_scoring
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.schema import RunConfig


@dataclass(frozen=True)
class Pair:
    good: str
    bad: str
    group: str | None = None


@dataclass
class PairsEval:
    entry: EvalConfig
    pairs: list[Pair]
    batch_size: int = BATCH_SIZE

    def __post_init__(self):
        self.mode_token = ModeToken(self.entry)

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        scoring = resolve_scoring(self.entry, target.arch, target.cfg)
        requests = [("", text) for pair in self.pairs for text in (pair.good, pair.bad)]
        mode = self.mode_token.id(target.tokenizer)
        scores = continuation_scores(target, requests, scoring, batch_size=self.batch_size, mode_token_id=mode)
        right = [good > bad for good, bad in zip(scores[0::2], scores[1::2])]
        out = {"accuracy": sum(right) / len(right), "examples": float(len(right))}
        if self.entry.group_column is None:
            return out
        groups: dict[str, list[bool]] = defaultdict(list)
        for pair, ok in zip(self.pairs, right):
            groups[str(pair.group)].append(ok)
        shares = {name: sum(oks) / len(oks) for name, oks in sorted(groups.items())}
        out.update(
            accuracy=sum(shares.values()) / len(shares),
            pair_accuracy=out["accuracy"],
            groups=float(len(shares)),
            **{f"group/{name}": share for name, share in shares.items()},
        )
        return out


def build(entry: EvalConfig, cfg: RunConfig) -> PairsEval:
    """Read and check the entry's rows once, the first max_examples of them."""
    pairs: list[Pair] = []
    for where, n, raw in jsonl_rows(entry):
        pairs.append(check_pair(raw, entry, where, n))
        if entry.max_examples is not None and len(pairs) >= entry.max_examples:
            break
    if not pairs:
        raise RunError(f"eval.{entry.name}.files: no rows in {', '.join(entry.files)}")
    return PairsEval(entry, pairs)


def check_pair(raw, entry: EvalConfig, where: str, n: int) -> Pair:
    """One row as a Pair, or a one-line RunError naming `where`, the line and the column."""
    at = f"{where} line {n}"
    columns = [entry.good_column, entry.bad_column] + ([entry.group_column] if entry.group_column else [])
    if not isinstance(raw, dict):
        raise RunError(f"{at}: expected a JSON object with {', '.join(columns)}, got {type(raw).__name__}")
    for column in columns:
        if column not in raw:
            raise RunError(f"{at}: no column {column!r} (the row has {sorted(raw)})")
    for column in columns[:2]:
        text = raw[column]
        if not isinstance(text, str):
            raise RunError(f"{at}: {column} must be a string, got {type(text).__name__}")
        if not text.strip():
            raise RunError(f"{at}: {column} is an empty sentence")
    group = None
    if entry.group_column is not None:
        group = raw[entry.group_column]
        if not isinstance(group, (str, int)) or isinstance(group, bool) or not str(group).strip():
            raise RunError(f"{at}: {entry.group_column} must be a group's name, got {group!r:.40}")
    return Pair(raw[entry.good_column], raw[entry.bad_column], None if group is None else str(group))
