"""`kind: translate`: corpus BLEU and chrF (sacrebleu, with their signatures) of the model's
translations of aligned source/target files, one sentence per line: the measurement
`evaluate --data SRC --data-target REF` makes, and `objective.bleu` makes on the validation
split during training.

Decoding is greedy or beam search (the entry's num_beams, length_penalty, max_new_tokens, else
objective.num_beams, objective.length_penalty and data.max_target_length), in the prompt style
the registry gives the run's objective and architecture. The weights decode in their current
dtype: `evaluate` casts its own copy, but an evaluation in training must leave the model as it
found it (bf16 decoding is the run's autocast's business, set by suite.run_suite). The entry's
`mode_token` leads every prompt, as a mixture's TaskCollator led the inputs in training.
"""

from __future__ import annotations

from itertools import islice

from lit_transformer.errors import RunError
from lit_transformer.evaluation.batch_generate import BatchGenerator, ContextNotes, Decoding, translation_scores
from lit_transformer.evaluation.choice import ModeToken
from lit_transformer.evaluation.eval_target import EvalTarget
from lit_transformer.recipe import registry
from lit_transformer.recipe.eval_schema import EvalConfig
from lit_transformer.recipe.registry import PromptStyle
from lit_transformer.recipe.schema import RunConfig

# what a call reports: the scores and their size (translation_scores also returns strings,
# the signatures, kept on the evaluation, and the decoding speed, which suite.py times instead)
REPORTED = ("bleu", "chrf", "sentences")


class Translate:
    """Aligned sentence pairs, read once; calling it decodes the sources and scores the outputs."""

    def __init__(self, entry: EvalConfig, cfg: RunConfig):
        self.entry, self.cfg = entry, cfg
        self.pairs = read_pairs(entry, cfg)
        self.decoding = Decoding(
            max_new_tokens=entry.max_new_tokens or cfg.data.max_target_length,
            num_beams=entry.num_beams if entry.num_beams is not None else cfg.objective.num_beams,
            length_penalty=entry.length_penalty if entry.length_penalty is not None else cfg.objective.length_penalty,
        )
        self.signatures: dict[str, str] = {}  # bleu_signature, chrf_signature of the last call
        self.mode_token = ModeToken(entry)
        if cfg.model.arch is not None:  # known before training (a fine-tuning recipe's comes with its source)
            self.style(cfg.model.arch)

    def style(self, arch: str) -> PromptStyle:
        """How the run's objective prompts a model of `arch`; an error where it writes no text."""
        style = registry.spec(self.cfg.objective.name).prompt_for(arch)
        if style is None:
            raise RunError(
                f"eval.{self.entry.name}: kind translate needs a model that writes text (an encoder-decoder, "
                f"or a decoder that generates); a {self.cfg.objective.name} {arch} model does not"
            )
        return style

    def __call__(self, target: EvalTarget) -> dict[str, float]:
        style = self.style(target.arch)
        generate = BatchGenerator(
            target.model,
            target.tokenizer,
            target.special,
            style,
            self.decoding,
            notes=ContextNotes(lines=[]),
            mode_token_id=self.mode_token.id(target.tokenizer),
        )
        scores = translation_scores(generate, iter(self.pairs), progress_bar=False)
        self.signatures = {k: scores[k] for k in ("bleu_signature", "chrf_signature")}
        return {k: float(scores[k]) for k in REPORTED}


def read_pairs(entry: EvalConfig, cfg: RunConfig) -> list[tuple[str, str]]:
    """(source, reference) lines of entry.files and entry.target_files, file by file, read as the
    data pipeline reads aligned files (a pair with a blank side is skipped); the first max_examples."""
    from lit_transformer.data.sources.files import ReadStats, aligned_lines, count_lines, resolve_files
    from lit_transformer.errors import DataError

    try:
        sources = resolve_files(entry.files, f"eval.{entry.name}.files")
        targets = resolve_files(entry.target_files, f"eval.{entry.name}.target_files")
    except DataError as error:
        raise RunError(str(error)) from None
    if len(sources) != len(targets):
        raise RunError(
            f"eval.{entry.name}: files match {len(sources)} file(s) but target_files match {len(targets)}; "
            "each source file needs its aligned reference file"
        )
    for src, tgt in zip(sources, targets):
        n_src, n_tgt = count_lines(src), count_lines(tgt)
        if n_src != n_tgt:
            raise RunError(
                f"eval.{entry.name}: {src} has {n_src} lines but its target_files {tgt} has {n_tgt}; "
                "line i of one must translate line i of the other"
            )
    stats = ReadStats()
    pairs = (
        pair for src, tgt in zip(sources, targets) for pair in aligned_lines(src, tgt, cfg.data.max_line_bytes, stats)
    )
    out = list(islice(pairs, entry.max_examples))
    if not out:
        raise RunError(f"eval.{entry.name}: no sentence pairs in {[str(p) for p in sources]}")
    return out


def build(entry: EvalConfig, cfg: RunConfig) -> Translate:
    """The translate evaluation of `entry` for a run of `cfg`."""
    return Translate(entry, cfg)
