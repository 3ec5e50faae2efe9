"""The commands: the command line (`cli.py` only parses and dispatches) and each command's work:
train and prepare, evaluate, generate and export, info, average, and the model loading they share.

May import every layer below; nothing imports it.
"""
