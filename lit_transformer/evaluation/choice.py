"""The `choice` kind: zero-shot multiple choice by log-likelihood, scored as the lm-evaluation-
harness scores its `multiple_choice` tasks (Gao et al. 2021; lm-eval 0.4).

Each row is {"context": str, "choices": [str, ...], "label": int}. A choice's score is the summed
log-probability of its tokens after the context; `acc` counts rows whose best-scoring choice is
the label, `acc_norm` rows whose best score per character of the choice is (the harness's
acc_norm: len() of the choice string), `acc_bytes` per UTF-8 byte (the harness's acc_bytes).
The continuation is the choice exactly as written: a row that wants a space between context and
choice writes it at the end of the context, from where it moves onto the continuation as the
harness moves it.

Tokenisation follows the harness's `TemplateLM._encode_pair` token for token: the context's
trailing whitespace moves onto the continuation; a decoder encodes context + continuation
together and splits at the context's token count, an encoder-decoder encodes the two apart. What
we add to the harness's pairs is what our models read in training: a decoder's text follows the
separator it was packed after (the harness's prefix token for an empty context), an encoder's
source ends in eos. Contexts that do not fit the model keep their last tokens (the harness's left
truncation). With a mode token (a UL2 mixture's [NLU], [NLG], [S2S]: the entry's `mode_token`) the
input starts with it, where data/batches/prefix.py's TaskCollator put it in training: before a decoder's
separator (inside a prefix LM's prefix), first in an encoder-decoder's source; left truncation
keeps it and cuts the context after it.

`scoring: masked` (an encoder's default; a decoder that trained masked prediction may ask for it)
scores a choice by its pseudo-log-likelihood instead (masked_scoring.py): each of its tokens masked
in turn, the context and the rest of the choice in view, the text between two separators as a
packed document is. acc, acc_norm and acc_bytes compare those scores as they compare causal ones.

`loglikelihoods` and `rolling_loglikelihoods` are also the harness adapter's (harness.py), so a
task run through lm-eval and the same rows run here score alike.

Shape legend: B rows in a batch, T input length, S source length, N scored positions, V vocabulary.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lit_transformer.data.batches.collate import pad
from lit_transformer.errors import RunError
from lit_transformer.evaluation.embedded_choice import embedded_rows
from lit_transformer.evaluation.eval_target import EvalTarget, eval_mode
from lit_transformer.evaluation.masked_scoring import Scoring, pseudo_loglikelihoods, resolve_scoring
from lit_transformer.recipe.eval_schema import EvalConfig

BATCH_SIZE = 32  # rows (context, choice) per forward: four-choice questions eight at a time


@dataclass(frozen=True)
class ChoiceRow:
    context: str
    choices: tuple[str, ...]
    label: int


# ----------------------------------------------------------------------------- tokenisation


def split_whitespace(context: str, continuation: str) -> tuple[str, str]:
    """The harness moves the context's trailing whitespace onto the continuation, so a word
    boundary tokenises as it would in running text (" Paris", not "Paris" after "is ")."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        return context[:-n_spaces], context[-n_spaces:] + continuation
    return context, continuation


def encode_pair(tokenizer, context: str, continuation: str, *, causal: bool = True) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's TemplateLM._encode_pair makes them, without
    special tokens. A causal model's pair is cut from the encoding of the whole text, so a token
    that a tokenizer merges across the seam belongs to the continuation."""
    context, continuation = split_whitespace(context, continuation)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    if causal:
        whole = encode(context + continuation)
        n = len(encode(context))
        return whole[:n], whole[n:]
    return encode(context), encode(continuation)


def _check_scorable(target: EvalTarget, what: str) -> None:
    if target.arch == "encoder":
        raise RunError(
            f"{what} scores a continuation by log-likelihood; an encoder model cannot "
            "(it predicts masked tokens, not the next one): use a decoder or an encoder-decoder"
        )


# ----------------------------------------------------------------------------- scoring


def loglikelihoods(
    target: EvalTarget,
    requests: Sequence[tuple[str, str]],
    *,
    batch_size: int = BATCH_SIZE,
    mode_token_id: int | None = None,
) -> list[tuple[float, bool]]:
    """For each (context, continuation): the summed log-probability of the continuation's tokens
    given the context, and whether greedy decoding would have produced exactly those tokens.
    A decoder with `target.prefix_lm` reads the context as a bidirectional prefix.
    mode_token_id: a token put first in every input (module docstring), kept by truncation."""
    _check_scorable(target, "loglikelihood")
    special = target.special
    mode = [mode_token_id] if mode_token_id is not None else []
    if target.arch == "decoder":
        pairs = []
        for context, continuation in requests:
            ctx, cont = encode_pair(target.tokenizer, context, continuation, causal=True)
            pairs.append((mode + _lead(target) + ctx, cont))
        return score_decoder(target, pairs, batch_size=batch_size, prefix_lm=target.prefix_lm, keep=len(mode))
    end = special.eos_id if special.eos_id is not None else special.sep_id
    pairs = []
    for context, continuation in requests:
        ctx, cont = encode_pair(target.tokenizer, context, continuation, causal=False)
        pairs.append((mode + ctx + ([end] if end is not None else []), cont))
    return score_encoder_decoder(target, pairs, batch_size=batch_size, keep=len(mode))


def masked_loglikelihoods(
    target: EvalTarget,
    requests: Sequence[tuple[str, str]],
    *,
    read: int,
    batch_size: int = BATCH_SIZE,
    mode_token_id: int | None = None,
) -> list[float]:
    """For each (context, continuation): the pseudo-log-likelihood of the continuation's tokens
    (masked_scoring.py), each masked in turn with the context and the rest of the continuation in
    view. The text is read as a packed document is in training, between two separators (after the
    mode token, where there is one), tokenised as a decoder's pair (encode_pair, causal=True: one
    text); a text longer than the model keeps its last tokens, as loglikelihoods does."""
    sep = _lead(target)
    mode = [mode_token_id] if mode_token_id is not None else []
    room = target.model.config.max_seq_len - len(mode) - 2 * len(sep)
    items = []
    for context, continuation in requests:
        ctx, cont = encode_pair(target.tokenizer, context, continuation, causal=True)
        body = (ctx + cont)[-room:]
        ids = mode + sep + body + sep
        end = len(ids) - len(sep)
        items.append((ids, range(end - min(len(cont), len(body)), end)))
    return pseudo_loglikelihoods(target, items, read=read, batch_size=batch_size)


def continuation_scores(
    target: EvalTarget,
    requests: Sequence[tuple[str, str]],
    scoring: Scoring,
    *,
    batch_size: int = BATCH_SIZE,
    mode_token_id: int | None = None,
) -> list[float]:
    """Each continuation's log-likelihood given its context, causal or masked as `scoring` says."""
    if scoring.kind == "masked":
        return masked_loglikelihoods(
            target, requests, read=scoring.read, batch_size=batch_size, mode_token_id=mode_token_id
        )
    return [score for score, _ in loglikelihoods(target, requests, batch_size=batch_size, mode_token_id=mode_token_id)]


class ModeToken:
    """An entry's `mode_token` as an id of the target's tokenizer, resolved at the first call
    (build() runs before the tokenizer is known) and kept while the tokenizer stays the same."""

    def __init__(self, entry: EvalConfig):
        self.entry = entry
        self._resolved: tuple | None = None  # (tokenizer, id)

    def id(self, tokenizer) -> int | None:
        token = self.entry.mode_token
        if token is None:
            return None
        if self._resolved is None or self._resolved[0] is not tokenizer:
            # a special token only: a piece of ordinary text would be split, or would be a word
            special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
            if token not in special:
                raise RunError(f"eval.{self.entry.name}.mode_token={token}: not a special token of the run's tokenizer")
            self._resolved = (tokenizer, special[token])
        return self._resolved[1]


def _lead(target: EvalTarget) -> list[int]:
    """The separator a decoder's documents followed in training: the harness's prefix token."""
    sep = target.special.separator_id
    if sep is None:
        raise RunError("loglikelihood: the tokenizer has no eos, sep or bos token for a decoder's text to follow")
    return [sep]


def score_decoder(
    target: EvalTarget,
    pairs: Sequence[tuple[list[int], list[int]]],
    *,
    batch_size: int,
    prefix_lm: bool = False,
    keep: int = 0,
) -> list[tuple[float, bool]]:
    """Token-level scores of (context ids, continuation ids) on a decoder. The input is the last
    max_seq_len + 1 tokens of context + continuation without its last token (the harness's left
    truncation), except that the context's first `keep` tokens (a mode token) stay in front; the
    continuation's tokens inside that window are scored. With prefix_lm the context's positions
    attend to each other in both directions (prefix_lengths)."""
    model, L = target.model, target.model.config.max_seq_len
    pad_id = target.special.pad_id if target.special.pad_id is not None else 0
    windows, scored = [], []
    for ctx, cont in pairs:
        window = ctx[:keep] + (ctx[keep:] + cont)[-(L + 1 - keep) :]
        windows.append(window)
        scored.append(min(len(cont), len(window) - 1))
    out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)  # an empty continuation: nothing to score
    order = sorted((i for i in range(len(pairs)) if scored[i] > 0), key=lambda i: -len(windows[i]))
    with eval_mode(model), target.autocast():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            inputs = [windows[i][:-1] for i in rows]
            ids = pad(inputs, pad_id).to(target.device)  # (B, T)
            lengths = torch.tensor([len(x) for x in inputs], device=ids.device)
            positions = torch.arange(ids.shape[1], device=ids.device)[None, :]  # (1, T)
            mask = (positions < lengths[:, None]).long()  # (B, T)
            n = torch.tensor([scored[i] for i in rows], device=ids.device)
            selected = (positions >= (lengths - n)[:, None]) & mask.bool()  # (B, T): the scored inputs
            prefix = None
            if prefix_lm:
                # the context's tokens in the window; the continuation's first token is predicted
                # from the prefix's last position, as in training (data/batches/prefix.py)
                prefix = torch.tensor([max(len(windows[i]) - len(pairs[i][1]), 0) for i in rows], device=ids.device)
            logits = model.logits_at(ids, mask, selected, prefix_lengths=prefix)  # (N, V), row-major
            targets = torch.cat([torch.tensor(windows[i][-scored[i] :]) for i in rows]).to(ids.device)  # (N,)
            _collect(out, rows, [scored[i] for i in rows], logits, targets)
    return out


def score_encoder_decoder(
    target: EvalTarget, pairs: Sequence[tuple[list[int], list[int]]], *, batch_size: int, keep: int = 0
) -> list[tuple[float, bool]]:
    """Token-level scores of (source ids, continuation ids) on an encoder-decoder: the source into
    the encoder (its last max_seq_len tokens, after its first `keep`: a mode token stays first),
    the continuation as the decoder's target after the decoder start token, teacher-forced as the
    seq2seq collator feeds it in training."""
    model, L = target.model, target.model.config.max_seq_len
    special = target.special
    pad_id = special.pad_id if special.pad_id is not None else 0
    start_id = special.decoder_start_id if special.decoder_start_id is not None else pad_id
    sources = [src[:keep] + src[keep:][-(L - keep) :] for src, _ in pairs]
    conts = [cont[-L:] for _, cont in pairs]
    out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    order = sorted((i for i in range(len(pairs)) if conts[i]), key=lambda i: -(len(sources[i]) + len(conts[i])))
    with eval_mode(model), target.autocast():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            src = [sources[i] for i in rows]
            dec = [[start_id] + conts[i][:-1] for i in rows]
            ids = pad(src, pad_id).to(target.device)  # (B, S)
            mask = _lengths_mask([len(s) for s in src], ids.shape[1], ids.device)  # (B, S)
            dec_ids = pad(dec, pad_id).to(target.device)  # (B, T)
            dec_mask = _lengths_mask([len(d) for d in dec], dec_ids.shape[1], ids.device)  # (B, T)
            logits = model(ids, mask, decoder_input_ids=dec_ids, decoder_attention_mask=dec_mask)  # (B, T, V)
            logits = logits[dec_mask.bool()]  # (N, V), row-major
            targets = torch.cat([torch.tensor(conts[i]) for i in rows]).to(ids.device)  # (N,)
            _collect(out, rows, [len(conts[i]) for i in rows], logits, targets)
    return out


def _lengths_mask(lengths: list[int], T: int, device) -> torch.Tensor:
    return (torch.arange(T, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]).long()  # (B, T)


def _collect(out, rows, counts, logits, targets) -> None:
    """Sum each row's target log-probabilities (in float32, whatever the autocast) and check greed."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    picked = logp.gather(1, targets[:, None])[:, 0]  # (N,)
    greedy = logp.argmax(dim=-1) == targets  # (N,)
    for i, part, hit in zip(rows, picked.split(counts), greedy.split(counts)):
        out[i] = (float(part.sum()), bool(hit.all()))


def rolling_windows(tokens: list[int], prefix: int, length: int) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) token pairs that predict every token of `tokens` exactly once, as
    lm-eval's get_rolling_token_windows(context_len=1) + make_disjoint_window cut them: windows of
    `length` predictions, the first predicted from `prefix`, each later one from the token before
    it; the last window, shorter, reads a full context of earlier tokens."""
    if not tokens:
        return []
    first = min(length, len(tokens))
    out = [([prefix], tokens[:first])]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, length)
        end = done + n
        window = tokens[end - length - 1 : end - 1]  # the `length` inputs that predict tokens[end - length : end]
        out.append((window[: length - (n - 1)], tokens[end - n : end]))
        done = end
    return out


def rolling_loglikelihoods(target: EvalTarget, texts: Sequence[str], *, batch_size: int = BATCH_SIZE) -> list[float]:
    """Each text's log-likelihood on a decoder, every token predicted once (lm-eval's
    loglikelihood_rolling): the text's tokens in non-overlapping windows of the model's context,
    the first token predicted from the separator the decoder's documents followed in training.
    Read causally, whatever `prefix_lm`: a text has no prefix."""
    if target.arch != "decoder":
        raise RunError(
            f"loglikelihood_rolling (perplexity of whole texts) needs a decoder; this model is an {target.arch}"
        )
    sep = _lead(target)[0]
    L = target.model.config.max_seq_len
    pairs, owner = [], []
    for n, text in enumerate(texts):
        for pair in rolling_windows(target.tokenizer.encode(text, add_special_tokens=False).ids, sep, L):
            pairs.append(pair)
            owner.append(n)
    totals = [0.0] * len(texts)
    for n, (score, _) in zip(owner, score_decoder(target, pairs, batch_size=batch_size)):
        totals[n] += score
    return totals


# ----------------------------------------------------------------------------- the evaluation


@dataclass
class ChoiceEval:
    entry: EvalConfig
    rows: list[ChoiceRow]
    batch_size: int = BATCH_SIZE

    def __post_init__(self):
        self.mode_token = ModeToken(self.entry)

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        scoring = resolve_scoring(self.entry, target.arch, target.cfg)
        requests = [(row.context, choice) for row in self.rows for choice in row.choices]
        mode = self.mode_token.id(target.tokenizer)
        scores = iter(continuation_scores(target, requests, scoring, batch_size=self.batch_size, mode_token_id=mode))
        acc = acc_norm = acc_bytes = 0
        for row in self.rows:
            lls = [next(scores) for _ in row.choices]
            acc += first_argmax(lls) == row.label
            acc_norm += first_argmax([ll / len(c) for ll, c in zip(lls, row.choices)]) == row.label
            acc_bytes += first_argmax([ll / len(c.encode()) for ll, c in zip(lls, row.choices)]) == row.label
        n = len(self.rows)
        return {"acc": acc / n, "acc_norm": acc_norm / n, "acc_bytes": acc_bytes / n, "examples": float(n)}


def first_argmax(values: Sequence[float]) -> int:
    """The first index of the largest value, as numpy's argmax breaks ties."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def build(entry: EvalConfig, cfg) -> ChoiceEval:
    """Read and check the rows once (the embedded set or the entry's jsonl files), the first
    max_examples of them."""
    if entry.embedded is not None:
        raw = embedded_rows(entry.embedded)
        rows = [check_row(r, f"eval.{entry.name}: embedded set {entry.embedded}", n) for n, r in enumerate(raw, 1)]
    else:
        rows = read_rows(entry)
    if entry.max_examples is not None:
        rows = rows[: entry.max_examples]
    if not rows:
        raise RunError(f"eval.{entry.name}.files: no rows in {', '.join(entry.files)}")
    return ChoiceEval(entry, rows)


def read_rows(entry: EvalConfig) -> list[ChoiceRow]:
    rows: list[ChoiceRow] = []
    for where, n, raw in jsonl_rows(entry):
        rows.append(check_row(raw, where, n))
        if entry.max_examples is not None and len(rows) >= entry.max_examples:
            break
    return rows


def jsonl_rows(entry: EvalConfig) -> Iterator[tuple[str, int, Any]]:
    """(where: `eval.<name>.files: <path>`, line number, the parsed line) for every non-blank line
    of the entry's jsonl files in order; a line that is not JSON is a one-line RunError."""
    key = f"eval.{entry.name}.files"
    for path in input_paths(entry.files, key):
        with open(path, encoding="utf-8", errors="replace") as file:
            for n, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except ValueError as error:
                    raise RunError(f"{key}: {path} line {n} is not JSON ({error})") from None
                yield f"{key}: {path}", n, raw


def input_paths(specs: list[str], key: str) -> list[Path]:
    """The files an entry names (globs expanded, in order), or a one-line RunError naming `key`."""
    out: list[Path] = []
    for spec in specs:
        if glob.has_magic(spec):
            matches = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            if not matches:
                raise RunError(f"{key}: the glob {spec!r} matches no file")
            out.extend(matches)
        elif Path(spec).is_file():
            out.append(Path(spec))
        else:
            raise RunError(f"{key}: no such file: {spec}")
    return out


def check_row(raw, where: str, n: int) -> ChoiceRow:
    """One row {context, choices, label}, or a one-line RunError naming `where`, the line and the key."""
    at = f"{where} line {n}"
    if not isinstance(raw, dict):
        raise RunError(f"{at}: expected a JSON object with context, choices and label, got {type(raw).__name__}")
    for key in ("context", "choices", "label"):
        if key not in raw:
            raise RunError(f"{at}: no key {key!r} (the row has {sorted(raw)})")
    context, choices, label = raw["context"], raw["choices"], raw["label"]
    if not isinstance(context, str):
        raise RunError(f"{at}: context must be a string, got {type(context).__name__}")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise RunError(f"{at}: choices must be a list of at least 2 non-empty strings, got {choices!r:.80}")
    if not isinstance(label, int) or isinstance(label, bool):
        raise RunError(f"{at}: label must be an integer index into choices, got {label!r:.40}")
    if not 0 <= label < len(choices):
        raise RunError(f"{at}: label={label} is out of range for {len(choices)} choices (0 to {len(choices) - 1})")
    return ChoiceRow(context, tuple(choices), label)
