"""A run from recipe to model: the resolver that turns a recipe into one frozen resolved run
(`resolve.py`), and the model sources a run starts from or a command reads (`loading.py`).

Imports `model/`, `data/`, `recipe/`, `training/`, `objectives/`, `evaluation/`, `errors`, `lazy`,
`machine` and `constants`; only `commands/` imports it.
"""
