"""Training machinery: the trainer factory, callbacks, DDP/FSDP2, checkpoint formats, run
directories, start-up checks and W&B offline folders.

Imports `model/`, `data/`, `recipe/` and `errors`; never an objective.
"""
