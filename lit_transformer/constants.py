"""Numbers that torch-free code (the recipe layer, the command line's parser, the start-up
memory estimate) and torch code share: defined once here, where both may import them.
"""

# The fused loss computes the LM head's logits CHUNK_ROWS rows at a time (objectives/fused_loss.py);
# on an accelerator it keeps pieces of at most this many bytes in float32. The start-up memory
# estimate (training/preflight.py) counts one chunk.
LOSS_CHUNK_ROWS = 2048
LOSS_GPU_PIECE_BYTES = 128 << 20

# Batched decoding (evaluation/batch_generate.py; `generate --input` and `evaluate`'s defaults).
# A batch's decode buffer in tokens (rows x (longest prompt + new tokens) x beams). The KV cache
# costs 2 x layers x d_model values per token: 36 KiB in bf16 for a 12-layer, 768-wide model, so
# 8192 tokens hold about 300 MB of cache, and at 64 to 256 tokens a row that is 32 to 128 rows,
# enough to keep each step's matrix products busy where a handful of rows would leave them
# memory-bound.
BATCH_TOKENS = 8192
# Rows at most, whatever the token budget: the per-step logits (rows x beams x vocabulary) are
# not in the token count, and short prompts with a small new-token budget would otherwise make
# thousands of rows.
BATCH_ROWS = 256
