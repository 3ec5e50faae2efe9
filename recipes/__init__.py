"""The shipped recipes as the package `lit_transformer.recipes` (setup.py maps this folder into
the package), so that `importlib.resources` finds them in a wheel and in an editable install
alike; an editable install's import hook maps only folders holding an `__init__.py`."""
