"""`lit-transformer`: pretrain, finetune, evaluate, generate, prepare, info, average, export, plot, compare.

Each subcommand parses its arguments and calls one function: `runner` trains, `inference`
evaluates, generates and exports, `suite` runs named evaluations, `info` counts, `plot` and
`compare` read run directories' logs and metrics. A user error (a bad
recipe, missing data, a missing run directory, a bad checkpoint) prints one line,
`error: ...`, and exits with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lit_transformer.errors import RecipeError, RunError

# the batching and dtype flags of generate and evaluate's translation decoding; the defaults copy
# batch_generate.BATCH_ROWS and BATCH_TOKENS, which this module cannot import without torch
BATCH_SIZE_HELP = "at most N inputs decoded together (default 256)"
BATCH_TOKENS_HELP = (
    "at most N tokens in a batch's decode buffer, each input counted as the batch's longest prompt "
    "plus the new-token budget, times --num-beams (default 8192; a longer input goes alone)"
)
DTYPE_HELP = (
    "the weights' dtype for decoding (default auto: bfloat16 on CUDA or a CPU with bf16 matrix "
    "instructions, AMX or AVX512-BF16, else float32)"
)
DTYPES = ("auto", "float32", "bfloat16")
DEVICE_HELP = "where to decode (default auto: the GPU when torch sees one, its steps as CUDA graphs; else the CPU)"
DEVICES = ("auto", "cpu", "cuda")
# a subcommand's --debug must not reset the top-level one (argparse copies subparser defaults)
DEBUG = dict(action="store_true", default=argparse.SUPPRESS, help="show tracebacks of errors")
EPILOG = (
    "Recipes are YAML files (see recipes/); key=value arguments override any recipe key, e.g. trainer.max_steps=100."
)


def _recipe_command(sub, name: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help, epilog=EPILOG)
    p.add_argument("recipe", metavar="RECIPE", help="recipe YAML file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. optim.lr=1e-3")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe as YAML and exit")
    return p


def build_parser() -> argparse.ArgumentParser:
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    parser = argparse.ArgumentParser(
        prog="lit-transformer",
        parents=[debug],
        description="Pretrain and fine-tune Transformers (BERT, GPT, T5, the 2017 Transformer) with PyTorch Lightning.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=argparse.ArgumentParser)
    for name, help in (
        ("pretrain", "train a model from scratch as a recipe describes (mlm, clm, span, seq2seq, classify)"),
        ("finetune", "fine-tune a pretrained model (finetune.from: run directory, checkpoint, HF directory or minilm)"),
        ("prepare", "train or load the tokenizer and tokenize the data into the cache, without training"),
    ):
        _recipe_command(sub, name, help).add_argument("--debug", **DEBUG)

    p = sub.add_parser(
        "evaluate",
        help="validation (or test) metrics of a run or checkpoint",
        description="Validation (or, with --split test, test) metrics of a run directory (its final model) "
        "or a checkpoint: "
        "loss, perplexity, bits_per_byte, accuracy, macro_f1 as fit the objective; a translation "
        "(seq2seq) run also decodes every sentence and reports sacrebleu's BLEU and chrF with "
        "their signatures and its decoding speed.",
    )
    p.add_argument("target", metavar="RUN_OR_CKPT")
    p.add_argument(
        "--data",
        metavar="PATH",
        help="evaluate on this file instead of the run's validation split "
        "(a file in the run's data format; with --data-target, the source side of aligned files)",
    )
    p.add_argument(
        "--data-target",
        metavar="PATH",
        help="translation: the reference file aligned line by line "
        "with --data (e.g. --data test.de --data-target test.en)",
    )
    p.add_argument(
        "--max-batches",
        type=int,
        metavar="N",
        help="evaluate at most N batches (translation: their sentences; default: all)",
    )
    p.add_argument(
        "--num-beams",
        type=int,
        metavar="N",
        help="translation BLEU/chrF: beam width (default: the recipe's objective.num_beams)",
    )
    p.add_argument(
        "--length-penalty",
        type=float,
        metavar="ALPHA",
        help="translation: GNMT's alpha (default: the recipe's objective.length_penalty)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="translation: new tokens per sentence (default: the recipe's data.max_target_length)",
    )
    p.add_argument("--batch-size", type=int, default=256, metavar="N", help=f"translation: {BATCH_SIZE_HELP}")
    p.add_argument("--batch-tokens", type=int, default=8192, metavar="N", help=f"translation: {BATCH_TOKENS_HELP}")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help=f"translation: {DTYPE_HELP}; the losses keep the run's precision",
    )
    p.add_argument(
        "--device", choices=DEVICES, default="auto", help=f"translation: {DEVICE_HELP}; the losses run on the CPU"
    )
    p.add_argument(
        "--task",
        metavar="NAME",
        help="a mixture run: only this task, with the single objective's "
        "keys (default: every task, keyed <task>/<metric>)",
    )
    p.add_argument(
        "--split",
        choices=("validation", "test"),
        default="validation",
        help="the run's split to evaluate: validation (default) or test (the recipe's data.test_files)",
    )
    suite = p.add_argument_group(
        "named evaluations",
        "any of these runs the evaluation suite instead of the split's metrics (see docs/commands.md)",
    )
    suite.add_argument("--suite", metavar="FILE.yaml", help="the evaluations listed in this YAML file")
    suite.add_argument(
        "--eval",
        dest="eval_names",
        action="append",
        default=[],
        metavar="NAME",
        help="the run's recipe evaluation NAME (repeatable; default: all of the run's own)",
    )
    suite.add_argument(
        "--all-checkpoints",
        action="store_true",
        help="evaluate every checkpoint of the run and write the curve (see --output)",
    )
    suite.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="comma-separated lm-evaluation-harness tasks, e.g. hellaswag,arc_easy (needs the eval extra)",
    )
    suite.add_argument("--lm-eval-include", metavar="DIR", help="a folder of lm-eval task YAML files to add")
    suite.add_argument(
        "--limit", type=int, metavar="N", help="at most N examples per evaluation and lm-eval task (default: all)"
    )
    suite.add_argument(
        "--output",
        metavar="FILE",
        help="with --all-checkpoints: the curve's CSV file (default: the run directory's eval_curve.csv)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--debug", **DEBUG)

    p = sub.add_parser(
        "generate",
        help="generate text with a clm, span or seq2seq model",
        description="Continue a prompt (decoder) or transform it (encoder-decoder). Samples with "
        "temperature/top-k/top-p unless --greedy or --num-beams > 1. A decoder's --prompt output is the "
        "prompt followed by its continuation; --input outputs and an encoder-decoder's are the new text alone.",
    )
    p.add_argument("target", metavar="RUN_OR_CKPT")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", metavar="TEXT")
    given.add_argument(
        "--input",
        metavar="FILE",
        help="one input per line (or --column of a .jsonl/.csv/.tsv "
        "file), streamed; one output per line, in input order",
    )
    p.add_argument(
        "--output",
        metavar="FILE",
        help='with --input: write here (default stdout; .jsonl: {"input", "output"} objects)',
    )
    p.add_argument(
        "--column",
        metavar="NAME",
        help="with a .jsonl/.csv/.tsv --input: the column to read (default source, else text)",
    )
    p.add_argument(
        "--continuation-only",
        action="store_true",
        help="with --prompt and a decoder: print only the new text, not the prompt before it",
    )
    p.add_argument("--batch-size", type=int, default=256, metavar="N", help=f"with --input: {BATCH_SIZE_HELP}")
    p.add_argument("--batch-tokens", type=int, default=8192, metavar="N", help=f"with --input: {BATCH_TOKENS_HELP}")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    p.add_argument("--device", choices=DEVICES, default="auto", help=DEVICE_HELP)
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50, metavar="K", help="0 for no top-k filter")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--num-beams", type=int, default=1, metavar="N", help="beam search when > 1")
    p.add_argument(
        "--length-penalty",
        type=float,
        default=0.6,
        metavar="ALPHA",
        help="beam search: GNMT's alpha, scores divided by ((5 + length) / 6) ** ALPHA (default 0.6)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bidirectional-prompt",
        action="store_true",
        help="a decoder reads the prompt bidirectionally, as a prefix (a mixture run that trained prefix_lm)",
    )
    p.add_argument(
        "--mode-token",
        metavar="TOKEN",
        help="put this special token before every prompt, as a mixture's task did (e.g. [S2S] for UL2's S-denoiser)",
    )
    p.add_argument("--debug", **DEBUG)

    p = sub.add_parser(
        "info",
        help="parameters, training FLOPs and KV-cache size of a preset or recipe",
        description="Parameters, training FLOPs per token and KV-cache bytes of a preset "
        "(e.g. gpt2-small) or a recipe; nothing is built.",
    )
    p.add_argument("target", metavar="PRESET_OR_RECIPE")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--plan",
        action="store_true",
        help="plan the recipe's run on trainer.num_nodes x trainer.devices: memory per device, tokens, FLOPs "
        "and time per step, checkpoint size, data read per node (implied by --peak-tflops and --mfu)",
    )
    p.add_argument("--peak-tflops", type=float, metavar="X", help="a device's dense peak TFLOP/s, for time per step")
    p.add_argument("--mfu", type=float, metavar="F", help="model FLOPs utilisation assumed (default 0.4)")
    p.add_argument("--debug", **DEBUG)

    p = sub.add_parser(
        "average",
        help="average the model weights of a run's last N checkpoints",
        description="Write the elementwise mean (float32) of the model weights of RUN_DIR's last N "
        "checkpoints as a model directory that generate, evaluate, finetune and export read "
        "(Vaswani et al. 2017 average the last 5). Sharded (FSDP) checkpoints work too.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("out", metavar="OUT_DIR", help="output model directory")
    p.add_argument("--last", type=int, default=5, metavar="N", help="how many of the newest checkpoints (default 5)")
    p.add_argument("--debug", **DEBUG)

    p = sub.add_parser(
        "export",
        help="write a run's model as a transformers directory",
        description="Write a run's language model as a directory transformers' from_pretrained loads "
        "(BertForMaskedLM, GPT2LMHeadModel, T5ForConditionalGeneration, LlamaForCausalLM).",
    )
    p.add_argument("target", metavar="RUN_OR_CKPT")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--format", default="hf", choices=["hf"], help="output format (default: hf)")
    p.add_argument("--debug", **DEBUG)

    p = sub.add_parser(
        "plot",
        help="plot the curves of runs from their CSV logs into an image",
        description="One panel per metric, one line per run (labelled with its directory's name), from the "
        "runs' CSV logs. Default metrics: train/loss, val/ loss, bpb, accuracy, macro_f1 and bleu, and every "
        "eval/ metric but */seconds.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="PATTERN",
        help="plot the metrics matching this glob pattern, e.g. 'val/*' (repeatable; each must match)",
    )
    p.add_argument(
        "--x",
        choices=("step", "tokens"),
        default="step",
        help="x axis: optimizer step (default) or training tokens seen (needs a tokens-seen column in the logs)",
    )
    p.add_argument("--output", required=True, metavar="FILE.png", help="the image to write (.png, .pdf or .svg)")
    p.add_argument("--debug", **DEBUG)

    p = sub.add_parser(
        "compare",
        help="a table of runs' final metrics",
        description="A markdown table of the runs' final metrics, one row per run: each run's metrics.json, and "
        "for val/, test/ and eval/ metrics missing from it, the last value in its CSV log (marked *).",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="PATTERN",
        help="only the metrics matching this glob pattern, e.g. 'eval/*' (repeatable; each must match)",
    )
    p.add_argument("--json", action="store_true", help="print {run: {metric: value}} as one JSON object")
    p.add_argument("--debug", **DEBUG)
    return parser


# evaluate's flags (argparse dests) of the split's metrics, and of the evaluation suite; no flag of
# the one means anything to the other
SPLIT_FLAGS = ("data", "data_target", "max_batches", "num_beams", "length_penalty", "max_new_tokens", "task")
SUITE_FLAGS = ("suite", "eval_names", "all_checkpoints", "lm_eval", "lm_eval_include", "limit", "output")


def _flag(dest: str) -> str:
    return "--eval" if dest == "eval_names" else "--" + dest.replace("_", "-")


def _suite_requested(args: argparse.Namespace) -> bool:
    """Whether evaluate runs the suite; a RunError for a flag of the split's metrics beside it."""
    given = [_flag(key) for key in SUITE_FLAGS if getattr(args, key) not in (None, False, [])]
    if not given:
        return False
    clash = [_flag(key) for key in SPLIT_FLAGS if getattr(args, key) is not None]
    clash += ["--split test"] if args.split != "validation" else []
    if clash:
        raise RunError(
            f"evaluate: {clash[0]} does not go with {given[0]} (the split's metrics or the evaluation suite)"
        )
    if args.output is not None and not args.all_checkpoints:
        raise RunError("evaluate: --output names the file --all-checkpoints writes; add --all-checkpoints")
    if args.lm_eval_include is not None and args.lm_eval is None:
        raise RunError("evaluate: --lm-eval-include adds task files for --lm-eval; add --lm-eval TASKS")
    if args.lm_eval is not None and not _task_names(args.lm_eval):
        raise RunError(f"evaluate: --lm-eval {args.lm_eval!r} names no task (comma-separated names, e.g. hellaswag)")
    if args.limit is not None and args.limit < 1:
        raise RunError(f"evaluate: --limit {args.limit}: at least 1 example")
    return True


def _task_names(tasks: str) -> list[str]:
    return [name.strip() for name in tasks.split(",") if name.strip()]


def _print_metrics(metrics: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(metrics))
        return
    for key, value in metrics.items():
        if isinstance(value, float):
            print(f"{key:<24} {value:.4f}")
        else:
            print(f"{key:<24} {json.dumps(value) if isinstance(value, (dict, list)) else value}")


def run(args: argparse.Namespace) -> int:
    """Each command imports what it needs when it runs: `--help` and `info` import neither
    torch's heavy parts nor Lightning."""
    if args.command in ("pretrain", "finetune", "prepare"):
        from lit_transformer.recipe.load import load_recipe, to_yaml

        cfg = load_recipe(args.recipe, args.overrides)
        if args.print_config:
            from lit_transformer.recipe.auto_rules import auto_keys

            if auto_keys(cfg) and cfg.finetune.from_ is None:  # as the run would resolve them (it measures)
                from lit_transformer.training.auto_resolve import resolve_auto

                cfg = resolve_auto(cfg)
            print(to_yaml(cfg), end="")
            return 0
        from lit_transformer.commands import train

        if args.command == "prepare":
            train.prepare(cfg)
            return 0
        metrics = train.finetune(cfg) if args.command == "finetune" else train.train(cfg)
        print(json.dumps({"run_dir": cfg.run.dir, **metrics}))
        return 0
    if args.command == "info":
        from lit_transformer.commands.info import DEFAULT_MFU, format_info, format_plan, info, plan

        out = info(args.target, args.overrides)
        text = format_info(out)
        if args.plan or args.peak_tflops is not None or args.mfu is not None:
            mfu = DEFAULT_MFU if args.mfu is None else args.mfu
            out["plan"] = plan(args.target, args.overrides, args.peak_tflops, mfu)
            text += "\n\n" + format_plan(out["plan"])
        print(json.dumps(out) if args.json else text)
        return 0
    if args.command == "average":
        from lit_transformer.commands.average import average

        print(average(args.run_dir, args.out, args.last))
        return 0
    if args.command == "plot":
        from lit_transformer.commands.plot import plot

        curves = plot(args.runs, args.output, args.metric, x=args.x)
        print(f"plot: {len(curves)} panels ({', '.join(curves)}) -> {args.output}")
        return 0
    if args.command == "compare":
        from lit_transformer.commands.compare import compare, to_markdown

        comparison = compare(args.runs, args.metric)
        print(json.dumps(comparison.values) if args.json else to_markdown(comparison))
        return 0
    if args.command == "evaluate" and _suite_requested(args):
        from lit_transformer.commands.evaluate import evaluate_suite

        result = evaluate_suite(
            args.target,
            suite=args.suite,
            eval_names=tuple(args.eval_names),
            all_checkpoints=args.all_checkpoints,
            lm_eval_tasks=None if args.lm_eval is None else _task_names(args.lm_eval),
            lm_eval_include=args.lm_eval_include,
            limit=args.limit,
            output=args.output,
        )
        _print_metrics(result, args.json)
        return 0
    from lit_transformer.commands import inference

    if args.command == "evaluate":
        metrics = inference.evaluate(
            args.target,
            args.data,
            max_batches=args.max_batches,
            data_target=args.data_target,
            num_beams=args.num_beams,
            length_penalty=args.length_penalty,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            batch_tokens=args.batch_tokens,
            dtype=args.dtype,
            device=args.device,
            task=args.task,
            split=args.split,
        )
        _print_metrics(metrics, args.json)
        return 0
    if args.command == "generate":
        decoding = dict(
            max_new_tokens=args.max_new_tokens,
            greedy=args.greedy,
            temperature=args.temperature,
            top_k=args.top_k or None,
            top_p=args.top_p,
            num_beams=args.num_beams,
            length_penalty=args.length_penalty,
            seed=args.seed,
            bidirectional_prompt=args.bidirectional_prompt,
            mode_token=args.mode_token,
            dtype=args.dtype,
            device=args.device,
        )
        if args.input is not None:
            inference.generate_file(
                args.target,
                args.input,
                args.output,
                column=args.column,
                batch_size=args.batch_size,
                batch_tokens=args.batch_tokens,
                **decoding,
            )
        else:
            print(inference.generate(args.target, args.prompt, continuation_only=args.continuation_only, **decoding))
        return 0
    print(inference.export(args.target, args.out, args.format))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from lit_transformer.errors import DataError
    from lit_transformer.model.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (RecipeError, ConfigError, DataError, RunError) as error:
        if args.debug:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
