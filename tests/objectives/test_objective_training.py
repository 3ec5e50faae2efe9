"""Each objective overfits a fixed batch (MaskedLM through a real Lightning Trainer, with its
logged metrics, validation and checkpoint), the gradient norm logged before clipping, and the
non-finite guard: a skipped step leaves weights and AdamW state alone, in one process and under
FSDP2 on two."""

from __future__ import annotations

import json
import math
import warnings

import lightning as L
import pytest
import torch
from helpers import B, T, V, clm_batch, fast_optim, mlm_batch, run_two_ranks, seq2seq_batch
from helpers import tiny_objective_config as tiny
from torch.utils.data import DataLoader

from lit_transformer.errors import RunError
from lit_transformer.model.accounting import train_flops
from lit_transformer.objectives import (
    CausalLM,
    MaskedLM,
    MultiTaskLM,
    Seq2SeqLM,
    SequenceClassifier,
    evaluate_batches,
)
from lit_transformer.training.callbacks import NonFiniteGuard


@pytest.fixture(autouse=True)
def _seeded_and_quiet(one_thread):
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")


def manual_fit(module, batch, steps: int, lr: float) -> tuple[float, float]:
    """Plain loop over training_step; returns (first loss, last loss)."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    module.train()
    first = last = None
    for step in range(steps):
        loss = module.training_step(batch, step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        first = float(loss.detach()) if first is None else first
        last = float(loss.detach())
    return first, last


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def repeat(batch, n: int) -> DataLoader:
    return DataLoader([batch] * n, batch_size=None)


# ----------------------------------------------------------------------------- objectives learn


def test_masked_lm_overfits_with_lightning_trainer(tmp_path):
    batch = mlm_batch()
    module = MaskedLM(tiny("encoder", type_vocab_size=2), fast_optim(), max_steps=120, peak_flops=1e12)
    before = evaluate_batches(module, [batch])
    fit = trainer(max_steps=120, log_every_n_steps=10)
    fit.fit(module, train_dataloaders=repeat(batch, 120))
    after = evaluate_batches(module, [batch])
    assert after["loss"] < 0.1 * before["loss"]
    assert after["masked_accuracy"] == 1.0
    metrics = fit.callback_metrics
    for name in (
        "train/loss",
        "train/ppl",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/mfu",
        "train/masked_accuracy",
        "train/skipped_steps",
    ):
        assert name in metrics, name
    assert float(metrics["train/lr"]) == pytest.approx(1e-2)
    # MFU counts the body on every token and the LM head only on the masked positions.
    flops = train_flops(module.model_config, T)
    masked = int((batch["labels"] != -100).sum())
    per_batch = (flops.total - flops.lm_head) * B + flops.lm_head / T * masked
    tokens_per_s, mfu = float(metrics["train/tokens_per_s"]), float(metrics["train/mfu"])
    assert mfu * 1e12 / tokens_per_s == pytest.approx(per_batch / (B * T), rel=1e-4)
    # validation through the Trainer logs what evaluate_batches returns
    logged = fit.validate(module, dataloaders=repeat(batch, 2), verbose=False)[0]
    assert logged["val/loss"] == pytest.approx(after["loss"], rel=1e-5)
    assert logged["val/masked_accuracy"] == 1.0
    # the checkpoint rebuilds the module from its plain hyperparameters
    path = tmp_path / "mlm.ckpt"
    fit.save_checkpoint(path)
    restored = MaskedLM.load_from_checkpoint(path)
    assert restored.model_config == module.model_config
    assert evaluate_batches(restored, [batch])["loss"] == pytest.approx(after["loss"], rel=1e-5)


def test_grad_norm_is_logged_before_clipping():
    batch = mlm_batch()
    module = MaskedLM(tiny("encoder"), fast_optim())
    reference = MaskedLM(tiny("encoder"), fast_optim())
    reference.load_state_dict(module.state_dict())
    loss = reference.training_step(batch, 0)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters() if p.grad is not None]))
    fit = trainer(max_steps=1, log_every_n_steps=1, gradient_clip_val=1e-3)
    fit.fit(module, train_dataloaders=repeat(batch, 1))
    assert float(fit.callback_metrics["train/grad_norm"]) == pytest.approx(float(norm), rel=1e-4)
    assert float(norm) > 1e-2  # far above the clipping threshold


def test_nonfinite_loss_skips_the_step_and_leaves_weights():
    batch = mlm_batch()
    module = MaskedLM(tiny("encoder"), fast_optim(weight_decay=0.1))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    hook = module.model.transformer.register_forward_hook(lambda mod, args, out: out * float("nan"))
    fit = trainer(max_steps=2, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit.fit(module, train_dataloaders=repeat(batch, 2))
    assert module.skipped_steps == 2
    assert float(fit.callback_metrics["train/skipped_steps"]) == 2.0
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    assert all(not state for state in fit.optimizers[0].state.values())  # no AdamW moments either
    hook.remove()
    module.skipped_steps = 0
    fit = trainer(max_steps=1, log_every_n_steps=1)
    fit.fit(module, train_dataloaders=repeat(batch, 1))
    assert module.skipped_steps == 0
    assert not torch.equal(
        module.state_dict()["model.transformer.tokens.weight"], before["model.transformer.tokens.weight"]
    )


def test_nonfinite_guard_stops_on_the_objectives_counter(tmp_path):
    """NonFiniteGuard reads the objective's declared skipped_steps: a streak of `patience` skipped
    steps stops the run, a step that trains in between starts the streak again, and a resumed
    count (on_train_start) is not a streak."""
    module = CausalLM(tiny("decoder"))
    module.skipped_steps = 5  # restored from a checkpoint
    guard = NonFiniteGuard(patience=2, checkpoint_dir=tmp_path)
    fit = type("Fit", (), {"global_step": 9})()
    guard.on_train_start(fit, module)
    for skipped in (6, 6, 7):  # skipped, trained, skipped
        module.skipped_steps = skipped
        guard.on_train_batch_end(fit, module, None, None, 0)
    module.skipped_steps = 8
    with pytest.raises(RunError, match=r"step 9: 2 steps in a row .* no checkpoint was written"):
        guard.on_train_batch_end(fit, module, None, None, 0)
    with pytest.raises(AttributeError, match="skipped_steps"):  # no silent guard on a module without one
        guard.on_train_start(fit, torch.nn.Linear(1, 1))


def test_causal_lm_overfits_and_samples():
    batch = clm_batch()
    module = CausalLM(tiny("decoder", position="rope", norm="rmsnorm", activation="swiglu", bias=False), fast_optim())
    first, last = manual_fit(module, batch, 120, 1e-2)
    assert last < 0.1 * first
    values = evaluate_batches(module, [batch])
    assert values["loss"] < 0.1 * first
    prompt = batch["input_ids"][:1, :3]
    out = module.sample(prompt, torch.ones_like(prompt), max_new_tokens=3)
    assert out.shape == (1, 6)
    torch.testing.assert_close(out[0, 3:], batch["input_ids"][0, 3:6])  # it memorised the continuation


def test_seq2seq_overfits_and_scores_bleu():
    batch = seq2seq_batch(eos=1, pad=0)
    module = Seq2SeqLM(
        tiny("encoder_decoder", n_decoder_layers=1, position="sinusoidal", norm_position="post", activation="relu"),
        fast_optim(),
        bleu=True,
        detokenize=lambda ids: " ".join(map(str, ids)),
        generate_kwargs={"max_new_tokens": 8, "eos_token_id": 1, "pad_token_id": 0, "num_beams": 2},
    )
    before = evaluate_batches(module, [batch])
    assert before["bleu"] < 50
    first, last = manual_fit(module, batch, 250, 1e-2)
    assert last < 0.1 * first
    after = evaluate_batches(module, [batch])
    assert after["token_accuracy"] == 1.0
    assert after["bleu"] == pytest.approx(100.0)  # decoding reproduces every memorised target
    assert set(after) == {"loss", "ppl", "token_accuracy", "bleu"}
    with pytest.raises(ValueError, match="num_beams"):
        Seq2SeqLM(tiny("encoder_decoder"), generate_kwargs={"num_beam": 2})


def _separable(problem: str, n: int = 24):
    """Label from token content: class c puts token 10+c at position 1; multi-label j marks
    the presence of token 20+j; the regression target is the count of token 30."""
    ids = torch.randint(40, V, (n, T))
    mask = torch.ones(n, T, dtype=torch.long)
    mask[::3, 5:] = 0  # some right padding
    ids[mask == 0] = 0
    ids[:, 0] = 2  # [CLS]
    if problem == "single_label":
        labels = torch.arange(n) % 3
        ids[:, 1] = 10 + labels
    elif problem == "multi_label":
        labels = (torch.rand(n, 4) > 0.5).float()
        for j in range(4):
            ids[labels[:, j] == 1, 1 + j] = 20 + j
    else:
        counts = torch.arange(n) % 4
        for row, c in enumerate(counts.tolist()):
            ids[row, 1 : 1 + c] = 30
        labels = counts.float()
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize(
    "problem,arch", [("single_label", "encoder"), ("multi_label", "decoder"), ("regression", "encoder_decoder")]
)
def test_classifier_learns_a_separable_problem(problem, arch):
    batch = _separable(problem)
    num_labels = {"single_label": 3, "multi_label": 4, "regression": 1}[problem]
    module = SequenceClassifier(tiny(arch), num_labels, problem, optim=fast_optim(3e-3), classifier_dropout=0.0)
    manual_fit(module, batch, 100, 3e-3)
    values = evaluate_batches(module, [batch])
    if problem == "single_label":
        assert values["accuracy"] == 1.0 and values["macro_f1"] == 1.0
    elif problem == "multi_label":
        assert values["micro_f1"] == 1.0 and values["macro_f1"] == 1.0
    else:
        assert values["mse"] < 0.05 and values["pearson"] > 0.98
    assert values["loss"] < 0.1


# ----------------------------------------------------------------------------- the objective surface


@pytest.mark.parametrize("cls,metrics", [(CausalLM, ["loss"]), (MaskedLM, ["loss", "masked_accuracy"])])
def test_language_models_share_one_constructor(cls, metrics):
    """CausalLM and MaskedLM take a config or a LanguageModel, save what rebuilds them, and sum
    their own eval metrics."""
    module = cls(tiny("decoder"), fast_optim(), 7, bytes_per_token=2.5, skip_nonfinite=False)
    assert list(module.eval_metrics) == metrics
    assert module.bytes_per_token == 2.5 and module.max_steps == 7 and not module.skip_nonfinite
    assert {"model", "bytes_per_token", "optim", "max_steps", "skip_nonfinite"} <= set(module.hparams)
    rebuilt = cls.from_hparams(dict(module.hparams))
    assert rebuilt.model_config == module.model_config and rebuilt.bytes_per_token == 2.5
    assert rebuilt.optim == module.optim and rebuilt.max_steps == 7 and not rebuilt.skip_nonfinite
    assert cls(module.model).model is module.model  # a LanguageModel trains further, unchanged
    with pytest.raises(TypeError, match="unknown objective option 'skip_nonfinit'"):
        cls(tiny("decoder"), skip_nonfinit=True)


class _Measured:
    """A data module's bytes per token of every split: 3.0 (task 0) and 5.0 (task 1)."""

    def split_bytes_per_token(self, split: str) -> float:
        return 3.0

    def bytes_per_token_of(self, index: int, split: str) -> float:
        return (3.0, 5.0)[index]


def test_bytes_measured_on_puts_the_bytes_per_token_back():
    """Bits per byte of another set divides by that set's bytes per token for the duration of
    the block only, an error inside it included; a mixture's state is each task's."""
    single = CausalLM(tiny("decoder"), bytes_per_token=2.0)
    tasks = [{"name": "c", "objective": "clm"}, {"name": "m", "objective": "mlm"}]
    mixture = MultiTaskLM(tiny("decoder"), tasks, bytes_per_token=[2.0, 4.0])
    assert single.bytes_state() == 2.0 and mixture.bytes_state() == [2.0, None]  # mlm: no bits per byte
    for module, measured in ((single, 3.0), (mixture, [3.0, None])):
        before = module.bytes_state()
        with module.bytes_measured_on(_Measured(), "test"):
            assert module.bytes_state() == measured
        assert module.bytes_state() == before
        with pytest.raises(KeyError), module.bytes_measured_on(_Measured(), "test"):
            raise KeyError("an evaluation that fails")
        assert module.bytes_state() == before
    assert single.lm_eval_metrics(math.log(2) * 2.0)["bpb"] == pytest.approx(1.0)  # 2 bits a token, 2 bytes
    state = mixture.bytes_state()
    state[0] = 9.0  # a copy: changing it changes nothing
    assert mixture.bytes_state() == [2.0, None]


# ----------------------------------------------------------------------------- FSDP2 hook

_FSDP_SCRIPT = r"""
import json, sys, warnings, torch, lightning as L
from torch.utils.data import DataLoader
from lightning.pytorch.strategies import ModelParallelStrategy
from helpers import tiny_objective_config  # tests/ is on the scripts' path (helpers.run_two_ranks)
from lit_transformer.objectives import CausalLM, OptimConfig
warnings.filterwarnings("ignore")
torch.set_num_threads(1)
torch.manual_seed(0)
cfg = tiny_objective_config("decoder")
module = CausalLM(cfg, OptimConfig(lr=1e-2, schedule="constant", warmup_steps=0, weight_decay=0.1))
ids = torch.randint(4, 99, (3, 7)); labels = torch.full((3, 7), -100); labels[:, :-1] = ids[:, 1:]
batch = {"input_ids": ids, "labels": labels}
report = {}

class Probe(L.Callback):
    first = True  # the first batch of the first epoch (a DistributedSampler halves the epoch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first:  # after configure_model: the sharded initial weights
            self.initial = {n: p.full_tensor().clone() for n, p in pl_module.named_parameters()}
            self.hook = pl_module.model.transformer.register_forward_hook(
                lambda m, a, out: out * float("nan") if trainer.global_rank == 1 else out)
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first:
            self.first = False
            self.hook.remove()
            report["unchanged"] = all(torch.equal(p.full_tensor(), self.initial[n])
                                      for n, p in pl_module.named_parameters())
            report["no_moments"] = all(not s for s in trainer.optimizers[0].state.values())

fsdp = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
fit = L.Trainer(accelerator="cpu", devices=2, strategy=fsdp, max_steps=8, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, callbacks=[Probe()])
fit.fit(module, DataLoader([batch] * 16, batch_size=None))
from torch.distributed.tensor import DTensor
report["sharded"] = isinstance(module.model.transformer.decoder.blocks[0].attn.q.weight, DTensor)
report["tied"] = module.model.lm_head.decoder.weight is module.model.transformer.tokens.weight
report["skipped"] = module.skipped_steps
report["loss"] = float(fit.callback_metrics["train/loss"])
with open(f"report_{fit.global_rank}.json", "w") as f:  # the ranks share stdout: one file each
    json.dump(report, f)
"""


@pytest.mark.distributed
def test_fsdp2_two_processes_skip_a_nonfinite_step_together(tmp_path):
    """configure_model shards every block under ModelParallelStrategy (2 gloo processes); a
    NaN on one rank only makes both ranks skip the same step, with weights and AdamW state
    untouched, and training then proceeds. Rank 1 is started by Lightning's own launcher, as in a
    user's `trainer.devices=2` run: the suite's one job that keeps it (the others fork their ranks,
    tests/launcher.py)."""
    script = tmp_path / "fsdp_run.py"
    script.write_text(_FSDP_SCRIPT)
    run_two_ranks(script, [], tmp_path / "cache", tmp_path, timeout=240)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report_{rank}.json").read_text())
        assert report["sharded"] and report["tied"]
        assert report["unchanged"] and report["no_moments"]
        assert report["skipped"] == 1
        assert report["loss"] < 0.75 * math.log(99)  # learning after the skip (chance: ln 99)
