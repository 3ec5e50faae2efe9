"""Recipes: the typed schema, reading YAML recipes and overrides, the objective registry, mixtures of tasks.

Imports `model/`, `data/` (their configs and errors) and `errors`; no torch, no Lightning.
"""
