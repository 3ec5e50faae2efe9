"""Muon (Jordan et al. 2024) for the block matrices beside AdamW for the rest: which parameters it
takes, parity with torch's Muon, exact reloads, a run that trains and resumes exactly, and its
refusal of FSDP shards."""

from __future__ import annotations

import pytest
import torch
from helpers import RECIPES, TINY_DROPOUT_RUN, StopAt, losses, tiny_config, tiny_run_config

from lit_transformer.commands.train import train
from lit_transformer.model.transformer import Block
from lit_transformer.objectives import CausalLM, Seq2SeqLM
from lit_transformer.objectives import optim as optim_module
from lit_transformer.objectives.optim import (
    Float32Muon,
    MuonWithAdamW,
    build_optimizer,
    lr_multiplier,
    newton_schulz,
    parameter_groups,
)
from lit_transformer.recipe.load import RecipeError, load_recipe
from lit_transformer.recipe.schema import OptimConfig

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
    train(tiny_run_config(whole, *common, base=TINY_DROPOUT_RUN), progress_bar=False)
    train(tiny_run_config(parts, *common, base=TINY_DROPOUT_RUN), callbacks=[StopAt(4)], progress_bar=False)
    assert not (parts / "model.safetensors").exists()
    train(tiny_run_config(parts, *common, "resume=auto", base=TINY_DROPOUT_RUN), progress_bar=False)
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
