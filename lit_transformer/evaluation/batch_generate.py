"""Generation over many inputs: `generate --input FILE` and evaluate's BLEU decoding.

Inputs are read in chunks (a few thousand lines), so a file larger than memory streams
through; inside a chunk they are sorted by token length, so a batch holds prompts of similar
length and little padding, and the outputs are written back in input order. A batch holds as
many prompts as fit a token budget (`--batch-tokens`, the size of the decode buffer), so short
inputs go many to a batch and long ones few. Prompts that do not fit the model's context are
cut to fit and counted (`ContextNotes`), and a request for more new tokens than the context
holds is capped and said out loud: nothing is dropped silently.

Shape legend: B prompts in a batch, T prompt length.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from lit_transformer.constants import BATCH_ROWS, BATCH_TOKENS
from lit_transformer.errors import RunError
from lit_transformer.evaluation.prompts import complete_ids, decode_new, encode_prompt, generated_length, with_prompt
from lit_transformer.machine import cpu_has_bf16_matmul
from lit_transformer.model.packed_linear import packed_linears
from lit_transformer.recipe.registry import PromptStyle

CHUNK_LINES = 4096  # inputs sorted together: enough for similar lengths, few MB of text at most
SHOWN_NOTES = 3  # truncation notices printed one by one before only the count is kept
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def decoding_dtype(choice: str, device: torch.device) -> torch.dtype:
    """The weights' dtype for decoding: `auto` is bfloat16 on CUDA and on a CPU with bf16 matrix
    instructions (elsewhere bf16 is emulated, slower than float32), else float32."""
    if choice == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16_matmul())
        return torch.bfloat16 if fast else torch.float32
    if choice not in DTYPES:
        raise RunError(f"--dtype {choice}: choose auto, {' or '.join(DTYPES)}")
    return DTYPES[choice]


def decoding_device(choice: str) -> torch.device:
    """Where to decode: `auto` is the GPU when torch sees one (decoding steps run there as CUDA
    graphs: model/graph_step.py), else the CPU."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice not in ("cpu", "cuda"):
        raise RunError(f"--device {choice}: choose auto, cpu or cuda")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda: torch sees no CUDA device on this machine (choose cpu or auto)")
    return torch.device(choice)


def check_batching(batch_size: int | None, batch_tokens: int | None) -> None:
    """Before a model is loaded: the batching flags are positive (None: no limit of that kind)."""
    for flag, value in (("--batch-size", batch_size), ("--batch-tokens", batch_tokens)):
        if value is not None and value < 1:
            raise RunError(f"{flag} {value} must be at least 1")


def plan_batches(
    lengths: Sequence[int],
    budget: Callable[[int], int],
    *,
    batch_size: int | None = BATCH_ROWS,
    batch_tokens: int | None = BATCH_TOKENS,
    num_beams: int = 1,
) -> list[list[int]]:
    """Indices of prompts of these `lengths` in batches, longest first (a memory error shows at
    once). A batch holds prompts of one new-token budget(length), at most batch_size rows, and
    rows x (its longest prompt + budget) x num_beams <= batch_tokens: the decode buffer and KV
    cache it fills. A prompt over the token limit alone is a batch of one."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    start = 0
    while start < len(order):
        new = budget(lengths[order[start]])
        row_tokens = (lengths[order[start]] + new) * num_beams  # the first is the longest
        rows = len(order) - start if batch_size is None else batch_size
        if batch_tokens is not None:
            rows = min(rows, max(1, batch_tokens // row_tokens))
        stop = start + 1
        while stop < len(order) and stop - start < rows and budget(lengths[order[stop]]) == new:
            stop += 1
        batches.append(order[start:stop])
        start = stop
    return batches


@dataclass(frozen=True)
class Decoding:
    """Decoding options of `generate` (model.generate's names); beam search when num_beams > 1.
    length_penalty is GNMT's alpha (Wu et al. 2016): the 2017 paper's beam 4, alpha 0.6."""

    max_new_tokens: int = 64
    num_beams: int = 1
    length_penalty: float = 0.6
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def options(self) -> dict:
        out: dict = dict(do_sample=self.do_sample, num_beams=self.num_beams)
        if self.num_beams > 1:
            out.update(length_penalty=self.length_penalty, length_normalization="gnmt")
        if self.do_sample:
            out.update(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        return out


@dataclass
class ContextNotes:
    """What did not fit the model's context, reported on `out` (stderr) as it happens."""

    out: TextIO | None = None
    truncated: int = 0
    capped: bool = False
    lines: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        self.lines.append(text)
        print(f"note: {text}", file=self.out or sys.stderr, flush=True)

    def prompt_cut(self, where: str, before: int, after: int, context: int, kept: str) -> None:
        self.truncated += 1
        if self.truncated <= SHOWN_NOTES:
            self.say(
                f"{where} has {before} tokens, more than the model's context ({context}) holds: kept its {kept} {after}"
            )

    def finish(self) -> None:
        if self.truncated > SHOWN_NOTES:
            self.say(f"{self.truncated} inputs in all were cut to fit the context")


class BatchGenerator:
    """Text in, text out for a loaded model: encode, fit the context, sort, batch, decode."""

    def __init__(
        self,
        model,
        tokenizer,
        special,
        style: PromptStyle,
        decoding: Decoding,
        *,
        batch_size: int | None = BATCH_ROWS,
        batch_tokens: int | None = BATCH_TOKENS,
        notes: ContextNotes | None = None,
        bidirectional_prompt: bool = False,
        mode_token_id: int | None = None,
        show_prompt: bool = False,
    ):
        """batch_size, batch_tokens: plan_batches's limits (None: none of that kind).
        bidirectional_prompt: a decoder reads its prompts bidirectionally (prompts.complete).
        mode_token_id: a token put before every prompt, as a mixture's task put it before its inputs.
        show_prompt: a decoder's output is its prompt followed by the continuation."""
        check_batching(batch_size, batch_tokens)
        self.model, self.tokenizer, self.special, self.style = model.eval(), tokenizer, special, style
        self.decoding, self.batch_size, self.batch_tokens = decoding, batch_size, batch_tokens
        self.show_prompt = show_prompt and style == "continue"
        self.dtype = next(model.parameters()).dtype
        self.inputs = self.new_tokens = 0  # throughput: inputs done, tokens generated (eos counted, padding not)
        self.seconds = 0.0
        self.bidirectional_prompt = bidirectional_prompt
        self.lead = [mode_token_id] if mode_token_id is not None else []
        self.notes = notes if notes is not None else ContextNotes()
        self.context = model.config.max_seq_len
        self.generator = torch.Generator(device=next(model.parameters()).device).manual_seed(decoding.seed)
        self._capped_said = False

    def budget(self, prompt_length: int) -> int:
        """New tokens a prompt of this length may get. A decoder's prompt and continuation share
        the context; a long prompt keeps at least half of it for new tokens. An encoder-decoder's
        decoder holds the start token and the new tokens."""
        want = self.decoding.max_new_tokens
        if self.style != "continue":
            return max(1, min(want, self.context - 1))
        return max(1, min(want, max(self.context - prompt_length, self.context // 2)))

    def fit(self, ids: list[int], where: str) -> list[int]:
        """The prompt cut to the context: a decoder keeps its last tokens (the text it continues),
        an encoder its first tokens and its end token, as training truncated sources."""
        if self.style == "continue":
            room = self.context - self.budget(len(ids))
            if len(ids) > room:
                self.notes.prompt_cut(where, len(ids), room, self.context, "last")
                return ids[-room:]
            return ids
        if len(ids) > self.context:
            end = [ids[-1]] if ids[-1] in (self.special.eos_id, self.special.sep_id) else []
            self.notes.prompt_cut(where, len(ids), self.context, self.context, "first")
            return ids[: self.context - len(end)] + end
        return ids

    def _say_cap(self, length: int, budget: int) -> None:
        if budget < self.decoding.max_new_tokens and not self._capped_said:
            self._capped_said = True
            self.notes.capped = True
            what = "prompt and new tokens share" if self.style == "continue" else "the decoder holds"
            self.notes.say(
                f"generation stops at the context length: max_new_tokens={self.decoding.max_new_tokens} "
                f"but the model's context ({self.context} tokens, model.max_seq_len) that {what} "
                f"leaves {budget} new tokens" + (f" after a {length}-token prompt" if self.style == "continue" else "")
            )

    def __call__(
        self, texts: list[str], first_index: int = 0, progress: Callable[[int], None] | None = None
    ) -> list[str]:
        """Outputs of `texts`, in their order. Batches hold prompts of similar length and the
        same new-token budget, so every prompt is decoded exactly as it would be alone (same
        max_new_tokens, its padding masked)."""
        began = time.perf_counter()
        prompts = [
            self.fit(
                self.lead + encode_prompt(t, self.tokenizer, self.special, self.style), f"input {first_index + i + 1}"
            )
            for i, t in enumerate(texts)
        ]
        outputs: list[str] = [""] * len(prompts)
        batches = plan_batches(
            [len(p) for p in prompts],
            self.budget,
            batch_size=self.batch_size,
            batch_tokens=self.batch_tokens,
            num_beams=self.decoding.num_beams,
        )
        # packed once for all batches, not once per generate call, for the rows of a full batch,
        # where packed measured faster than plain F.linear at those rows (packed_linear.py)
        rows = min(self.batch_size or len(prompts), len(prompts)) * self.decoding.num_beams
        with packed_linears(self.model, rows=rows):
            for rows in batches:
                self._decode_batch(rows, prompts, texts, outputs)
                if progress is not None:
                    progress(len(rows))
        self.inputs += len(prompts)
        self.seconds += time.perf_counter() - began
        return outputs

    def _decode_batch(self, rows: list[int], prompts: list[list[int]], texts: list[str], outputs: list[str]) -> None:
        """Decode prompts `rows` together and write their outputs in place."""
        budget = self.budget(len(prompts[rows[0]]))
        self._say_cap(len(prompts[rows[0]]), budget)
        new = complete_ids(
            self.model,
            self.special,
            self.style,
            [prompts[i] for i in rows],
            max_new_tokens=budget,
            generator=self.generator,
            bidirectional_prompt=self.bidirectional_prompt,
            **self.decoding.options(),
        )
        for i, row in zip(rows, new):
            self.new_tokens += generated_length(self.special, self.style, row)
            if self.show_prompt:
                outputs[i] = with_prompt(self.tokenizer, self.special, texts[i], prompts[i], row)
            else:
                outputs[i] = decode_new(self.tokenizer, self.special, self.style, row)

    def throughput(self) -> dict:
        """Inputs and generated tokens per second of decoding so far (reading and writing files not counted)."""
        seconds = max(self.seconds, 1e-9)
        return {"sentences_per_s": self.inputs / seconds, "tokens_per_s": self.new_tokens / seconds}

    def report(self, what: str, out: TextIO | None = None) -> None:
        """One line on stderr: inputs, seconds, the weights' dtype, sentences/s and new tokens/s."""
        rates = self.throughput()
        dtype = str(self.dtype).removeprefix("torch.")
        print(
            f"{what}: {self.inputs} inputs in {self.seconds:.1f} s ({dtype}): "
            f"{rates['sentences_per_s']:.1f} sentences/s, {rates['tokens_per_s']:.0f} new tokens/s",
            file=out or sys.stderr,
            flush=True,
        )


# ----------------------------------------------------------------------------- files


def input_format(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".csv": "csv", ".tsv": "tsv"}.get(suffix, "text")


def read_inputs(path: str | Path, column: str | None = None) -> Iterator[str]:
    """The inputs of a file, streamed: its lines (text), or one column of a jsonl/csv/tsv file
    (`column`; default `source`, else `text`)."""
    path = Path(path)
    if not path.is_file():
        raise RunError(f"--input {path}: no such file")
    fmt = input_format(path)
    if fmt == "text":
        if column is not None:
            raise RunError(
                f"--column {column}: {path} is plain text (one input per line); "
                "columns are read from .jsonl, .csv and .tsv files"
            )
        with open(path, encoding="utf-8", errors="replace", newline="\n") as file:
            for line in file:
                yield line.rstrip("\n").rstrip("\r")
        return
    with open(path, encoding="utf-8", errors="replace", newline="") as file:
        if fmt == "jsonl":
            rows: Iterable = (_json_row(path, n, line) for n, line in enumerate(file, 1) if line.strip())
        else:
            rows = csv.DictReader(file, delimiter="\t" if fmt == "tsv" else ",")
        for n, row in enumerate(rows, 1):
            if column is None:
                column = "source" if "source" in row else "text"
            if column not in row:
                raise RunError(
                    f"--input {path}: row {n} has no column {column!r} (it has {sorted(row)}); choose one with --column"
                )
            value = row[column]
            yield "" if value is None else str(value)


def _json_row(path: Path, n: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except ValueError as error:
        raise RunError(f"--input {path}: line {n} is not JSON ({error})") from None
    if not isinstance(row, dict):
        raise RunError(f"--input {path}: line {n} is not a JSON object")
    return row


def chunks(items: Iterable[str], size: int = CHUNK_LINES) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def count_inputs(path: Path) -> int | None:
    """Lines of a text or jsonl file (the progress bar's total); None for csv/tsv, whose rows
    may span lines."""
    if input_format(path) not in ("text", "jsonl"):
        return None
    from lit_transformer.data.sources.files import count_lines

    return count_lines(path)


def one_line(text: str) -> str:
    """One output per line: newlines inside an output become spaces (jsonl output keeps them)."""
    return text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


def generate_file(
    generate: BatchGenerator,
    path: str | Path,
    out: TextIO,
    *,
    column: str | None = None,
    jsonl: bool = False,
    chunk_lines: int = CHUNK_LINES,
    progress_bar: bool = True,
) -> int:
    """Write an output line for every input of `path` to `out`, in input order; returns the
    count. jsonl: one {"input": ..., "output": ...} object per line."""
    from tqdm import tqdm

    path = Path(path)
    if not path.is_file():
        raise RunError(f"--input {path}: no such file")
    done = 0
    with tqdm(
        total=count_inputs(path),
        unit="input",
        desc="generate",
        file=sys.stderr,
        disable=not progress_bar,
        dynamic_ncols=True,
    ) as bar:
        for chunk in chunks(read_inputs(path, column), chunk_lines):
            outputs = generate(chunk, first_index=done, progress=bar.update)
            for text, output in zip(chunk, outputs):
                out.write(
                    json.dumps({"input": text, "output": output}, ensure_ascii=False) if jsonl else one_line(output)
                )
                out.write("\n")
            out.flush()
            done += len(chunk)
    generate.notes.finish()
    generate.report("generate")
    return done


# ----------------------------------------------------------------------------- scoring


def translation_scores(
    generate: BatchGenerator, pairs: Iterable[tuple[str, str]], *, limit: int | None = None, progress_bar: bool = True
) -> dict:
    """Corpus BLEU (Papineni et al. 2002) and chrF (Popović 2015) with sacrebleu's defaults of
    the outputs for the sources of `pairs` against their raw target text (the first `limit`
    pairs), with sacrebleu's signatures, which name everything that changes a score."""
    from itertools import islice

    from sacrebleu.metrics import BLEU, CHRF
    from tqdm import tqdm

    hypotheses: list[str] = []
    references: list[str] = []
    with tqdm(
        total=limit, unit="sentence", desc="translate", file=sys.stderr, disable=not progress_bar, dynamic_ncols=True
    ) as bar:
        for chunk in chunks(islice(pairs, limit)):
            hypotheses += generate([source for source, _ in chunk], first_index=len(references), progress=bar.update)
            references += [target for _, target in chunk]
    generate.notes.finish()
    if not references:
        raise RunError("no sentence pairs to score")
    generate.report("translate")
    bleu, chrf = BLEU(), CHRF()
    return {
        "bleu": bleu.corpus_score(hypotheses, [references]).score,
        "chrf": chrf.corpus_score(hypotheses, [references]).score,
        "sentences": len(references),
        "num_beams": generate.decoding.num_beams,
        "length_penalty": generate.decoding.length_penalty if generate.decoding.num_beams > 1 else None,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "dtype": str(generate.dtype).removeprefix("torch."),
        "device": next(generate.model.parameters()).device.type,
        **generate.throughput(),
    }
