"""The commands: the command line (`cli.py` only parses and dispatches) and each command's work:
train and prepare, evaluate, generate and export, info, average, and the model loading they share.

Imports every layer below (`model/`, `data/`, `recipe/`, `training/`, `objectives/`, `evaluation/`,
`run/`, `errors`, `lazy`, `machine` and `constants`); nothing imports it.
"""
