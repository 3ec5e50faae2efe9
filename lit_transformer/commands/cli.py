"""`lit-transformer COMMAND ...`: the command line as a table.

COMMANDS holds one row per command: its name, its help, its arguments (declared once, in shared
groups where commands share them) and the handler that calls the command's module. A user error
(a bad recipe, missing data, a missing run directory, a bad checkpoint) prints one line,
`error: ...`, and exits with status 2; `--debug` (before or after the command) shows the
traceback instead. Each handler imports what it needs when it runs: `--help` and `info` import
neither torch's heavy parts nor Lightning.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lit_transformer.constants import BATCH_ROWS, BATCH_TOKENS
from lit_transformer.errors import RecipeError, RunError


def arg(*flags: str, **options) -> tuple[tuple[str, ...], dict]:
    return flags, options


def pick(args: argparse.Namespace, *names: str) -> dict:
    """The parsed values of `names`, as keyword arguments of the command's function."""
    return {name: getattr(args, name) for name in names}


@dataclass(frozen=True)
class OneOf:
    """Arguments of which exactly one is given (`required`) or at most one."""

    args: tuple
    required: bool = True


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    handler: Callable[[argparse.Namespace], None]
    args: Sequence = ()
    description: str | None = None  # --help's text, when it says more than `help`
    epilog: str | None = None


# ----------------------------------------------------------------------------- shared arguments

RECIPE = (
    arg("recipe", metavar="RECIPE", help="recipe YAML file"),
    arg("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. optim.lr=1e-3"),
    arg("--print-config", action="store_true", help="print the resolved recipe as YAML and exit"),
)
PREPARE = (
    *RECIPE,
    arg(
        "--part",
        metavar="I/N",
        help="with data.store_dir: tokenize part I (0 to N-1) of the files into the shared store, one part per "
        "process or node (e.g. --part $SLURM_PROCID/$SLURM_NTASKS); the part that completes the set merges",
    ),
    arg(
        "--merge",
        type=int,
        metavar="N",
        help="with data.store_dir: only merge the N finished parts and write the manifest (when no part could)",
    ),
)
RECIPE_EPILOG = (
    "Recipes are YAML files (see recipes/); key=value arguments override any recipe key, e.g. trainer.max_steps=100."
)
TARGET = arg("target", metavar="RUN_OR_CKPT")
JSON = arg("--json", action="store_true", help="print one JSON object")
BATCHING = (
    arg(
        "--batch-size",
        type=int,
        default=BATCH_ROWS,
        metavar="N",
        help=f"at most N inputs decoded together (default {BATCH_ROWS})",
    ),
    arg(
        "--batch-tokens",
        type=int,
        default=BATCH_TOKENS,
        metavar="N",
        help="at most N tokens in a batch's decode buffer, each input counted as the batch's longest prompt "
        f"plus the new-token budget, times --num-beams (default {BATCH_TOKENS}; a longer input goes alone)",
    ),
    arg(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the weights' dtype for decoding (default auto: bfloat16 on CUDA or a CPU with bf16 matrix "
        "instructions, AMX or AVX512-BF16, else float32)",
    ),
    arg(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to decode (default auto: the GPU when torch sees one, its steps as CUDA graphs; else the CPU)",
    ),
)
RUNS = arg("runs", nargs="+", metavar="RUN", help="run directories")


def metric_patterns(what: str) -> tuple:
    return arg(
        "--metric",
        action="append",
        default=[],
        metavar="PATTERN",
        help=f"{what} the metrics matching this glob pattern, e.g. 'val/*' (repeatable; each must match)",
    )


def beams(num_beams: int | None, length_penalty: float | None, new_tokens: int | None, default: str) -> tuple:
    return (
        arg("--num-beams", type=int, default=num_beams, metavar="N", help=f"beam width ({default or 'default 1'})"),
        arg(
            "--length-penalty",
            type=float,
            default=length_penalty,
            metavar="ALPHA",
            help=f"beam search: GNMT's alpha, scores divided by ((5 + length) / 6) ** ALPHA "
            f"({default or 'default 0.6'})",
        ),
        arg("--max-new-tokens", type=int, default=new_tokens, metavar="N", help=default or "default 64"),
    )


EVALUATE = (
    TARGET,
    arg(
        "--split",
        choices=("validation", "test"),
        help="the run's own split (the recipe's data.test_files for test); the default when nothing else is named",
    ),
    arg("--data", metavar="PATH", help="a file in the run's data format (with --data-target, aligned sources)"),
    arg("--data-target", metavar="PATH", help="translation: the reference file aligned line by line with --data"),
    arg(
        "--task", metavar="NAME", help="a mixture: only this task of --split/--data, under the single objective's keys"
    ),
    arg("--max-batches", type=int, metavar="N", help="--split/--data: the first N evaluation batches (default: all)"),
    arg("--suite", metavar="FILE.yaml", help="the evaluations listed in this YAML file"),
    arg("--eval", dest="eval_names", action="append", default=[], metavar="NAME", help="the recipe's evaluation NAME"),
    arg("--all-checkpoints", action="store_true", help="every checkpoint of the run, written as a curve (--output)"),
    arg("--lm-eval", metavar="TASKS", help="comma-separated lm-evaluation-harness tasks (needs the eval extra)"),
    arg("--lm-eval-include", metavar="DIR", help="a folder of lm-eval task YAML files to add"),
    arg("--limit", type=int, metavar="N", help="at most N examples per evaluation and lm-eval task"),
    arg("--output", metavar="FILE", help="--all-checkpoints' CSV file (default: the run's eval_curve.csv)"),
    *beams(None, None, None, "the translation of --split/--data; default: the recipe's objective and data keys"),
    *BATCHING,
    JSON,
)
GENERATE = (
    TARGET,
    OneOf(
        (
            arg("--prompt", metavar="TEXT"),
            arg("--input", metavar="FILE", help="one input per line (or --column of a .jsonl/.csv/.tsv), streamed"),
        )
    ),
    arg("--output", metavar="FILE", help='with --input: write here (default stdout; .jsonl: {"input", "output"})'),
    arg(
        "--column",
        metavar="NAME",
        help="with a .jsonl/.csv/.tsv --input: the column to read (default source, else text)",
    ),
    arg("--continuation-only", action="store_true", help="with --prompt and a decoder: print only the new text"),
    *BATCHING,
    *beams(1, 0.6, 64, ""),
    arg("--greedy", action="store_true", help="always take the most likely token"),
    arg("--temperature", type=float, default=0.8),
    arg("--top-k", type=int, default=50, metavar="K", help="0 for no top-k filter"),
    arg("--top-p", type=float, default=None, metavar="P"),
    arg("--seed", type=int, default=0),
    arg("--bidirectional-prompt", action="store_true", help="a decoder reads the prompt as a bidirectional prefix"),
    arg("--mode-token", metavar="TOKEN", help="a mixture's special token before every prompt (e.g. [S2S])"),
)


# ----------------------------------------------------------------------------- handlers


def print_metrics(metrics: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(metrics))
        return
    for key, value in metrics.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value if isinstance(value, str) else json.dumps(value)
        print(f"{key:<32} {shown}")


def loaded_recipe(args: argparse.Namespace):
    """The recipe with its overrides; None once --print-config has printed it."""
    from lit_transformer.recipe.load import load_recipe, to_yaml

    cfg = load_recipe(args.recipe, args.overrides)
    if not args.print_config:
        return cfg
    from lit_transformer.run.resolve import resolve_run

    # `auto` values and the precision as the run resolves them
    print(to_yaml(resolve_run(cfg, read_source=False, training=False).config), end="")
    return None


def training(function: str) -> Callable[[argparse.Namespace], None]:
    """A handler that runs commands.train.<function> and prints its final metrics as one JSON line."""

    def handler(args: argparse.Namespace) -> None:
        cfg = loaded_recipe(args)
        if cfg is not None:
            from lit_transformer.commands import train

            print(json.dumps({"run_dir": cfg.run.dir, **getattr(train, function)(cfg)}))

    return handler


def prepare(args: argparse.Namespace) -> None:
    cfg = loaded_recipe(args)
    if cfg is not None:
        from lit_transformer.commands.train import prepare

        prepare(cfg, part=args.part, merge=args.merge)


def evaluate(args: argparse.Namespace) -> None:
    from lit_transformer.commands.evaluate import EvaluateDecoding, evaluate_suite

    flags = ("num_beams", "length_penalty", "max_new_tokens", "batch_size", "batch_tokens", "dtype", "device")
    result = evaluate_suite(
        args.target,
        **pick(args, "split", "data", "data_target", "task", "max_batches", "suite", "all_checkpoints", "limit"),
        **pick(args, "output", "lm_eval_include"),
        eval_names=tuple(args.eval_names),
        lm_eval_tasks=args.lm_eval,
        decoding=EvaluateDecoding(**pick(args, *flags), progress_bar=True),
    )
    print_metrics(result, args.json)


def generate(args: argparse.Namespace) -> None:
    from lit_transformer.commands import inference

    decoding = pick(args, "max_new_tokens", "greedy", "temperature", "top_p", "num_beams", "length_penalty", "seed")
    decoding |= pick(args, "bidirectional_prompt", "mode_token", "dtype", "device") | {"top_k": args.top_k or None}
    if args.input is None:
        print(inference.generate(args.target, args.prompt, continuation_only=args.continuation_only, **decoding))
        return
    batching = pick(args, "column", "batch_size", "batch_tokens")
    inference.generate_file(args.target, args.input, args.output, **batching, **decoding)


def info(args: argparse.Namespace) -> None:
    from lit_transformer.commands.info import DEFAULT_MFU, format_info, format_plan, info, plan

    out = info(args.target, args.overrides)
    text = format_info(out)
    if args.plan or args.peak_tflops is not None or args.mfu is not None:
        out["plan"] = plan(args.target, args.overrides, args.peak_tflops, DEFAULT_MFU if args.mfu is None else args.mfu)
        text += "\n\n" + format_plan(out["plan"])
    print(json.dumps(out) if args.json else text)


def average(args: argparse.Namespace) -> None:
    from lit_transformer.commands.average import average

    print(average(args.run_dir, args.out, args.last))


def export(args: argparse.Namespace) -> None:
    from lit_transformer.commands.inference import export

    print(export(args.target, args.out, args.format))


def plot(args: argparse.Namespace) -> None:
    from lit_transformer.commands.plot import plot

    curves = plot(args.runs, args.output, args.metric, x=args.x)
    print(f"plot: {len(curves)} panels ({', '.join(curves)}) -> {args.output}")


def compare(args: argparse.Namespace) -> None:
    from lit_transformer.commands.compare import compare, to_markdown

    comparison = compare(args.runs, args.metric)
    print(json.dumps(comparison.values) if args.json else to_markdown(comparison))


def recipes(args: argparse.Namespace) -> None:
    from lit_transformer.commands.recipes import list_recipes

    print(list_recipes(args.json))


# ----------------------------------------------------------------------------- the table

COMMANDS = (
    Command(
        "pretrain",
        "train a model from scratch as a recipe describes (mlm, clm, span, seq2seq, classify)",
        training("train"),
        RECIPE,
        epilog=RECIPE_EPILOG,
    ),
    Command(
        "finetune",
        "fine-tune a pretrained model (finetune.from: run directory, checkpoint, HF directory or minilm)",
        training("finetune"),
        RECIPE,
        epilog=RECIPE_EPILOG,
    ),
    Command(
        "prepare",
        "train or load the tokenizer and tokenize the data into the cache (or a shared store), without training",
        prepare,
        PREPARE,
        epilog=RECIPE_EPILOG,
    ),
    Command(
        "evaluate",
        "named evaluations of a run or checkpoint: its own split, files, suites, lm-eval tasks",
        evaluate,
        EVALUATE,
        "Evaluations of a run directory (its final model), a checkpoint or a model directory, as "
        "eval/<name>/<metric>: the run's own --split (eval/validation/..., eval/test/...), --data FILE "
        "(eval/data/...), with --data-target or a translation run's split also BLEU and chrF "
        "(eval/<name>_translation/...), the recipe's --eval entries, a --suite file, --lm-eval tasks. "
        "Nothing named: the validation split and the recipe's eval section (see docs/evaluation.md).",
    ),
    Command(
        "generate",
        "generate text with a clm, span or seq2seq model",
        generate,
        GENERATE,
        "Continue a prompt (decoder) or transform it (encoder-decoder). Samples with temperature/top-k/top-p "
        "unless --greedy or --num-beams > 1. A decoder's --prompt output is the prompt followed by its "
        "continuation; --input outputs and an encoder-decoder's are the new text alone.",
    ),
    Command(
        "info",
        "parameters, training FLOPs and KV-cache size of a preset or recipe",
        info,
        (
            arg("target", metavar="PRESET_OR_RECIPE"),
            arg("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides"),
            JSON,
            arg(
                "--plan",
                action="store_true",
                help="plan the recipe's run on trainer.num_nodes x trainer.devices: memory per device, tokens, "
                "FLOPs and time per step, checkpoint size, data read per node (implied by --peak-tflops and --mfu)",
            ),
            arg("--peak-tflops", type=float, metavar="X", help="a device's dense peak TFLOP/s, for time per step"),
            arg("--mfu", type=float, metavar="F", help="model FLOPs utilisation assumed (default 0.4)"),
        ),
        "Parameters, training FLOPs per token and KV-cache bytes of a preset (e.g. gpt2-small) or a recipe; "
        "nothing is built.",
    ),
    Command(
        "average",
        "average the model weights of a run's last N checkpoints",
        average,
        (
            arg("run_dir", metavar="RUN_DIR"),
            arg("out", metavar="OUT_DIR", help="output model directory"),
            arg("--last", type=int, default=5, metavar="N", help="how many of the newest checkpoints (default 5)"),
        ),
        "Write the elementwise mean (float32) of the model weights of RUN_DIR's last N checkpoints as a model "
        "directory that generate, evaluate, finetune and export read (Vaswani et al. 2017 average the last 5). "
        "Sharded (FSDP) checkpoints work too.",
    ),
    Command(
        "export",
        "write a run's model as a transformers directory",
        export,
        (
            TARGET,
            arg("out", metavar="OUT", help="output directory"),
            arg("--format", default="hf", choices=["hf"], help="output format (default: hf)"),
        ),
        "Write a run's language model as a directory transformers' from_pretrained loads "
        "(BertForMaskedLM, GPT2LMHeadModel, T5ForConditionalGeneration, LlamaForCausalLM).",
    ),
    Command(
        "plot",
        "plot the curves of runs from their CSV logs into an image",
        plot,
        (
            RUNS,
            metric_patterns("plot"),
            arg(
                "--x",
                choices=("step", "tokens"),
                default="step",
                help="x axis: optimizer step (default) or training tokens seen (needs a tokens-seen column)",
            ),
            arg("--output", required=True, metavar="FILE.png", help="the image to write (.png, .pdf or .svg)"),
        ),
        "One panel per metric, one line per run (labelled with its directory's name), from the runs' CSV logs. "
        "Default metrics: train/loss, val/ loss, bpb, accuracy, macro_f1 and bleu, and every eval/ metric but "
        "*/seconds.",
    ),
    Command(
        "compare",
        "a table of runs' final metrics",
        compare,
        (RUNS, metric_patterns("only"), arg("--json", action="store_true", help="print {run: {metric: value}}")),
        "A markdown table of the runs' final metrics, one row per run: each run's metrics.json, and for val/, "
        "test/ and eval/ metrics missing from it, the last value in its CSV log (marked *).",
    ),
    Command("recipes", "list the recipes shipped with the package", recipes, (JSON,)),
)


def build_parser() -> argparse.ArgumentParser:
    # one --debug for the top level and every command; SUPPRESS: a command's parser must not
    # reset a --debug given before the command name (argparse copies subparser defaults)
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks of errors")
    parser = argparse.ArgumentParser(
        prog="lit-transformer",
        parents=[debug],
        description="Pretrain and fine-tune Transformers (BERT, GPT, T5, the 2017 Transformer) with PyTorch Lightning.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        p = sub.add_parser(
            command.name,
            parents=[debug],
            help=command.help,
            description=command.description or command.help,
            epilog=command.epilog,
        )
        for entry in command.args:
            group = p.add_mutually_exclusive_group(required=entry.required) if isinstance(entry, OneOf) else p
            for flags, options in entry.args if isinstance(entry, OneOf) else (entry,):
                group.add_argument(*flags, **options)
        p.set_defaults(handler=command.handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from lit_transformer.errors import DataError
    from lit_transformer.model.config import ConfigError

    args = build_parser().parse_args(argv)
    if getattr(args, "debug", False):
        # trainer.compile's graph breaks and recompilations (training/compiled_step.py); read by
        # torch when it is first imported, which the commands do after this
        os.environ.setdefault("TORCH_LOGS", "graph_breaks,recompiles")
    try:
        args.handler(args)
        return 0
    except (RecipeError, ConfigError, DataError, RunError) as error:
        if getattr(args, "debug", False):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
