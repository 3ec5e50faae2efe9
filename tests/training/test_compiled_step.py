"""trainer.compile (training/compiled_step.py): the whole training step of clm, mlm and span as
one graph, with no graph break, equal to the eager step in loss and gradients; the scope each
strategy gets; and trainer.float8's refusal where there are no float8 matrix units
(training/float8.py). Per-block compile under FSDP2 on 2 processes: test_fast_paths.py, which
launches its two processes once for checkpointing and compile together.

Odd tiny sizes (batch 3, length 7, vocabulary 99), no dropout (inductor draws its own masks).
"""

from __future__ import annotations

import pytest
import torch
from helpers import optional, tiny_config
from torch._dynamo.utils import counters

from lit_transformer.errors import RecipeError
from lit_transformer.model.transformer import Block
from lit_transformer.objectives import CausalLM, MaskedLM, Seq2SeqLM
from lit_transformer.objectives.metrics import IGNORE_INDEX
from lit_transformer.training import compiled_step
from lit_transformer.training.compiled_step import compile_scope, without_full_masks
from lit_transformer.training.float8 import check_float8, float8_refusal, is_float8_candidate

B, T, V = 3, 7, 99


def batch_for(objective: str) -> dict[str, torch.Tensor]:
    """clm: packed rows (a mask of ones, which the step drops); mlm and span: one padded row."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if objective != "clm":
        mask[1, 5:] = 0
    labels = torch.randint(4, V, (B, T), generator=g).masked_fill(mask == 0, IGNORE_INDEX)
    if objective == "mlm":
        labels[:, ::2] = IGNORE_INDEX  # the head runs at the other positions only (a data-dependent count)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if objective == "span":
        batch["decoder_input_ids"] = torch.randint(4, V, (B, 5), generator=g)
        batch["labels"] = torch.randint(4, V, (B, 5), generator=g)
    return batch


def build(objective: str, **options):
    arch = {"clm": "decoder", "mlm": "encoder", "span": "encoder_decoder"}[objective]
    cfg = tiny_config(
        arch,
        n_layers=1,  # a second layer adds no new kernel, only trace time
        dropout=0.0,
        position="t5_relative" if arch == "encoder_decoder" else "learned",
        lm_head="bert_mlm" if arch == "encoder" else "linear",
    )
    cls = {"clm": CausalLM, "mlm": MaskedLM, "span": Seq2SeqLM}[objective]
    extra = {"task": "span"} if objective == "span" else {}
    torch.manual_seed(0)
    return cls(cfg, skip_nonfinite=False, **extra, **options)


def loss_and_grads(module, batch):
    module.train()
    module.zero_grad(set_to_none=True)
    loss = module.training_step(batch, 0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def dynamo_totals() -> tuple[int, int]:
    """(graph breaks, graphs compiled) so far in this process."""
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize("objective, backend", [("clm", "inductor"), ("mlm", "inductor"), ("span", "aot_eager")])
def test_the_whole_step_is_one_graph_with_the_eager_loss_and_gradients(objective, backend, monkeypatch):
    """The embeddings, every block, the head and the (fused) loss compile into one graph: one
    graph more and no graph break, the blocks not compiled one by one, and the loss and every
    gradient equal to the eager step's. Inductor's C++ compilation of the graph took 15-35 s per
    objective on 2 cores with a cold cache, span's 30-60 s: span runs through inductor end to end
    in the option table's compiled span row (tests/option_pairs.py), and here through aot_eager,
    which captures the same graph and its backward (everything of ours) in a few seconds."""
    if backend != "inductor":
        compile_with = torch.compile
        monkeypatch.setattr(compiled_step, "_GRAPHS", {})
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_with(fn, backend=backend, **kw))
    eager = build(objective)
    compiled = build(objective, compile=True)
    compiled.load_state_dict(eager.state_dict())
    compiled.configure_model()
    assert compiled.compile_scope == "step"
    assert not any(getattr(m, "_compiled_call_impl", None) for m in compiled.modules() if isinstance(m, Block))

    batch = batch_for(objective)
    breaks, graphs = dynamo_totals()
    loss, grads = loss_and_grads(compiled, batch)
    assert dynamo_totals() == (breaks, graphs + 1), dict(counters["graph_break"])
    loss_ref, grads_ref = loss_and_grads(eager, batch)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(eager.parameters()))
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-5, msg=name)
    # the same shapes again: the graph is reused, not compiled a second time
    loss_again, _ = loss_and_grads(compiled, batch)
    assert dynamo_totals() == (breaks, graphs + 1)
    torch.testing.assert_close(loss_again, loss, rtol=0, atol=0)
    # evaluation (no gradients) runs eagerly, and gives the training step's loss
    compiled.eval()
    with torch.no_grad():
        terms = compiled._masked_terms(batch, 0.0) if objective == "mlm" else compiled._terms(batch, 0.0)
    assert dynamo_totals() == (breaks, graphs + 1)
    torch.testing.assert_close(terms[0] / terms[2], loss, rtol=1e-5, atol=1e-5)


def test_the_scope_follows_the_strategy():
    """One graph where nothing wraps the blocks; per block under FSDP2 or activation
    checkpointing, and for objectives whose loss does not go through loss_terms."""
    assert compile_scope(compile=False, activation_checkpointing=False, sharded=False, whole_step=True) is None
    assert compile_scope(compile=True, activation_checkpointing=False, sharded=False, whole_step=True) == "step"
    assert compile_scope(compile=True, activation_checkpointing=True, sharded=False, whole_step=True) == "blocks"
    assert compile_scope(compile=True, activation_checkpointing=False, sharded=True, whole_step=True) == "blocks"
    assert compile_scope(compile=True, activation_checkpointing=False, sharded=False, whole_step=False) == "blocks"
    module = build("clm", compile=True, activation_checkpointing=True)
    module.configure_model()
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    assert module.compile_scope == "blocks" and all(m._compiled_call_impl is not None for m in blocks)


def test_the_recipe_keys_reach_the_objective():
    """trainer.compile and trainer.activation_checkpointing in a recipe become the objective's
    options (ObjectiveBase.from_recipe, as the training command builds it)."""
    from helpers import RECIPES

    from lit_transformer.recipe.load import load_recipe

    keys = ["trainer.compile=true", "trainer.activation_checkpointing=true"]
    for name, cls, arch in (("tiny-clm", CausalLM, "decoder"), ("tiny-mlm", MaskedLM, "encoder")):
        cfg = load_recipe(RECIPES / f"{name}.yaml", keys)
        module = cls(tiny_config(arch), **cls.recipe_options(cfg))
        assert module.compile_blocks and module.activation_checkpointing and module.hparams["compile"]
        module.configure_model()
        assert module.compile_scope == "blocks"


def test_masks_that_mask_nothing_are_dropped_before_the_graph():
    ones, padded = torch.ones(2, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    batch = {"input_ids": torch.zeros(2, 4), "attention_mask": ones, "decoder_attention_mask": padded}
    kept = without_full_masks(batch)
    assert "attention_mask" not in kept and kept["decoder_attention_mask"] is padded
    assert batch["attention_mask"] is ones  # the caller's batch is left as it was
    unpadded = {"input_ids": torch.zeros(2, 4), "attention_mask": padded, "task": 1}
    kept = without_full_masks(unpadded)  # a padded mask stays; a mixture's task index is left out
    assert kept.keys() == {"input_ids", "attention_mask"} and kept["attention_mask"] is padded


def test_float8_is_refused_in_one_line_without_float8_matrix_units(monkeypatch):
    """On this CPU machine: refused by the start-up checks, naming the key. A GPU older than
    compute capability 8.9 is refused with its name and capability."""
    from lit_transformer.recipe.schema import TrainerConfig
    from lit_transformer.training.preflight import check_precision

    with pytest.raises(RecipeError, match=r"^trainer\.float8=true needs an NVIDIA GPU.*this run is on CPU$"):
        check_precision(TrainerConfig(float8=True, accelerator="cpu"))
    check_precision(TrainerConfig(float8=False, accelerator="cpu"))  # off: nothing to refuse
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    reason = float8_refusal("gpu")
    assert reason == (
        "trainer.float8=true needs compute capability 8.9 or newer (H100, H200, L4); NVIDIA A100-SXM4-80GB has 8.0"
    )
    with pytest.raises(RecipeError, match="8.0$"):
        check_float8("auto")


def test_float8_takes_the_blocks_16_aligned_linears_only():
    from lit_transformer.model.language_model import LanguageModel

    model = LanguageModel.from_config(tiny_config("decoder", d_model=32, n_heads=4, d_ff=37))
    in_blocks = {id(m) for b in model.modules() if isinstance(b, Block) for m in b.modules()}
    taken = {id(m) for m in model.modules() if is_float8_candidate(m)}
    # the attention's 32 x 32 projections; not the feed-forward's 32 -> 37 nor the 32 -> 99 head
    widths = {(m.in_features, m.out_features) for m in model.modules() if id(m) in taken}
    assert widths == {(32, 32)} and taken <= in_blocks
    assert not is_float8_candidate(model.lm_head.decoder)


def test_float8_swaps_the_blocks_linears_when_fitting_starts():
    """The callback converts at `setup("fit")` only (evaluate and generate keep plain layers):
    the blocks' 16-aligned nn.Linear become torchao's Float8Linear, the head stays, the parameter
    names stay, and a bf16 step's loss and gradients stay near the plain step's (torchao's float8
    products run emulated on CPU; the run itself refuses CPU, as tested above)."""
    optional("torchao.float8", "dev")
    from lit_transformer.training.float8 import Float8Training

    cfg = tiny_config("decoder", d_model=32, n_heads=4, d_ff=64, dropout=0.0)
    torch.manual_seed(0)
    plain, converted = CausalLM(cfg, skip_nonfinite=False), CausalLM(cfg, skip_nonfinite=False)
    converted.load_state_dict(plain.state_dict())
    callback = Float8Training()
    callback.setup(None, converted, "validate")
    assert callback.converted == 0
    callback.setup(None, converted, "fit")
    assert callback.converted == 12  # 2 layers x (q, k, v, out, up, down)
    kinds = {type(m).__name__ for b in converted.modules() if isinstance(b, Block) for m in b.modules()}
    assert "Float8Linear" in kinds and "Linear" not in kinds
    assert type(converted.model.lm_head.decoder) is torch.nn.Linear
    assert list(converted.state_dict()) == list(plain.state_dict())
    ids = torch.randint(4, V, (3, 16), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    results = []
    for module in (plain, converted):
        with torch.autocast("cpu", torch.bfloat16):
            loss = module.training_step(batch, 0)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in module.named_parameters()}))
    (loss, grads), (loss8, grads8) = results
    torch.testing.assert_close(loss8, loss, rtol=1e-2, atol=0)
    for name, grad in grads.items():  # float8 keeps 3 mantissa bits: close, not equal
        if grad.dim() < 2:  # biases and norms; the key bias's true gradient is 0 (softmax's shift invariance)
            continue
        error = (grads8[name].float() - grad.float()).norm() / grad.float().norm()
        assert error < 0.15, (name, float(error))
