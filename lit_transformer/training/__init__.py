"""Training machinery: the trainer factory, callbacks, DDP/FSDP2, checkpoint formats, run
directories, start-up checks and W&B offline folders.

Imports `model/`, `data/`, `recipe/`, `errors`, `lazy`, `machine` and `constants`; never an objective.
"""
