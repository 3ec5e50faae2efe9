"""Shared pieces of the training benchmark: the three families at a GPT-2-small-class size,
their batches, one training step of ours (through the objectives, as a run trains) and of
transformers' reference model with the same shapes, precision and optimizer, the measured
matrix-product peak, and peak memory.

Shape legend: B batch, T length (decoder length for T5), S encoder (source) length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers models are built from configs, never downloaded

from lit_transformer.model.accounting import train_flops  # noqa: E402
from lit_transformer.model.config import TransformerConfig, preset  # noqa: E402

FAMILIES = ("bert_mlm", "gpt2_clm", "t5_span")
PRECISIONS = ("bf16-mixed", "bf16-true", "32-true")
IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class Setup:
    """One family at one size. `seq_len` is T (BERT, GPT-2) or S (T5); `target_len` is T5's T."""

    family: str
    cfg: TransformerConfig
    batch: int
    seq_len: int
    target_len: int | None = None

    @property
    def description(self) -> str:
        c = self.cfg
        layers = f"{c.n_layers}+{c.decoder_layers} layers" if c.arch == "encoder_decoder" else f"{c.n_layers} layers"
        lengths = f"S={self.seq_len} T={self.target_len}" if self.target_len else f"T={self.seq_len}"
        return f"{layers}, d_model {c.d_model}, vocab {c.vocab_size}, B={self.batch} {lengths}"

    @property
    def tokens(self) -> int:
        """Tokens per step: the sequence (BERT, GPT-2) or the encoder input (T5, as the T5 paper
        and `accounting.train_flops_per_token` count them)."""
        return self.batch * self.seq_len


def make_setup(family: str, *, layers: int, seq_len: int, batch: int) -> Setup:
    """The preset of each family (BERT-base, GPT-2 small, T5-base v1.0) with `layers` layers per
    stack and dropout 0 (the speed of dropout is not what is compared)."""
    no_dropout = {"dropout": 0.0, "attention_dropout": 0.0}
    if family == "bert_mlm":
        cfg = preset("bert-base", n_layers=layers, max_seq_len=max(512, seq_len), **no_dropout)
        return Setup(family, cfg, batch, seq_len)
    if family == "gpt2_clm":
        cfg = preset("gpt2-small", n_layers=layers, max_seq_len=max(1024, seq_len), **no_dropout)
        return Setup(family, cfg, batch, seq_len)
    if family == "t5_span":
        from lit_transformer.data.batches.span import span_lengths

        cfg = preset("t5-base", n_layers=layers, max_seq_len=max(512, seq_len), **no_dropout)
        return Setup(family, cfg, batch, seq_len, span_lengths(seq_len).target_length)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def make_batch(setup: Setup, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A full (unpadded, packed) batch in the collators' format, attention masks included as
    the collators always emit them. MLM: 15% of positions predicted (Devlin et al. 2019)."""
    g = torch.Generator().manual_seed(seed)
    cfg, B, T = setup.cfg, setup.batch, setup.seq_len
    ids = torch.randint(5, cfg.vocab_size, (B, T + 1), generator=g)  # (B, T+1)
    ones = torch.ones(B, T, dtype=torch.long)
    if setup.family == "bert_mlm":
        chosen = torch.rand(B, T, generator=g) < 0.15
        batch = {
            "input_ids": ids[:, :T],
            "attention_mask": ones,
            "labels": torch.where(chosen, ids[:, :T], torch.full_like(ids[:, :T], IGNORE_INDEX)),
        }
    elif setup.family == "gpt2_clm":
        batch = {"input_ids": ids[:, :T], "attention_mask": ones, "labels": ids[:, 1:]}  # labels already shifted
    else:
        Tt = setup.target_len
        labels = torch.randint(5, cfg.vocab_size, (B, Tt), generator=g)  # (B, T)
        decoder_input_ids = torch.cat([torch.zeros(B, 1, dtype=torch.long), labels[:, :-1]], dim=1)
        batch = {
            "input_ids": ids[:, :T],
            "attention_mask": ones,
            "labels": labels,
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": torch.ones(B, Tt, dtype=torch.long),
        }
    return {k: v.to(device) for k, v in batch.items()}


def spent_flops(setup: Setup, batch: dict[str, torch.Tensor], head_everywhere: bool) -> float:
    """Model FLOPs of one training step (`accounting.train_flops`, PaLM's 6N + attention). The
    LM head is counted on the positions it runs on: every position, or for our MLM objective
    only the masked ones (counting skipped work would inflate MFU)."""
    flops = train_flops(setup.cfg, setup.seq_len, setup.target_len)
    outputs = setup.target_len or setup.seq_len
    head_positions = outputs * setup.batch
    if not head_everywhere:
        head_positions = int((batch["labels"] != IGNORE_INDEX).sum())
    return setup.batch * (flops.total - flops.lm_head) + flops.lm_head / outputs * head_positions


# ----------------------------------------------------------------------------- precision, optimizer
def autocast(device: str, precision: str):
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def weight_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16-true" else torch.float32


def matmul_dtype(precision: str) -> torch.dtype:
    """The dtype the steps' matrix products run in (autocast's for bf16-mixed): the matmul peak
    is measured in it, so that MFU compares like with like."""
    return torch.float32 if precision == "32-true" else torch.bfloat16


def bf16_is_native(device: str) -> bool:
    """CUDA, or a CPU with bf16 matrix instructions (AMX, AVX512-BF16). Elsewhere torch emulates
    bf16 matrix products, many times slower than float32, so a bf16 figure would measure the
    emulation. The CPU rule is the recipes' own (run/resolve.py default_precision)."""
    if device.startswith("cuda"):
        return True
    from lit_transformer.run.resolve import default_precision

    return default_precision("bf16-mixed", "cpu") != "32-true"


def choose_precision(device: str, requested: str | None) -> tuple[str, str]:
    """(precision, why) of the training steps: the one asked for, else bf16-mixed where bf16
    is native and 32-true where it is emulated."""
    if requested:
        return requested, f"{requested}: given by --precision"
    if device.startswith("cuda"):
        return "bf16-mixed", "bf16-mixed: a CUDA device"
    if bf16_is_native(device):
        return "bf16-mixed", "bf16-mixed: this CPU has bf16 matrix instructions (AMX or AVX512-BF16)"
    return "32-true", "32-true: this CPU has no bf16 matrix instructions (AMX, AVX512-BF16); bf16 would be emulated"


def make_optimizer(params) -> torch.optim.Optimizer:
    """The same AdamW for both sides: torch's fused kernel, on CPU as on CUDA (transformers'
    Trainer default, `adamw_torch_fused`). On this CPU it is about 8x faster than the for-loop
    implementation (0.18 s against 1.5 s per step for 81M parameters, measured), a cost both
    sides would otherwise pay alike."""
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


# ----------------------------------------------------------------------------- the two sides
@dataclasses.dataclass
class Side:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[dict[str, torch.Tensor]], torch.Tensor]  # forward + backward + AdamW; the loss

    def resident_bytes(self) -> int:
        """Parameters and optimizer state (gradients are freed by zero_grad(set_to_none))."""
        tensors = [p for p in self.module.parameters()]
        tensors += [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _train_step(forward: Callable[[dict], torch.Tensor], optimizer, device: str, precision: str):
    def step(batch):
        with autocast(device, precision):
            loss = forward(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build_ours(setup: Setup, device: str, precision: str, compile: bool = False) -> Side:
    """Our objective (the LightningModule a run trains), used without a Trainer: its
    training_step is the forward and the loss. `compile` is the objective's own option
    (torch.compile per block, applied by configure_model)."""
    from lit_transformer.objectives import CausalLM, MaskedLM, Seq2SeqLM

    torch.manual_seed(0)
    kind = {"bert_mlm": MaskedLM, "gpt2_clm": CausalLM, "t5_span": Seq2SeqLM}[setup.family]
    extra = {"task": "span"} if setup.family == "t5_span" else {}
    # skip_nonfinite=False: the guard costs a host sync that transformers' loop does not pay either.
    module = kind(setup.cfg, skip_nonfinite=False, **extra).to(device=device, dtype=weight_dtype(precision))
    module.train()
    module.compile_blocks = compile  # the constructor's `compile` option (objective_base.py) sets this
    module.configure_model()
    optimizer = make_optimizer(module.parameters())
    return Side(module, optimizer, _train_step(lambda b: module.training_step(b, 0), optimizer, device, precision))


# ----------------------------------------------------------------------------- transformers
def hf_config(cfg: TransformerConfig):
    """transformers' config of the same model, through our export mapping (model/interop/export_maps.py)."""
    import transformers

    from lit_transformer.model.interop.import_maps import family_for_export

    family = family_for_export(cfg)
    values = family.config_to_hf(cfg)
    return transformers.AutoConfig.for_model(family.model_type, **values), family.export_architecture


def build_hf(setup: Setup, device: str, precision: str, compile: bool = False, ours=None) -> Side:
    """transformers' BertForMaskedLM / GPT2LMHeadModel / T5ForConditionalGeneration with the
    equivalent config and its default attention (SDPA for BERT and GPT-2; T5 has only its
    eager one). With `ours` (a LanguageModel) its weights are copied in, so the first losses
    can be compared."""
    import transformers

    config, architecture = hf_config(setup.cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, architecture)(config)
    if ours is not None:
        load_ours_into_hf(ours, model)
    model.to(dtype=weight_dtype(precision)).train()
    forward = torch.compile(model) if compile else model
    optimizer = make_optimizer(model.parameters())
    return Side(
        model, optimizer, _train_step(lambda b: forward(**hf_inputs(setup, b)).loss, optimizer, device, precision)
    )


def hf_inputs(setup: Setup, batch: dict[str, torch.Tensor]) -> dict:
    """transformers' arguments for the same batch. No KV cache is built in training."""
    if setup.family == "gpt2_clm":
        # GPT2LMHeadModel shifts the labels itself: labels = input_ids predicts input_ids[t+1]
        # at t < T-1, the same targets as ours but the last (the same matrix products).
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "labels": batch["input_ids"],
            "use_cache": False,
        }
    if setup.family == "t5_span":
        return {**batch, "use_cache": False}
    return dict(batch)


def load_ours_into_hf(ours, hf_model) -> None:
    """Our weights in transformers' names (interop's export mapping)."""
    from lit_transformer.model.interop.import_maps import family_for_export
    from lit_transformer.model.interop.rules import to_hf

    family = family_for_export(ours.config)
    state = dict(ours.state_dict())
    hf_state = {}
    for rule in family.rules(ours.config, True):
        tensors = [state[name] for name in rule.core]
        for name in rule.written:
            hf_state[name] = to_hf(rule, tensors)
    missing, unexpected = hf_model.load_state_dict(hf_state, strict=False)
    if unexpected:
        raise RuntimeError(f"unexpected transformers keys: {unexpected}")


# ----------------------------------------------------------------------------- measurements
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class MatmulPeak:
    """FLOP/s of a large matrix product (size^3, `inner` products per call, in `dtype`: the
    steps' matmul_dtype) on a device: the hardware peak MFU is relative to. Called between
    training steps, so that it samples the machine under the same background load; `best` is
    the highest rate seen."""

    def __init__(self, device: str, size: int, inner: int, dtype: torch.dtype = torch.bfloat16):
        self.device, self.size, self.inner, self.dtype = device, size, inner, dtype
        self.a = torch.randn(size, size, device=device, dtype=dtype)
        self.b = torch.randn(size, size, device=device, dtype=dtype)
        self.out = torch.empty(size, size, device=device, dtype=dtype)
        torch.mm(self.a, self.b, out=self.out)  # warm-up: kernel selection, allocation
        self.rates: list[float] = []

    def __call__(self, *_) -> None:
        sync(self.device)
        start = time.perf_counter()
        for _ in range(self.inner):
            torch.mm(self.a, self.b, out=self.out)
        sync(self.device)
        self.rates.append(2 * self.size**3 * self.inner / (time.perf_counter() - start))

    @property
    def best(self) -> float:
        return max(self.rates)


def memory_bandwidth(device: str, megabytes: int = 512, repeats: int = 5) -> list[float]:
    """Bytes per second of streaming reads: `x.sum()` over a float32 tensor much larger than any
    CPU's last-level cache, `repeats` times (the best is the figure; the list is returned so
    the spread can be reported)."""
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    x.sum()  # warm-up: page faults, kernel selection
    rates = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        x.sum()
        sync(device)
        rates.append(x.numel() * 4 / (time.perf_counter() - start))
    return rates


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)} ({device})"
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"cpu: {cpu}, {torch.get_num_threads()} threads"


def time_alternating(
    steps: dict[str, Callable], batch, device: str, *, warmup: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per call of each named function, interleaved call by call (A B A B ...) so that
    the machine's background load falls on all of them alike."""
    for _ in range(warmup):
        for fn in steps.values():
            fn(batch)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            sync(device)
            start = time.perf_counter()
            fn(batch)
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def paired_speedup(ours: list[float], theirs: list[float]) -> dict[str, float]:
    """theirs / ours of each round of alternating steps (two adjacent steps share the background
    load), summarised as the median over rounds with the range (min, max) beside it: never
    one side's best step against the other's, which favours whichever side got lucky."""
    if not ours or len(ours) != len(theirs):
        raise ValueError(f"alternating runs pair one step each: {len(ours)} against {len(theirs)}")
    ratios = sorted(t / o for o, t in zip(ours, theirs))
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


class ComparisonError(Exception):
    """The two sides of a comparison do not compute the same thing: no speed figure is valid."""


def check_first_losses(family: str, ours: float, theirs: float, rel: float = 0.02) -> None:
    """Same weights, same batch: the first losses must agree (within `rel`), or the two sides
    are different models and comparing their speed means nothing."""
    if not (math.isfinite(ours) and math.isfinite(theirs)) or abs(ours - theirs) > rel * abs(theirs):
        raise ComparisonError(
            f"{family}: first losses differ (ours {ours:.4f}, transformers {theirs:.4f}, more than {rel:.0%} "
            "apart): the two sides do not compute the same model, so their speeds are not compared"
        )


def peak_memory_subprocess(
    family: str, side: str, setup_args: dict[str, Any], precision: str, steps: int = 2, threads: int | None = None
) -> int:
    """CPU peak memory of one side: a fresh process builds that side alone and runs `steps`
    training steps; the result is its resident-set high-water mark (VmHWM, reset after the
    imports through /proc/self/clear_refs) less its resident set after importing torch and
    transformers. So it counts weights, gradients, AdamW moments and the activation peak,
    like CUDA's max_memory_allocated, plus allocator slack. Not ru_maxrss: Linux carries the
    parent's high-water mark into a forked and exec'd child's ru_maxrss."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import common; "
        f"print(common.memory_child({family!r}, {side!r}, {setup_args!r}, {precision!r}, {steps}, {threads!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_child(
    family: str, side: str, setup_args: dict[str, Any], precision: str, steps: int, threads: int | None = None
) -> int:
    import transformers  # noqa: F401  (both sides pay the import before the baseline)

    import lit_transformer.objectives  # noqa: F401

    if threads:
        torch.set_num_threads(threads)
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    before = _status_kib("VmRSS")
    setup = make_setup(family, **setup_args)
    batch = make_batch(setup, "cpu")
    built = (build_ours if side == "ours" else build_hf)(setup, "cpu", precision)
    for _ in range(steps):
        built.step(batch)
    return (_status_kib("VmHWM") - before) * 1024


def dumps(obj) -> str:
    return json.dumps(obj, indent=2)
