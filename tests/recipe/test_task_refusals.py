"""A mixture's tasks as the recipe reads them: mntp needs a decoder, row mixing needs tasks of one
shape, a task key of another objective is refused; each a one-line error naming the task."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import RECIPES

from lit_transformer.recipe.load import RecipeError, load_recipe
from lit_transformer.recipe.tasks import data_plan


def refusal(tmp_path: Path, base: str, body: str, *overrides: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(f"extends: {RECIPES / base}.yaml\n{body}\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    return message


@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder"])
def test_mntp_needs_a_decoder(tmp_path, arch):
    tasks = "tasks: [{name: hybrid, objective: mntp}]"
    message = refusal(tmp_path, "tiny-gptbert", f"{tasks}\nmixture: {{mixing: step}}", f"model.arch={arch}")
    assert message.endswith(f"tasks.hybrid.objective=mntp needs model.arch in ['decoder'], got '{arch}'")
    # the shipped hybrid on another architecture names its first task the architecture cannot train
    assert "tasks.clm.objective=clm needs model.arch in ['decoder']" in refusal(
        tmp_path, "tiny-gptbert", "", f"model.arch={arch}"
    )


def test_row_mixing_needs_tasks_of_one_shape(tmp_path):
    span = refusal(
        tmp_path,
        "tiny-span",
        "objective: {name: mixture}\nmixture: {mixing: row}\n"
        "tasks: [{name: denoise, objective: span}, {name: s, objective: prefix_lm}]",
    )
    assert span.endswith(
        "mixture.mixing=row stacks rows of ['clm', 'mlm', 'mntp', 'prefix_lm'] tasks of a decoder; "
        "tasks.denoise.objective=span on model.arch=encoder_decoder has batches of another shape: "
        "use mixture.mixing=step"
    )
    longer = refusal(
        tmp_path,
        "tiny-gptbert",
        "tasks: [{name: a, objective: clm}, {name: b, objective: mntp, data: {block_size: 64}}]",
    )
    assert "tasks.b has (length, batch) (64, 16), tasks.a (128, 16)" in longer
    marked = refusal(
        tmp_path,
        "tiny-gptbert",
        "tasks: [{name: a, objective: clm}, {name: b, objective: mlm, mode_token: '[NLU]'}]",
    )
    assert "tasks.b has (length, batch) (129, 16)" in marked  # a mode token lengthens its rows


def test_a_key_of_another_objective_is_refused(tmp_path):
    assert refusal(tmp_path, "tiny-gptbert", "tasks: [{name: c, objective: clm, max_span_length: 2}]").endswith(
        "tasks.c.max_span_length applies to objective mntp, not clm"
    )
    assert refusal(tmp_path, "tiny-gptbert", "tasks: [{name: m, objective: mntp, mlm_probability: 0.2}]").endswith(
        "tasks.m.mlm_probability applies to objective mlm, not mntp"
    )
    assert refusal(tmp_path, "tiny-gptbert", "tasks: [{name: c, objective: clm, random_replace_prob: 0.2}]").endswith(
        "tasks.c.random_replace_prob applies to objective mlm, mntp, not clm"
    )
    assert "tasks.m.mask_rate_start=1.5 is outside (0, 1)" in refusal(
        tmp_path, "tiny-gptbert", "tasks: [{name: m, objective: mntp, mask_rate_start: 1.5}]"
    )
    assert refusal(tmp_path, "tiny-gptbert", "mixture: {mixing: rows}").endswith(
        "mixture.mixing: Invalid value 'rows', expected one of ['step', 'row'] (did you mean `row`?)"
    )


def test_the_hybrid_recipe_plans_its_schedule(tmp_path):
    cfg = load_recipe(RECIPES / "tiny-gptbert.yaml", ["trainer.max_steps=40"])
    plan = data_plan(cfg)
    clm, mntp = plan.tasks
    assert (clm.pipeline, mntp.pipeline) == ("clm", "clm")  # one token cache for both
    assert (mntp.mask_rate_start, mntp.mask_rate_end, mntp.max_span_length) == (0.30, 0.15, 3)
    assert plan.mixture.mixing == "row" and plan.mixture.max_steps == 40 and plan.mixture.weights == (3.0, 1.0)
    # unset, the rate is the data's mlm_probability all along, and the replacement split the data's
    path = tmp_path / "plain.yaml"
    path.write_text(
        f"extends: {RECIPES / 'tiny-gptbert.yaml'}\ndata: {{mlm_probability: 0.2}}\n"
        "tasks: [{name: m, objective: mntp, mask_replace_prob: 0.5}]\n"
    )
    (task,) = data_plan(load_recipe(path)).tasks
    assert (task.mask_rate_start, task.mask_rate_end, task.data.mask_replace_prob) == (0.2, 0.2, 0.5)
    assert task.data.random_replace_prob == 0.1


@pytest.mark.parametrize(
    ("override", "why"),
    [("model.sliding_window=16", "model.sliding_window is set"), ("model.attention_kind=linear", "attention_kind")],
)
def test_attention_modes_need_full_softmax_attention(tmp_path, override, why):
    """Rows with a bidirectional part cannot ride a sliding window or linear attention: refused
    when the recipe is read, not at the first batch."""
    message = refusal(tmp_path, "tiny-gptbert", "", override)
    assert "tasks.mntp.objective=mntp reads decoder rows with a bidirectional part" in message
    assert why in message
    load_recipe(RECIPES / "tiny-clm.yaml", [override])  # a causal model alone takes either
