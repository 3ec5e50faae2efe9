"""Recipes: the typed schema, reading YAML recipes and overrides, the objective registry, mixtures of tasks.

Imports `model/`, `data/` (their configs and errors), `errors`, `lazy` and `constants`; no torch, no
Lightning, and no machine probe (the resolver, run/resolve.py, asks the machine).
"""
