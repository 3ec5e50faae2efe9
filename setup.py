"""The package list, which pyproject.toml cannot write: the packages found under
lit_transformer/ plus `lit_transformer.recipes`, whose folder is recipes/ at the repository root
(package-dir and package-data in pyproject.toml). The recipes stay where docs, tests and users
name them (`recipes/tiny-clm.yaml`), and a wheel carries them as package data, so that
`lit-transformer pretrain tiny-clm` works outside a checkout (lit_transformer/recipe/catalog.py).
pyproject's `packages.find` sees only folders under lit_transformer/, and a fixed list would
miss the next package someone adds."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["lit_transformer*"]), "lit_transformer.recipes"])
