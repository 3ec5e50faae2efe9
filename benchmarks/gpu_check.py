"""One command that checks every CUDA code path of the project on the GPU at hand, small and in
minutes, and prints a table: the lent GPU is there for minutes, now and then.

    python benchmarks/gpu_check.py                          # CUDA: every check (a few minutes on one H100)
    python benchmarks/gpu_check.py --json gpu_check.json    # the rows as JSON too
    python benchmarks/gpu_check.py --device cpu --quick     # the same checks on CPU, shrunk (the test suite's)

Each check is a function returning one row {check, status: pass|fail|skip, detail, seconds,
numbers...}; one that raises is a `fail` row with the error's first line and the others still run;
exit status 1 when any failed. What each check runs and when it passes: benchmarks/README.md,
"GPU check". On CPU (--device cpu) the sizes are tiny, the GPT-2 checks use 2 layers at T=128,
flex runs forward only (torch has no flex backward on CPU) and peak_memory is skipped.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository on sys.path)
from gpu_check_runs import CheckFailed, Context, keyword_task, need, recipe_run, token_cache  # noqa: E402
from gpu_flex import flex_kernel_case, flex_masks, flex_model_case  # noqa: E402

CHECKS = tuple(
    "families flex_attention mixed_modes strategies fused_adamw activation_checkpointing mfu kv_decoding "
    "peak_memory".split()
)
NO_CUDA = "gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to check"
FAMILIES = ("tiny-mlm", "tiny-clm", "tiny-span", "tiny-seq2seq", "tiny-classify")


# ----------------------------------------------------------------------------- recipe families
def check_families(ctx: Context) -> dict:
    steps = 6 if ctx.quick else 8
    classify = [*keyword_task(ctx.scratch / "keywords"), "optim.lr=3e-3", "model.dropout=0.0", "data.batch_size=32"]
    results, problems = {}, []
    for index, recipe in enumerate(FAMILIES):
        # --quick on a CPU (the test suite's run) alternates the precisions over the families:
        # bf16 is emulated there, and each run costs seconds
        both = ("bf16-mixed", "bf16-true")
        for precision in both if ctx.cuda or not ctx.quick else both[index % 2 : index % 2 + 1]:
            extra = [f"trainer.precision={precision}"] + (classify if recipe == "tiny-classify" else [])
            n = 12 if recipe == "tiny-classify" else steps
            run = recipe_run(ctx, recipe, extra, n)
            losses, seen = run["losses"], run["seen"]
            name = f"{recipe.removeprefix('tiny-')}/{precision}"
            # the first loss and the mean of the last two: what "learnt" is judged on below
            results[name] = [round(losses[0], 4), round(statistics.fmean(losses[-2:]), 4)]
            dtype = "bfloat16" if precision == "bf16-true" else "float32"
            if seen.get("device") != ctx.device or seen.get("dtype") != dtype:
                problems.append(f"{name} trained {seen} (expected {ctx.device}, {dtype} weights)")
            if not statistics.fmean(losses[-2:]) < losses[0]:
                problems.append(f"{name} did not learn: losses {[round(x, 3) for x in losses]}")
            if not all(math.isfinite(v) for v in run["metrics"].values()) or not run["metrics"]:
                problems.append(f"{name}: final validation {run['metrics']}")
            if not (run["dir"] / "model.safetensors").is_file():
                problems.append(f"{name}: no final model.safetensors")
    need(not problems, "; ".join(problems))
    return {"detail": f"{len(results)} runs, {steps} steps (classify 12): first and last loss", "losses": results}


# ----------------------------------------------------------------------------- flex attention
def check_flex_attention(ctx: Context) -> dict:
    from lit_transformer.model.masks import has_flex

    if not has_flex():
        return {"status": "skip", "detail": f"torch {torch.__version__} has no flex_attention (2.5+)"}
    B, T = 2, (128 if ctx.quick else 256)
    cases = flex_masks(B, T, ctx.device)
    if not ctx.cuda and ctx.quick:
        cases = cases[:1]  # each case compiles for seconds on CPU
    numbers, problems = {}, []
    for name, mask, valid, kv_heads in cases:
        torch._dynamo.reset()
        errors = flex_kernel_case(mask, valid, kv_heads, B, T, ctx.device, backward=ctx.cuda)
        for part, (flex, eager) in errors.items():
            numbers[f"{name}/{part}"] = [round(flex, 5), round(eager, 5)]
            # bf16 rounding of the same product in another order: within a few times the eager error
            if not flex <= max(4 * eager, 2e-2):
                problems.append(f"{name} {part}: flex error {flex:.3g}, eager bf16 {eager:.3g}")
    detail = "kernel: [flex, eager bf16] errors vs float32 dense"
    if ctx.cuda:
        for name in ("decoder",) if ctx.quick else ("decoder", "encoder"):
            torch._dynamo.reset()
            flex, eager, decoy = flex_model_case(name, ctx.device)
            numbers[f"model-{name}"] = [round(flex, 5), round(eager, 5)]
            if not flex <= max(4 * eager, 2e-2):
                problems.append(f"model {name}: compiled error {flex:.3g}, eager bf16 {eager:.3g}")
            if not decoy > max(0.05, 10 * flex):  # a self-only mask moves the logits ~50% (measured on CPU)
                problems.append(f"model {name}: compiled blocks ignore the flex block mask (decoy change {decoy:.3g})")
        detail += "; models with compiled blocks (decoder: window, documents, GQA"
        detail += ")" if ctx.quick else "; encoder: window, global tokens, padding)"
    else:
        detail += "; CPU: forward only (torch has no flex backward on CPU), models build block masks on CUDA only"
    need(not problems, "; ".join(problems))
    return {"detail": detail, "errors": numbers}


# ----------------------------------------------------------------------------- strategies, optimizer
def check_strategies(ctx: Context) -> dict:
    steps = 3 if ctx.quick else 4
    expected = "nccl" if ctx.cuda else "gloo"
    precision = "bf16-mixed" if ctx.cuda else common.choose_precision("cpu", None)[0]
    numbers, problems = {}, []
    try:
        for strategy in ("ddp", "fsdp"):
            # with the recipe's eval section, as shipped: its step-0 evaluations once crashed FSDP
            # (--quick on a CPU leaves them out: tests/test_recipe_strategies.py runs them on gloo)
            overrides = [f"trainer.strategy={strategy}", f"trainer.precision={precision}"]
            run = recipe_run(ctx, "tiny-clm", overrides, steps, evaluations=ctx.cuda or not ctx.quick)
            numbers[strategy] = [round(x, 4) for x in run["losses"]]
            if run["seen"].get("backend") != expected:
                problems.append(f"{strategy} ran on backend {run['seen'].get('backend')}, not {expected}")
            if strategy == "fsdp":
                shards = run["dir"] / "checkpoints" / "last.ckpt"
                files = sorted(p.name for p in shards.iterdir()) if shards.is_dir() else []
                if "meta.pt" not in files or not any(f.endswith(".distcp") for f in files):
                    problems.append(f"fsdp: {shards} is not a sharded checkpoint (holds {files})")
                if not (run["dir"] / "model.safetensors").is_file():
                    problems.append("fsdp: no consolidated model.safetensors")
    finally:
        if torch.distributed.is_initialized():  # later checks run on one device without a group
            torch.distributed.destroy_process_group()
    need(not problems, "; ".join(problems))
    evaluated = ", tiny-clm's named evaluations on" if ctx.cuda or not ctx.quick else ""
    detail = f"{precision}, {steps} steps each on {expected}{evaluated}; FSDP2 sharded checkpoint saved"
    return {"detail": detail, **numbers}


def check_fused_adamw(ctx: Context) -> dict:
    from lit_transformer.objectives.optim import build_optimizer
    from lit_transformer.recipe.schema import OptimConfig

    shapes = [(257, 129), (129,), (3, 64, 33)]
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g).to(ctx.device) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(ctx.device) for s in shapes] for _ in range(3)]

    def adamw(dtype: torch.dtype, **kind) -> list[torch.Tensor]:
        """The weights after 3 AdamW steps in `dtype` (from `start` rounded to bfloat16 for both
        dtypes, so that the float32 run is the bfloat16 runs' exact-arithmetic reference)."""
        params = [p.to(torch.bfloat16).to(dtype).requires_grad_() for p in start]
        optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kind)
        for step in grads:
            for p, grad in zip(params, step):
                p.grad = grad.to(dtype)
            optimizer.step()
        return [p.detach().float() for p in params]

    def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    reference = adamw(torch.float32, foreach=True)
    numbers = {
        "float32_max_difference": distance(adamw(torch.float32, fused=True), reference),
        "bfloat16_fused_error": distance(adamw(torch.bfloat16, fused=True), reference),
        "bfloat16_foreach_error": distance(adamw(torch.bfloat16, foreach=True), reference),
    }
    # float32: 1e-5 is 0.1% of one update (lr 1e-2) on weights of order 1
    need(numbers["float32_max_difference"] <= 1e-5, f"float32 fused and for-each AdamW differ: {numbers}")
    # bfloat16: fused updates in float32 and rounds once; it must be no less exact than for-each
    ulp = 2**-7 * max(float(p.abs().max()) for p in start)  # one bfloat16 step at the largest weight
    fused_error, foreach_error = numbers["bfloat16_fused_error"], numbers["bfloat16_foreach_error"]
    need(fused_error <= max(foreach_error, ulp), f"bfloat16 fused AdamW less exact than for-each: {numbers}")
    built = build_optimizer([{"params": [torch.zeros(3, device=ctx.device, requires_grad=True)]}], OptimConfig())
    need(built.defaults.get("fused") is True, f"build_optimizer did not pick the fused kernel: {built.defaults}")
    return {"detail": "3 steps, float32 and bfloat16; build_optimizer picks fused", **numbers}


def check_activation_checkpointing(ctx: Context) -> dict:
    steps = 4 if ctx.quick else 6
    precision = "bf16-mixed" if ctx.cuda else common.choose_precision("cpu", None)[0]
    runs = {}
    for on in (False, True):
        extra = ["model.dropout=0.1", f"trainer.precision={precision}", f"trainer.activation_checkpointing={on}"]
        runs[on] = recipe_run(ctx, "tiny-clm", extra, steps)
    wrapped = [runs[on]["seen"].get("checkpointed") for on in (False, True)]
    need(wrapped == [False, True], f"blocks checkpointed without / with the option: {wrapped}")
    plain, checkpointed = runs[False]["losses"], runs[True]["losses"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(checkpointed, plain))
    numbers = {"losses": [round(x, 5) for x in plain], "max_relative_difference": worst}
    if ctx.cuda:
        numbers |= {"peak_bytes": runs[False]["peak_bytes"], "peak_bytes_checkpointed": runs[True]["peak_bytes"]}
    need(worst <= 2e-3, f"losses differ by {worst:.3g} relative: {plain} without, {checkpointed} with")
    return {"detail": f"tiny-clm, dropout 0.1, {precision}, {steps} steps: the same losses", **numbers}


# ----------------------------------------------------------------------------- attention modes
def check_mixed_modes(ctx: Context) -> dict:
    """A row-mixed batch (causal rows and bidirectional rows, as tiny-gptbert's; issue #52) on the
    fused kernels: its forward and backward run with SDPA held to the flash kernel, which takes no
    bias (the dense (B, 1, T, S) bias the rows shared before could not), and its step (forward and
    backward of the body, bf16 autocast on CUDA) is timed against a causal batch of the same shape,
    alternating. The target is 1.1x at GPT-2 small's shape; the ratio is reported, not judged."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lit_transformer.model import LanguageModel, preset

    layers, T, B = (12, 1024, 8) if ctx.cuda else (2, 128, 4)
    small = {} if ctx.cuda else {"vocab_size": 512, "d_model": 256, "n_heads": 4, "d_ff": 1024}  # CPU: the path only
    cfg = preset("gpt2-small", n_layers=layers, dropout=0.0, attention_dropout=0.0, **small)
    torch.manual_seed(0)
    model = LanguageModel.from_config(cfg, device=ctx.device)
    ids = torch.randint(5, cfg.vocab_size, (B, T), device=ctx.device)
    mixed = torch.tensor([0] * (B - B // 4) + [T] * (B // 4))  # on the CPU, where collators make them
    dtype = torch.bfloat16 if ctx.cuda else torch.float32  # bf16 is emulated on many CPUs

    def step(prefix):
        def run(_):
            model.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device, dtype=dtype, enabled=ctx.cuda):
                features = model.head_features(ids, prefix_lengths=prefix)  # (B, T, C)
            features.float().square().mean().backward()

        return run

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        step(mixed)(None)  # raises "No available kernel" where a row would need a bias
    warmup, rounds = (1, 3) if ctx.quick else (3, 7)
    times = common.time_alternating(
        {"causal": step(None), "mixed": step(mixed)}, None, ctx.device, warmup=warmup, rounds=rounds
    )
    ratio = common.paired_speedup(times["causal"], times["mixed"])
    numbers = {
        "shape": f"{layers} layers, B={B}, T={T}, {B // 4} bidirectional rows",
        "causal_step_s": statistics.median(times["causal"]),
        "mixed_step_s": statistics.median(times["mixed"]),
        "mixed_over_causal": ratio,
    }
    detail = (
        f"{numbers['shape']}: flash kernel only; mixed / causal step {ratio['median']:.2f}x "
        f"({ratio['min']:.2f}-{ratio['max']:.2f}, {rounds} alternating rounds; target 1.1x on CUDA)"
    )
    return {"detail": detail, **numbers}


# ----------------------------------------------------------------------------- GPT-2 small
def check_mfu(ctx: Context) -> dict:
    from lit_transformer.training.throughput import peak_flops_for

    setup, side, batch, precision = ctx.gpt2()
    warmup, timed = (1, 2) if ctx.quick else (3, 5)
    size, inner = (8192, 10) if ctx.cuda else ((512, 1) if ctx.quick else (1024, 2))
    peak = common.MatmulPeak(ctx.device, size=size, inner=inner, dtype=common.matmul_dtype(precision))
    times = common.time_alternating({"step": side.step, "peak": peak}, batch, ctx.device, warmup=warmup, rounds=timed)
    peak_rate = max(peak.rates)
    del peak  # its three matrices would count in peak_memory's figure
    loss = float(side.step(batch))
    need(math.isfinite(loss), f"non-finite loss {loss}")
    flops = common.spent_flops(setup, batch, head_everywhere=True) / statistics.median(times["step"])
    sheet = peak_flops_for(torch.cuda.get_device_name(), precision) if ctx.cuda else None
    numbers = {
        "config": setup.description,
        "precision": precision,
        "tokens_per_s": setup.tokens / statistics.median(times["step"]),
        "model_flops_per_s": flops,
        "matmul_peak_flops": peak_rate,
        "mfu_measured_peak": flops / peak_rate,
        "datasheet_peak_flops": sheet,
        "mfu_datasheet": flops / sheet if sheet else None,
    }
    need(numbers["mfu_measured_peak"] > 0, "no model FLOPs measured")
    if ctx.cuda:  # on a shared CPU the matmul probe may be slowed more than the steps
        need(numbers["mfu_measured_peak"] < 1, f"MFU {numbers['mfu_measured_peak']:.2f} > 1: FLOPs miscounted")
    mfu = f"{100 * numbers['mfu_measured_peak']:.1f}% of measured peak"
    if sheet:
        mfu += f", {100 * numbers['mfu_datasheet']:.1f}% of datasheet"
    where = "" if ctx.cuda else " (CPU: 2 layers at T=128, not GPT-2 small's 12 at T=1024)"
    return {"detail": f"{setup.description}, {precision}, median of {timed} steps: MFU {mfu}{where}", **numbers}


def check_kv_decoding(ctx: Context) -> dict:
    from lit_transformer.model import LanguageModel, preset
    from lit_transformer.model.generate import generate

    layers, new = (12, 32 if ctx.quick else 128) if ctx.cuda else (2, 8 if ctx.quick else 32)
    cfg = preset("gpt2-small", n_layers=layers, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = LanguageModel.from_config(cfg, device=ctx.device).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, cfg.vocab_size, (2, 16), generator=g).to(ctx.device)
    cached = generate(model, prompt, max_new_tokens=8, eos_token_id=None)
    uncached = generate(model, prompt, max_new_tokens=8, eos_token_id=None, use_cache=False)
    agreement = float((cached == uncached).float().mean())
    need(agreement == 1.0, f"float32 greedy tokens with and without the KV cache differ ({agreement:.2%} agree)")
    numbers = {"layers": layers, "new_tokens": new}
    if ctx.cuda:  # the CUDA-graph step (model/graph_step.py) against the eager step
        numbers |= graph_against_eager(model, prompt)
        for key in ("agreement_float32", "beam_agreement_float32", "agreement_autocast"):
            agree = numbers[f"graph_{key}"]
            need(agree == 1.0, f"{key.replace('_', ' ')} of CUDA-graph and eager tokens: {agree:.2%}")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    model = model.to(dtype)
    numbers["dtype"] = str(dtype).replace("torch.", "")
    for batch in (1, 8):
        prompt = torch.randint(5, cfg.vocab_size, (batch, 16), generator=g).to(ctx.device)
        for graph in (True, False) if ctx.cuda else (False,):
            suffix = "" if graph or not ctx.cuda else "_eager"
            generate(model, prompt, max_new_tokens=4, eos_token_id=None, cuda_graph=graph)  # warm-up
            common.sync(ctx.device)
            start = time.perf_counter()
            out = generate(model, prompt, max_new_tokens=new, eos_token_id=None, cuda_graph=graph)
            common.sync(ctx.device)
            need(out.shape == (batch, 16 + new), f"batch {batch}: output {tuple(out.shape)}")
            numbers[f"tokens_per_s_batch{batch}{suffix}"] = batch * new / (time.perf_counter() - start)
    rates = f"{numbers['tokens_per_s_batch1']:.0f} / {numbers['tokens_per_s_batch8']:.0f} tok/s"
    if ctx.cuda:
        rates += f" (eager {numbers['tokens_per_s_batch1_eager']:.0f} / {numbers['tokens_per_s_batch8_eager']:.0f})"
        rates += f"; graph = eager logits within {numbers['graph_logits_max_diff_float32']:.1e}"
    detail = f"GPT-2 small shape, {layers} layers, {numbers['dtype']}, greedy, {new} tokens: B=1 / B=8 {rates}"
    return {"detail": detail, **numbers}


def graph_against_eager(model, prompt: torch.Tensor) -> dict:
    """Greedy tokens and step logits of the CUDA-graph step against the eager one, float32 and
    bfloat16: the graph replays the fixed-shape step, whose logits the tests compare on CPU."""
    from lit_transformer.model.generate import StepDecoder, generate

    numbers = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        model = model.to(dtype)
        graph, eager = (
            generate(model, prompt, max_new_tokens=24, eos_token_id=None, cuda_graph=g) for g in (True, False)
        )
        numbers[f"graph_agreement_{name}"] = float((graph == eager).float().mean())
        # beam 4, with an eos that row 0's greedy output writes early: beams reorder in place,
        # and rows leave the batch as prompts finish (a new graph at the new shape)
        eos = int(eager[0, prompt.shape[1] + 4])
        beams = [
            generate(model, prompt, max_new_tokens=24, num_beams=4, eos_token_id=eos, length_penalty=0.0, cuda_graph=g)
            for g in (True, False)
        ]
        numbers[f"graph_beam_agreement_{name}"] = float((beams[0] == beams[1]).float().mean())
        with torch.inference_mode():
            steps = [StepDecoder(model, prompt, max_new_tokens=12, cuda_graph=g) for g in (True, False)]
            need(steps[0].graph_step is not None, "the CUDA-graph step was not taken")
            worst = 0.0
            for _ in range(12):
                with_graph, without = (s.next_logits().clone() for s in steps)
                worst = max(worst, float((with_graph - without).abs().max()))
                for s in steps:
                    s.append(without.argmax(-1))
            need(steps[0].graph_step.graph is not None, "no CUDA graph was captured")
        numbers[f"graph_logits_max_diff_{name}"] = worst
    # Graph after graph, with the cycle collector at its most eager, as `evaluate` decodes batch
    # after batch: a graph destroyed during another's capture broke it (graph_step.py).
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for _ in range(20):
            generate(model, prompt, max_new_tokens=12, num_beams=4, eos_token_id=eos, cuda_graph=True)
    finally:
        gc.set_threshold(*threshold)
    model.to(torch.float32)
    # a float32 model under bf16 autocast, as validation decodes inside a bf16-mixed run
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graph, eager = (
            generate(model, prompt, max_new_tokens=24, eos_token_id=None, cuda_graph=g) for g in (True, False)
        )
    numbers["graph_agreement_autocast"] = float((graph == eager).float().mean())
    return numbers


def check_peak_memory(ctx: Context) -> dict:
    if not ctx.cuda:
        return {"status": "skip", "detail": "CPU: torch.cuda.max_memory_allocated exists on CUDA only"}
    from lit_transformer.data.data_config import DataConfig
    from lit_transformer.recipe.schema import TrainerConfig
    from lit_transformer.training.preflight import estimate

    setup, side, batch, precision = ctx.gpt2()
    side.step(batch)  # AdamW's moments exist from the first step on
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    side.step(batch)
    torch.cuda.synchronize()
    # the step's peak above what was there, plus this model's own weights and AdamW moments
    measured = torch.cuda.max_memory_allocated() - before + side.resident_bytes()
    trainer = TrainerConfig(precision=precision, accelerator="gpu")
    predicted = estimate(trainer, DataConfig(batch_size=setup.batch), setup.cfg, setup.seq_len)
    ratio = measured / predicted.per_rank
    numbers = {"measured_bytes": measured, "estimate_bytes": predicted.per_rank, "ratio": ratio}
    numbers |= {"estimate_states": predicted.states, "estimate_activations": predicted.activations}
    detail = f"{setup.description}: measured {measured / 2**30:.2f} GiB / estimate {predicted.per_rank / 2**30:.2f}"
    # above 1.1 the start-up check passes runs that do not fit; far below 1 it refuses ones that do
    need(0.4 <= ratio <= 1.1, f"{detail}: ratio {ratio:.2f} outside [0.4, 1.1]")
    return {"detail": f"{detail} GiB = {ratio:.2f}", **numbers}


# ----------------------------------------------------------------------------- running and reporting
def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def run_check(name: str, ctx: Context) -> dict:
    function = globals()[f"check_{name}"]  # looked up now, so that a test may replace one
    start = time.perf_counter()
    try:
        row = {"status": "pass", **function(ctx)}
    except Exception as error:  # a failing check is a row; the others still run
        row = {"status": "fail", "detail": first_line(error)}
        if not isinstance(error, CheckFailed):
            traceback.print_exc(file=sys.stderr)
    return {"check": name, "status": row.pop("status"), "detail": row.pop("detail", ""), **row} | {
        "seconds": round(time.perf_counter() - start, 2)
    }


def print_table(report: dict, out) -> None:
    print(f"\ngpu_check on {report['device_name']}, torch {report['torch']}{' (--quick)' * report['quick']}", file=out)
    print(f"{'check':<25} {'status':<6} {'seconds':>8}  detail", file=out)
    for row in report["rows"]:
        print(f"{row['check']:<25} {row['status']:<6} {row['seconds']:>8.1f}  {row['detail']}", file=out)
    counts = {s: sum(r["status"] == s for r in report["rows"]) for s in ("pass", "fail", "skip")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()), file=out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda (nothing to check without it)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="every check smaller still (the test suite's CPU run)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    for name in args.checks:
        if name not in CHECKS:
            p.error(f"--checks: unknown check {name!r}; choose from {', '.join(CHECKS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    device = args.device or "cuda"
    report = {
        "device": device,
        "device_name": common.device_name(device),
        "torch": torch.__version__,
        "lightning": importlib.metadata.version("lightning"),
        "quick": args.quick,
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch, token_cache(Path(scratch) / "cache"):
        ctx = Context(device, args.quick, Path(scratch))
        for name in args.checks:
            row = run_check(name, ctx)
            report["rows"].append(row)
            print(f"gpu_check: {name}: {row['status']} ({row['seconds']:.1f} s) {row['detail']}", file=sys.stderr)
            if args.json:  # after every row: a lease that ends mid-run still leaves the rows done
                Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_table(report, sys.stdout)
    return 1 if any(row["status"] == "fail" for row in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
