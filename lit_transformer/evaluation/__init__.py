"""Named evaluations (the recipe's `eval` section), run during training and by `evaluate`,
and the batched decoding they and `generate --input` share.

Imports `model/`, `data/`, `recipe/`, `training/`, `objectives/`, `errors`, `lazy`, `machine` and
`constants`.
"""
