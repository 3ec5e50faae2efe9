"""Time to quality: a wall-clock budget (trainer.max_time) that ends a run as max_steps would and
that the learning-rate schedule decays over; Muon for the block matrices beside AdamW; PaLM's
z-loss in both training-loss paths. Odd sizes (vocabulary 99, 37 rows) so a transposed axis fails."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import RECIPES, TINY_RUN, StopAt, losses, tiny_config
from lightning.pytorch.callbacks import Callback

from lit_transformer.commands.train import train
from lit_transformer.model.transformer import Block
from lit_transformer.objectives import CausalLM, MaskedLM, Seq2SeqLM
from lit_transformer.objectives import optim as optim_module
from lit_transformer.objectives.fused_loss import linear_cross_entropy
from lit_transformer.objectives.metrics import IGNORE_INDEX, token_cross_entropy
from lit_transformer.objectives.optim import (
    Float32Muon,
    MuonWithAdamW,
    TrainingClock,
    build_optimizer,
    lr_multiplier,
    make_scheduler,
    newton_schulz,
    parameter_groups,
)
from lit_transformer.recipe.load import RecipeError, load_recipe
from lit_transformer.recipe.schema import OptimConfig
from lit_transformer.training.rundir import read_metrics

TINY = [*TINY_RUN, "model.dropout=0.1"]  # dropout on: resuming has random draws to get right


def clm_config(run_dir: Path, *extra: str):
    return load_recipe(RECIPES / "tiny-clm.yaml", [*TINY, f"run.dir={run_dir}", *extra])


# ----------------------------------------------------------------------------- schedules


def lrs(scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def advance(scheduler) -> None:
    scheduler.optimizer.step()  # (no gradient: no update) before the scheduler, as torch expects
    scheduler.step()


def one_parameter_sgd(lr: float = 2.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=lr)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_the_decay_follows_the_time_budget_not_the_step(schedule):
    """With a fake clock: half the budget gives the decay's midpoint, the budget and beyond
    its floor, whatever step the run is at; warmup (in steps) ramps up beneath the decay."""
    optim = OptimConfig(lr=2.0, schedule=schedule, warmup_steps=4, min_lr_ratio=0.1)
    clock = SimpleNamespace(elapsed=0.0)
    scheduler = make_scheduler(one_parameter_sgd(), optim, max_steps=1_000_000, max_time=60.0, clock=clock)
    group = scheduler.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(2.0 * 1 / 4)  # step_num 1 of a 4-step warmup
    advance(scheduler)
    assert group["lr"] == pytest.approx(2.0 * 2 / 4)
    clock.elapsed = 59.0  # warmup's ramp stays beneath a decay that is already nearly done
    advance(scheduler)
    assert group["lr"] == pytest.approx(2.0 * lr_multiplier(2, optim, elapsed=59.0, max_time=60.0))
    assert group["lr"] < 2.0 * 3 / 4
    for _ in range(10):  # past warmup
        advance(scheduler)
    midpoint = 0.1 + 0.9 * 0.5  # cos(pi / 2) = 0 and the linear's half both give the midpoint
    for elapsed, factor in [(0.0, 1.0), (15.0, None), (30.0, midpoint), (60.0, 0.1), (600.0, 0.1)]:
        clock.elapsed = elapsed
        advance(scheduler)
        if factor is None:  # a quarter: cosine's 0.1 + 0.9 * (1 + cos(pi / 4)) / 2, linear's 0.775
            progress_term = 0.5 * (1 + math.cos(math.pi / 4)) if schedule == "cosine" else 0.75
            factor = 0.1 + 0.9 * progress_term
        assert group["lr"] == pytest.approx(2.0 * factor, rel=1e-12), elapsed


def test_constant_and_inverse_sqrt_ignore_the_budget():
    clock = SimpleNamespace(elapsed=1e9)
    for schedule in ("constant", "inverse_sqrt"):
        optim = OptimConfig(schedule=schedule, warmup_steps=5)
        for step in (0, 3, 50):
            assert lr_multiplier(step, optim, d_model=64, elapsed=clock.elapsed, max_time=10.0) == lr_multiplier(
                step, optim, d_model=64
            )


def reference_multiplier(step, optim, max_steps=None, d_model=None):
    """lr_multiplier as it was before time budgets (a verbatim copy): the step-based schedule."""
    s = step + 1
    warmup = optim.warmup_steps
    if optim.schedule == "inverse_sqrt":
        ramp = s * warmup**-1.5 if warmup > 0 else math.inf
        return d_model**-0.5 * min(s**-0.5, ramp)
    if s < warmup:
        return s / warmup
    if optim.schedule == "constant":
        return 1.0
    span = max(max_steps - warmup, 1)
    progress = min(max(s - warmup, 0) / span, 1.0)
    floor = optim.min_lr_ratio
    if optim.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine", "inverse_sqrt"])
@pytest.mark.parametrize("warmup", [0, 7])
def test_without_max_time_the_step_schedule_is_unchanged_bit_for_bit(schedule, warmup):
    optim = OptimConfig(lr=3e-3, schedule=schedule, warmup_steps=warmup, min_lr_ratio=0.05)
    clock = SimpleNamespace(elapsed=123.0)  # ignored without max_time
    got = lrs(make_scheduler(one_parameter_sgd(3e-3), optim, 29, 64, clock=clock), 40)
    reference = torch.optim.lr_scheduler.LambdaLR(
        one_parameter_sgd(3e-3), lambda step: reference_multiplier(step, optim, 29, 64)
    )
    assert got == lrs(reference, 40)  # exactly: the same floats in the same order
    assert len(set(got)) > 2 or (schedule, warmup) == ("constant", 0)


def test_training_clock_counts_only_while_running(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("lit_transformer.objectives.optim.time.perf_counter", lambda: now[0])
    clock = TrainingClock()
    now[0] += 5  # before the first batch: start-up, not training
    clock.start()
    now[0] += 3
    assert clock.read() == 3.0 and clock.elapsed == 0.0  # schedules see only marks
    assert clock.mark() == 3.0 and clock.elapsed == 3.0
    clock.stop()  # validation
    now[0] += 50
    clock.start()
    now[0] += 2
    assert clock.read() == 5.0
    clock.mark(7.5)  # another rank's larger reading
    assert clock.elapsed == 7.5


def test_the_training_time_is_saved_and_restored_with_the_checkpoint():
    optim = OptimConfig(schedule="cosine", warmup_steps=0)
    module = CausalLM(tiny_config(), optim=optim, max_steps=10, max_time=40.0)
    module.train_clock.reset(30.0)
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["train_seconds"] == 30.0
    resumed = CausalLM(tiny_config(), optim=optim, max_steps=10, max_time=40.0)
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.train_clock.elapsed == 30.0
    scheduler = resumed.configure_optimizers()["lr_scheduler"]["scheduler"]
    group = scheduler.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(3e-4 * lr_multiplier(0, optim, elapsed=30.0, max_time=40.0))
    assert group["lr"] < 3e-4 * 0.25  # three quarters of the budget: far down the cosine


class ClockProbe(Callback):
    """The training clock's mark at every batch end and at the end of training."""

    def __init__(self):
        self.marks: list[float] = []
        self.final: float | None = None

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.marks.append(pl_module.train_clock.elapsed)

    def on_train_end(self, trainer, pl_module) -> None:
        self.final = pl_module.train_clock.elapsed


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread", "private_cache")
def test_a_time_budget_ends_the_run_as_a_finished_one(tmp_path):
    """max_time=5 with max_steps=100000: training stops once 5 s of training are spent, then
    validates and saves the final model and metrics.json; the learning rate decays with time."""
    probe = ClockProbe()
    run = tmp_path / "run"
    metrics = train(
        clm_config(
            run,
            "trainer.max_time=5",
            "trainer.max_steps=100000",
            "optim.warmup_steps=3",
            "trainer.val_check_interval=100000",
            "trainer.checkpoint_every_n_steps=100000",
        ),
        callbacks=[probe],
        progress_bar=False,
    )
    steps = len(probe.marks)
    assert 10 < steps < 100000
    assert probe.final >= 5.0 and all(m < 5.0 for m in probe.marks[:-1])  # the last step spent it
    assert (run / "model.safetensors").is_file()
    saved = json.loads((run / "metrics.json").read_text())
    assert "val/loss" in saved and saved["val/loss"] == pytest.approx(metrics["val/loss"])
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert checkpoint["global_step"] == steps and checkpoint["train_seconds"] >= 5.0
    lr = [r["train/lr"] for r in read_metrics(run) if "train/lr" in r]
    peak = 1e-3  # recipes/base/tiny.yaml
    assert lr[:3] == pytest.approx(
        [
            peak / 3,
            2 * peak / 3,
            peak * lr_multiplier(2, OptimConfig(lr=peak, warmup_steps=3), elapsed=probe.marks[1], max_time=5.0),
        ]
    )
    assert all(b <= a for a, b in zip(lr[2:], lr[3:]))  # after warmup: down with the clock
    assert lr[-1] < 0.2 * peak  # near the floor (min_lr_ratio 0.1) at the end of the budget


@pytest.mark.slow
@pytest.mark.usefixtures("private_cache")
def test_the_speedrun_recipe_trains_for_its_budget_and_finishes(tmp_path):
    """recipes/speedrun-clm.yaml as it stands (Muon, QK-norm, ReLU^2, tied head, schedule to
    the budget), on a small slice of the embedded corpus with a 4-second budget."""
    run = tmp_path / "speedrun"
    cfg = load_recipe(
        RECIPES / "speedrun-clm.yaml",
        [
            "tokenizer.vocab_size=400",
            "tokenizer.max_train_bytes=150000",
            "data.max_train_bytes=150000",
            "data.max_val_bytes=20000",
            "data.batch_size=4",
            "trainer.max_time=4",
            "trainer.limit_val_batches=2",
            "trainer.log_every_n_steps=1",
            "logger.wandb.mode=disabled",
            f"run.dir={run}",
        ],
    )
    assert (cfg.optim.optimizer, cfg.model.qk_norm, cfg.model.activation, cfg.model.tie_embeddings) == (
        "muon",
        True,
        "relu2",
        True,
    )
    metrics = train(cfg, progress_bar=False)
    assert math.isfinite(metrics["val/bpb"]) and (run / "model.safetensors").is_file()
    steps = [r["step"] for r in read_metrics(run) if "train/loss" in r]
    assert steps and steps[-1] < cfg.trainer.max_steps  # the budget, not the steps, ended it


# ----------------------------------------------------------------------------- Muon


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_muon_takes_exactly_the_block_matrices(arch):
    extra = dict(position="t5_relative") if arch == "encoder_decoder" else {}
    module = {"decoder": CausalLM, "encoder_decoder": Seq2SeqLM}[arch](
        tiny_config(arch, tie_embeddings=False, **extra), optim=OptimConfig(optimizer="muon"), max_steps=10
    )
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, MuonWithAdamW)
    muon = {id(p) for g in optimizer.muon.param_groups for p in g["params"]}
    adamw = {id(p) for g in optimizer.adamw.param_groups for p in g["params"]}
    expected = {
        id(m.weight)
        for block in module.modules()
        if isinstance(block, Block)
        for m in block.modules()
        if isinstance(m, torch.nn.Linear)
    }
    assert muon == expected and not muon & adamw
    assert muon | adamw == {id(p) for p in module.parameters()}
    names = [n for g in optimizer.muon.param_groups for n in g["names"]]
    assert all(".blocks." in n and n.endswith(".weight") for n in names)
    assert any(".attn.q." in n for n in names) and any(".ffn.down." in n for n in names)
    if arch == "encoder_decoder":
        assert any(".cross_attn.o." in n for n in names)
    others = [n for g in optimizer.adamw.param_groups for n in g["names"]]
    assert any("lm_head" in n for n in others) and any("tokens" in n for n in others)
    assert all(p.dim() == 2 for g in optimizer.muon.param_groups for p in g["params"])
    # param_groups: AdamW's first (train/lr logs the first), then Muon's; one schedule for all
    assert optimizer.param_groups == [*optimizer.adamw.param_groups, *optimizer.muon.param_groups]
    assert optimizer.param_groups[0] is optimizer.adamw.param_groups[0]
    assert {g["lr"] for g in optimizer.muon.param_groups} == {0.02 * lr_multiplier(0, module.optim, 10)}
    assert {g["momentum"] for g in optimizer.muon.param_groups} == {0.95}


def test_float32_muon_is_torchs_muon_with_the_newton_schulz_iteration_in_float32(monkeypatch):
    """On CPUs without bf16 matrix instructions, torch's bf16 Newton-Schulz is emulated: Float32Muon
    runs the same iteration in float32. Its updates equal torch's within bfloat16's error, its
    iteration equals a float64 one within float32's, and the state moves between the two."""
    torch.manual_seed(0)
    shapes = [(37, 24), (24, 53)]  # tall and wide: the iteration runs on the wide orientation
    weights = [torch.randn(*s) for s in shapes]
    params = {name: [torch.nn.Parameter(w.clone()) for w in weights] for name in ("torch", "ours")}
    optimizers = {
        "torch": torch.optim.Muon(params["torch"], lr=0.02, weight_decay=0.01),
        "ours": Float32Muon(params["ours"], lr=0.02, weight_decay=0.01),
    }
    for _ in range(3):
        grads = [torch.randn(*s) for s in shapes]
        for name, optimizer in optimizers.items():
            for p, g in zip(params[name], grads):
                p.grad = g.clone()
            optimizer.step()
    for w, a, b in zip(weights, params["torch"], params["ours"]):
        moved = (a.detach() - w).abs().max()
        assert moved > 0.01 and (a.detach() - b.detach()).abs().max() < 0.05 * moved  # bf16 vs float32
    g = torch.randn(24, 53, dtype=torch.float64)
    exact = newton_schulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.allclose(newton_schulz(g.float(), (3.4445, -4.7750, 2.0315), 5, 1e-7).double(), exact, atol=1e-5)
    singular = torch.linalg.svdvals(exact)
    assert singular.min() > 0.3 and singular.max() < 1.5  # roughly orthogonal, as Muon's quintic leaves it
    # the state of one loads into the other (a checkpoint from a bf16 machine resumes on an AVX2 one)
    optimizers["ours"].load_state_dict(optimizers["torch"].state_dict())
    # which one build_optimizer takes: Float32Muon on a CPU without bf16 matrix instructions
    module = CausalLM(tiny_config(), optim=OptimConfig(optimizer="muon"), max_steps=10)
    for has_bf16, expected in ((True, torch.optim.Muon), (False, Float32Muon)):
        monkeypatch.setattr(optim_module, "cpu_has_bf16_matmul", lambda has_bf16=has_bf16: has_bf16)
        assert type(module.configure_optimizers()["optimizer"].muon) is expected


def test_adamw_alone_is_plain_adamw():
    module = CausalLM(tiny_config(), max_steps=10)
    optimizer = module.configure_optimizers()["optimizer"]
    assert type(optimizer) is torch.optim.AdamW
    assert all("muon" not in g for g in optimizer.param_groups)


def test_the_combined_optimizer_steps_both_and_reloads_exactly():
    """Three steps, a state_dict round trip into a fresh optimizer, three more: the same weights
    as six steps straight (the state of both optimizers travels in one torch state_dict)."""

    def run(split: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = CausalLM(tiny_config(), optim=OptimConfig(optimizer="muon"), max_steps=6)
        ids = torch.randint(0, 99, (3, 7))
        optimizer = build_optimizer(parameter_groups(model, 0.1, muon=True), model.optim)
        for step in range(6):
            if split and step == 3:
                state = optimizer.state_dict()
                optimizer = build_optimizer(parameter_groups(model, 0.1, muon=True), model.optim)
                optimizer.load_state_dict(state)
                assert optimizer.adamw.state is optimizer.state and optimizer.muon.state is optimizer.state
                assert optimizer.muon.param_groups[0] is optimizer.param_groups[-1]

            def closure():
                optimizer.zero_grad()
                loss = model(ids).logsumexp(-1).mean()  # any differentiable loss
                loss.backward()
                return loss

            optimizer.step(closure)
        assert any("momentum_buffer" in optimizer.state[p] for g in optimizer.muon.param_groups for p in g["params"])
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread", "private_cache")
def test_muon_trains_and_resumes_exactly(tmp_path):
    common = [
        "optim.optimizer=muon",
        "trainer.max_steps=8",
        "trainer.val_check_interval=4",
        "trainer.checkpoint_every_n_steps=4",
        "optim.warmup_steps=2",
        "optim.lr=1e-2",
    ]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(clm_config(whole, *common), progress_bar=False)
    train(clm_config(parts, *common), callbacks=[StopAt(4)], progress_bar=False)
    assert not (parts / "model.safetensors").exists()
    train(clm_config(parts, *common, "resume=auto"), progress_bar=False)
    expected, got = losses(whole), losses(parts)
    assert sorted(got) == sorted(expected) == list(range(8))
    for step in range(8):
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    assert (expected[6] + expected[7]) / 2 < expected[0] - 0.2  # it learns (from ln 300 = 5.7)
    assert (whole / "model.safetensors").is_file() and (parts / "model.safetensors").is_file()


def test_muon_refuses_fsdp_shards():
    """Refused when the recipe is read, before anything is prepared or written."""
    with pytest.raises(RecipeError, match=r"optim\.optimizer=muon .*trainer\.strategy") as info:
        load_recipe(RECIPES / "tiny-clm.yaml", ["optim.optimizer=muon", "trainer.strategy=fsdp"])
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- z-loss

N, C, V = 37, 24, 99


def leaves(bias: bool, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, C, generator=g, dtype=dtype) * 0.3).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=dtype) + 2.0).requires_grad_() if bias else None  # log Z away from 0
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = IGNORE_INDEX
    return x, w, b, labels


def naive(x, w, b, labels, eps, z):
    """The definition in float64: (smoothed) cross-entropy + z * log(Z)^2, summed over kept rows."""
    logits = F.linear(x.double(), w.double(), None if b is None else b.double())
    keep = labels != IGNORE_INDEX
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=eps)
    return ce + z * (torch.logsumexp(logits, -1)[keep] ** 2).sum()


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_z_loss_values_and_gradients_match_the_definition(eps, bias, fused, monkeypatch):
    from lit_transformer.objectives import fused_loss

    monkeypatch.setattr(fused_loss, "PIECE_BYTES", 4 * V * 3)  # float32 pieces of 3 rows in chunks of 8
    z = 0.01  # large enough to matter at these sizes (PaLM used 1e-4)
    grads = {}
    for name, fn in [
        ("ref", lambda *a: naive(*a, eps, z)),
        (
            "got",
            (lambda x, w, b, y: linear_cross_entropy(x, w, b, y, eps, z_loss=z, chunk_rows=8)[0])
            if fused
            else (lambda x, w, b, y: token_cross_entropy(F.linear(x, w, b), y, eps, z)[0]),
        ),
    ]:
        x, w, b, labels = leaves(bias)
        loss = fn(x, w, b, labels)
        (2.0 * loss).backward()
        grads[name] = (loss.detach().double(), [t.grad.double() for t in (x, w, b) if t is not None])
    (loss, got), (loss_ref, want) = grads["got"], grads["ref"]
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    without = naive(*leaves(bias), eps, 0.0).detach()
    assert float(loss_ref - without) > 0.03 * float(without)  # the z term is not negligible here


def test_z_loss_leaves_the_nll_alone_and_zero_changes_nothing():
    x, w, b, labels = leaves(True)
    logits = F.linear(x, w, b).detach()
    plain = token_cross_entropy(logits, labels)
    for z in (0.0, 1e-4):
        loss, nll, count = token_cross_entropy(logits, labels, 0.0, z)
        assert torch.equal(nll, plain[1]) and int(count) == int(plain[2])
        assert torch.equal(loss, plain[0]) == (z == 0.0)
    fused = linear_cross_entropy(x, w, b, labels, chunk_rows=8)
    fused_zero = linear_cross_entropy(x, w, b, labels, z_loss=0.0, chunk_rows=8)
    fused_z = linear_cross_entropy(x, w, b, labels, z_loss=1e-4, chunk_rows=8)
    for a, b_ in zip(fused, fused_zero):
        assert torch.equal(a, b_)
    assert torch.equal(fused_z[1], fused[1]) and float(fused_z[0].detach()) > float(fused[0].detach())


def test_the_objectives_add_z_loss_in_training_only(monkeypatch):
    """CausalLM (fused and plain) and MaskedLM: training loss = the mean NLL + z * mean log(Z)^2
    over predicted tokens; validation's loss is the plain NLL."""
    z = 0.05
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 99, (3, 11), generator=g)
    labels = torch.randint(4, 99, (3, 11), generator=g)
    labels[1, 7:] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    for cls, arch in ((CausalLM, "decoder"), (MaskedLM, "encoder")):
        torch.manual_seed(0)
        module = cls(
            tiny_config(arch, dropout=0.0, attention_dropout=0.0), optim=OptimConfig(z_loss=z), skip_nonfinite=False
        )
        with torch.no_grad():
            logits = module.model(ids, batch["attention_mask"])  # (B, T, V)
        keep = labels != IGNORE_INDEX
        nll = F.cross_entropy(logits[keep], labels[keep])
        expected = nll + z * (torch.logsumexp(logits[keep], -1) ** 2).mean()
        for fused in (True, False) if cls is CausalLM else (False,):
            monkeypatch.setattr(cls, "fuse_head_and_loss", lambda self, f=fused: f)
            loss = module.training_step(batch, 0)
            torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
        module.eval_reset()
        with torch.no_grad():
            module.eval_update(batch, 0)
        assert module.eval_compute()["loss"] == pytest.approx(float(nll), rel=1e-5)


# ----------------------------------------------------------------------------- recipe errors


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_time=0", r"trainer\.max_time=0\.0 must be positive or null"),
        ("trainer.max_time=-30", r"trainer\.max_time=-30\.0 must be positive or null"),
        ("optim.optimizer=sgd", r"optim\.optimizer: Invalid value 'sgd'"),
        ("optim.optimizer=Muon", r"optim\.optimizer: .*\(did you mean `muon`\?\)"),
        ("optim.muon_lr=0", r"optim\.muon_lr=0\.0 must be positive"),
        ("optim.muon_momentum=1", r"optim\.muon_momentum=1\.0 is outside \[0, 1\)"),
        ("optim.z_loss=-0.1", r"optim\.z_loss=-0\.1 must not be negative"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(override, message):
    with pytest.raises(RecipeError, match=message) as info:
        load_recipe(RECIPES / "tiny-clm.yaml", [override])
    assert "\n" not in str(info.value)


def test_the_new_keys_have_their_defaults():
    cfg = load_recipe(RECIPES / "tiny-clm.yaml")
    assert cfg.trainer.max_time is None
    assert (cfg.optim.optimizer, cfg.optim.muon_lr, cfg.optim.muon_momentum, cfg.optim.z_loss) == (
        "adamw",
        0.02,
        0.95,
        0.0,
    )
    cfg = load_recipe(RECIPES / "tiny-clm.yaml", ["trainer.max_time=90", "optim.optimizer=muon", "optim.z_loss=1e-4"])
    assert (cfg.trainer.max_time, cfg.optim.optimizer, cfg.optim.z_loss) == (90.0, "muon", 1e-4)
