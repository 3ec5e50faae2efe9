"""The built-in multiple-choice sets of the `choice` kind (EvalConfig.embedded), made from the
Python standard library that every install carries, so the tiny recipes evaluate out of the box.

- docstring_function: which of four function names goes with a docstring's summary line. From
  the validation split of the embedded seq2seq task (data.stdlib.seq2seq_examples), which no
  training run of the tiny recipes reads. The context is the summary as a comment above `def `.
- next_line: which of four lines continues a function: the real line or one of three orders of
  its own words. From the embedded corpus's validation files (data.stdlib.corpus_split), which
  the pretraining recipes hold out.

Both are deterministic (a seeded random.Random over sorted inputs; the right answer's position
cycles through the four slots, so a model that prefers one slot scores chance) and rows are
dicts {context, choices, label}, the same shape as a choice jsonl file.
"""

from __future__ import annotations

import ast
import functools
import random
import re

from lit_transformer.data.sources import stdlib

CHOICES = 4
MAX_ROWS = 200  # enough for a 7-point-wide 95% interval around chance, small enough to score in seconds
PER_FILE = 40  # next_line: functions per file at most, so that no one file makes the set
MAX_LINE_CHARS = 100  # next_line: lines this long at most, so that rows score in milliseconds
CUTS = 3  # next_line: rows from one function at most
CONTEXT_LINES = 3  # next_line: lines before the right one in the context, besides the def line
SEED = 0


def embedded_rows(name: str) -> list[dict]:
    """The rows of a built-in set (fresh dicts: a caller may change them)."""
    makers = {"docstring_function": docstring_function, "next_line": next_line}
    if name not in makers:
        raise ValueError(f"no embedded choice set {name!r}; there are {sorted(makers)}")
    return [dict(row, choices=list(row["choices"])) for row in makers[name]()]


def _place(rng: random.Random, right: str, wrong: list[str], slot: int) -> dict:
    choices = list(wrong)
    rng.shuffle(choices)
    choices.insert(slot, right)
    return {"choices": tuple(choices), "label": slot}


@functools.lru_cache(maxsize=1)
def docstring_function() -> tuple[dict, ...]:
    examples = stdlib.seq2seq_examples()["validation"][:MAX_ROWS]
    names = sorted({ex["target"] for ex in examples})
    rng = random.Random(SEED)
    rows = []
    for n, ex in enumerate(examples):
        right = ex["target"]
        wrong = rng.sample([name for name in names if name != right], CHOICES - 1)
        row = _place(rng, right, wrong, n % CHOICES)
        # the space after `def` moves onto each name (choice.split_whitespace), as in running code
        rows.append({"context": f"# {ex['source']}\ndef ", **row})
    return tuple(rows)


def _functions(source: str) -> list[list[str]]:
    """The non-blank source lines of each function of a module, outermost first."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a file for another Python version
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            body = [line.rstrip() for line in lines[node.lineno - 1 : node.end_lineno]]
            out.append([line for line in body if line.strip()])
    return out


WORD = re.compile(r"\w+")  # names, keywords and numbers


def scrambled(line: str, rng: random.Random, count: int) -> list[str]:
    """`count` distinct versions of `line` with its words (WORD) in another order and every
    other character in place: the same tokens in another order, mostly not Python. [] when the
    line has fewer than 3 distinct words (2 have one other order)."""
    spans = [m.span() for m in WORD.finditer(line)]
    words = [line[a:b] for a, b in spans]
    if len(set(words)) < 3:
        return []
    out: list[str] = []
    for _ in range(50):
        order = rng.sample(words, len(words))
        text, end = [], 0
        for (a, b), word in zip(spans, order):
            text += [line[end:a], word]
            end = b
        candidate = "".join(text) + line[end:]
        if candidate != line and candidate not in out:
            out.append(candidate)
        if len(out) == count:
            return out
    return []


@functools.lru_cache(maxsize=1)
def next_line() -> tuple[dict, ...]:
    """Minimal pairs, as BLiMP tests grammar: the line that continues a function against three
    orders of its own words. Same characters and about the same tokens: a model that scores
    by length alone (random weights sum about log V per token) sits at chance, and one that
    has learnt Python's syntax and the function's names picks the real line."""
    rng = random.Random(SEED)
    functions: list[list[str]] = []
    for _, path in stdlib.corpus_split("validation"):
        found = [f for f in _functions(path.read_text("utf-8", "replace")) if len(f) >= 4]
        functions.extend(found[:PER_FILE])
    rows: list[dict] = []
    for f in functions:
        # up to CUTS places in each function, after the def line and at least one more as context
        for cut in sorted(rng.sample(range(2, len(f)), min(CUTS, len(f) - 2))):
            right = f[cut]
            wrong = scrambled(right, rng, CHOICES - 1) if len(right.strip()) <= MAX_LINE_CHARS else []
            if not wrong or len(rows) == MAX_ROWS:
                continue
            row = _place(rng, right, wrong, len(rows) % CHOICES)
            # the def line and the CONTEXT_LINES before the cut: what the choice needs, at a cost
            # that keeps the set to a second or two a validation for the tiny recipes
            context = f[:1] + (["    ..."] if cut - CONTEXT_LINES > 1 else []) + f[max(1, cut - CONTEXT_LINES) : cut]
            # the newline ending the context moves onto each choice (choice.split_whitespace)
            rows.append({"context": "\n".join(context) + "\n", **row})
    return tuple(rows)
