"""The registry of training objectives: each objective's name, what it needs from the model
and the data, and (once `lit_transformer.objectives` is imported) the LightningModule class
that trains it.

The specs are plain data at the bottom of the package, so that reading a recipe can check
`objective.name` against the model without importing Lightning. Each class registers itself
with `@implements(name)` in its own module under objectives/; code that needs the class (the
commands/train.py, model loading) imports `lit_transformer.objectives`, which imports every built-in
objective, and asks `objective_class(name)`. Adding an objective: a spec here, a module
under objectives/ and its import in objectives/__init__.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from lit_transformer.errors import RecipeError, closest

T = TypeVar("T", bound=type)
# How `generate` and sample generations turn a prompt into model input: a decoder continues the
# text after a document separator; an encoder-decoder transforms a source, or fills the
# sentinel spans of a corrupted text.
PromptStyle = Literal["continue", "transform", "fill_spans"]


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    archs: tuple[str, ...]  # the model.arch values it trains
    data: str  # the data pipeline's kind (collator, token cache), one of data.data_config.OBJECTIVES
    length_keys: tuple[str, ...]  # data keys that bound the sequences the model reads
    # None: the objective does not write text; a dict: the style by model.arch (a mixture)
    prompt: PromptStyle | None | dict[str, PromptStyle]
    lm_head: bool  # trains the language-model head (`export` writes it; classifiers have their own)
    precision: str  # trainer.precision when the recipe leaves it null

    def prompt_for(self, arch: str) -> PromptStyle | None:
        """How a model of this architecture trained with this objective turns a prompt into input."""
        return self.prompt.get(arch) if isinstance(self.prompt, dict) else self.prompt

    def generative(self, arch: str) -> bool:
        """Writes text: `generate`, and sample generations during validation."""
        return self.prompt_for(arch) is not None


SPECS: dict[str, ObjectiveSpec] = {
    spec.name: spec
    for spec in (
        # bf16 autocast (run/resolve.py default_precision keeps float32 on CPUs that would emulate it):
        # the same loss per step as float32 at a higher tokens/s (docs/defaults.md, "Default
        # precision")
        ObjectiveSpec("mlm", ("encoder",), "mlm", ("block_size",), prompt=None, lm_head=True, precision="bf16-mixed"),
        ObjectiveSpec(
            "clm", ("decoder",), "clm", ("block_size",), prompt="continue", lm_head=True, precision="bf16-mixed"
        ),
        # T5 activations overflow float16's range: Raffel et al. 2020 trained in bfloat16, and fp16
        # T5 gives inf/NaN, so span corruption defaults to bf16 autocast
        ObjectiveSpec(
            "span",
            ("encoder_decoder",),
            "span",
            ("block_size",),
            prompt="fill_spans",
            lm_head=True,
            precision="bf16-mixed",
        ),
        # translation: bf16 autocast gave the same validation loss per step as float32 on Tatoeba
        # at a higher tokens/s (docs/defaults.md, "Default precision")
        ObjectiveSpec(
            "seq2seq",
            ("encoder_decoder",),
            "seq2seq",
            ("max_length", "max_target_length"),
            prompt="transform",
            lm_head=True,
            precision="bf16-mixed",
        ),
        ObjectiveSpec(
            "classify",
            ("encoder", "decoder", "encoder_decoder"),
            "classify",
            ("max_length",),
            prompt=None,
            lm_head=False,
            precision="32-true",
        ),
        # a recipe with `tasks:` (recipe/tasks.py): its tasks' data kinds and lengths are checked per task; a
        # decoder continues text, an encoder-decoder transforms a source (UL2's S-denoiser, seq2seq).
        # bf16 autocast as every task objective it mixes: in float32 a mixture ran at 0.67x tiny-clm's
        # tokens/s where the CPU has bf16 matrix units (docs/multitask.md, "Speed")
        ObjectiveSpec(
            "mixture",
            ("encoder", "decoder", "encoder_decoder"),
            "mixture",
            ("block_size",),
            prompt={"decoder": "continue", "encoder_decoder": "transform"},
            lm_head=True,
            precision="bf16-mixed",
        ),
    )
}

MIXTURE = "mixture"  # the objective of a recipe that lists tasks (recipe.load.load_recipe names it)

# How a model directory that records no objective (a transformers checkpoint) is read.
DEFAULT_FOR_ARCH = {"encoder": "mlm", "decoder": "clm", "encoder_decoder": "span"}

_CLASSES: dict[str, type] = {}


def spec(name: str) -> ObjectiveSpec:
    """The spec of `name`; a RecipeError naming the closest objective when there is none."""
    if name not in SPECS:
        raise RecipeError(f"objective.name={name!r} is not one of {list(SPECS)}{closest(name, SPECS)}")
    return SPECS[name]


def implements(*names: str) -> Callable[[T], T]:
    """Class decorator: register the LightningModule that trains the objectives `names`."""
    for name in names:
        spec(name)

    def register(cls: T) -> T:
        for name in names:
            if _CLASSES.get(name, cls) is not cls:
                raise ValueError(f"objective {name!r} is already implemented by {_CLASSES[name].__name__}")
            _CLASSES[name] = cls
        cls.objective_names = names
        return cls

    return register


def objective_class(name: str) -> type:
    """The registered class of `name` (import lit_transformer.objectives first)."""
    spec(name)
    if name not in _CLASSES:
        raise LookupError(f"no class implements objective {name!r}: import lit_transformer.objectives first")
    return _CLASSES[name]
