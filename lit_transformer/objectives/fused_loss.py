"""The LM head's last linear layer and the token cross-entropy in one pass over row chunks.

The plain path materialises logits (N, V) in the compute dtype, upcasts them to float32 for
the log-softmax, keeps both for backward, and in backward fills an (N, V) zero gradient for
the NLL and another for the log-softmax: for GPT-2's 50,257-token vocabulary at N = 16 x 1024
that is over 5 GB of tensors, more than the rest of the model's activations. Here each chunk of
`chunk_rows` rows computes its logits in the compute dtype, then, a few rows at a time in
float32, its loss terms and at once the gradient of the loss with respect to those logits,
p - (1 - eps) onehot - eps / V (softmax cross-entropy's gradient, label smoothing as in
F.cross_entropy; with PaLM's z-loss z * lse^2 also + 2 z lse p, lse the log of the softmax
normaliser), written over the logits in place; two matrix products turn that into the
gradients of the features and weight, and the logits are dropped. Backward only scales the
stored gradients. The same idea as Liger-Kernel's FusedLinearCrossEntropy (Hsu et al. 2024), written
with torch operations.

Costs and limits: the gradients are computed in forward, so the objectives call it only when a
backward follows (`ObjectiveBase.fuse_head_and_loss`); the weight must be a plain tensor (under
FSDP2 the LM head's weight is sharded outside the model's forward, so the objectives use plain
logits there).

Shape legend: N rows (tokens), C features, V vocabulary, P the vocabulary padded for the matrix
products (VOCAB_MULTIPLE), R rows in a chunk, r in a piece of it.
"""

from __future__ import annotations

import torch

from lit_transformer.constants import LOSS_CHUNK_ROWS, LOSS_GPU_PIECE_BYTES
from lit_transformer.objectives.metrics import IGNORE_INDEX

# (R, V) logits in the compute dtype: 200 MB in bf16 at V = 50,257; few chunks keep matmuls large
CHUNK_ROWS = LOSS_CHUNK_ROWS
# The float32 work on the logits (log-softmax, exp, mask) runs on pieces of at most this many
# bytes, written back as the gradient into the chunk's own logits buffer. A piece stays in the
# cache, and glibc's malloc serves such a block from memory it keeps, where the (R, V) float32
# copies of a whole chunk (400 MB at GPT-2's vocabulary) came freshly mapped, and page-faulted
# in, on every step (the measurement: docs/defaults.md, "Fused loss").
PIECE_BYTES = 8 << 20
# On a GPU the pieces serve no cache, and 8 MB ones are hundreds of tiny kernels per step, each
# shorter than its launch (GPT-2's loss: 400 pieces of 41 rows per step of 16k tokens, seen in
# `benchmarks/profile_step.py --device cuda`). Pieces of 128 MB are a few per chunk, and their two
# float32 copies stay within the chunk's logits that `training/preflight.py` budgets for.
ACCELERATOR_PIECE_BYTES = LOSS_GPU_PIECE_BYTES
# On CUDA the vocabulary is padded to a multiple of this for the matrix products: at an odd V
# (GPT-2's 50,257) every product with the logits has a leading dimension cuBLAS cannot align,
# and it falls back to slow align-1 kernels (seen in `benchmarks/profile_step.py --device cuda`;
# the same trick as nanoGPT's vocabulary of 50,304). The padded rows of the weight are zero, so
# their logits are exactly 0 and are left out of the softmax; their gradient is never read.
VOCAB_MULTIPLE = {"cuda": 64}  # by device type; 1 (no padding) elsewhere


def _padded(tensor: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype` with zero rows appended up to `rows` (one copy either way)."""
    if rows == tensor.shape[0]:
        return tensor.to(dtype)
    out = tensor.new_zeros((rows, *tensor.shape[1:]), dtype=dtype)
    out[: tensor.shape[0]] = tensor
    return out


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        features,
        weight,
        bias,
        labels,
        label_smoothing: float,
        z_loss: float,
        chunk_rows: int,
        compute_dtype,
        count_correct: bool,
    ):
        x = features.to(compute_dtype)  # (N, C)
        N, V = x.shape[0], weight.shape[0]
        multiple = VOCAB_MULTIPLE.get(x.device.type, 1)
        P = -(-V // multiple) * multiple  # the vocabulary of the matrix products
        w, b = _padded(weight, P, compute_dtype), None if bias is None else _padded(bias, P, compute_dtype)
        piece_bytes = PIECE_BYTES if x.device.type == "cpu" else ACCELERATOR_PIECE_BYTES
        piece_rows = max(1, piece_bytes // (4 * V))
        keep = labels != IGNORE_INDEX  # (N,)
        targets = labels.clamp(min=0)
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_b = b is not None and ctx.needs_input_grad[2]
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = None  # (V, C): the one chunk's product in the compute dtype, or a float32 sum of chunks
        grad_b = torch.zeros(V, dtype=torch.float32, device=w.device) if want_b else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        nll = torch.zeros((), dtype=torch.float32, device=x.device)
        correct = torch.zeros((), dtype=torch.long, device=x.device)
        eps = label_smoothing
        for start in range(0, N, chunk_rows):
            stop = min(start + chunk_rows, N)
            # logits by the kernel the plain head's nn.Linear uses (in the compute dtype); the
            # buffer becomes the chunk's gradient piece by piece below
            logits = torch.nn.functional.linear(x[start:stop], w, b)  # (R, P)
            for lo in range(start, stop, piece_rows):
                rows = slice(lo, min(lo + piece_rows, stop))
                in_chunk = slice(lo - start, rows.stop - start)
                mask = keep[rows, None].float()  # (r, 1)
                # float32: a bf16 log-softmax over a large vocabulary loses the small probabilities
                piece = logits[in_chunk, :V].float()  # (r, V)
                if count_correct:
                    correct += ((piece.argmax(-1) == labels[rows]) & keep[rows]).sum()
                if z_loss:
                    lse = piece.logsumexp(-1, keepdim=True)  # (r, 1): log Z, which the z-loss keeps near 0
                    log_probs = piece - lse  # (r, V)
                    loss += z_loss * (lse.square() * mask).sum()
                else:
                    log_probs = piece.log_softmax(-1)  # (r, V)
                piece_nll = -(log_probs.gather(-1, targets[rows, None]) * mask).sum()
                nll += piece_nll
                loss += (1 - eps) * piece_nll
                if eps:
                    loss -= eps * (log_probs.mean(-1, keepdim=True) * mask).sum()  # mean over V of -log p
                if not (want_x or want_w or want_b):
                    continue
                # d loss / d logits = p (1 + 2 z lse) - (1 - eps) onehot - eps / V, zero on ignored rows
                scale = mask * (1 + 2 * z_loss * lse) if z_loss else mask  # (r, 1)
                grad = log_probs.exp_().mul_(scale)  # (r, V): the (scaled) softmax, zero on ignored rows
                grad.scatter_add_(-1, targets[rows, None], -(1 - eps) * mask)
                if eps:
                    grad.sub_(eps / V * mask)
                if grad_b is not None:
                    grad_b += grad.sum(0)
                logits[in_chunk, :V] = grad  # rounded to the compute dtype; padded columns stay 0
            if not (want_x or want_w):
                continue
            # logits (R, P) now hold d loss / d logits
            if want_x:
                torch.mm(logits, w, out=grad_x[start:stop])  # (R, C)
            if want_w:
                # rounded to the compute dtype per chunk, as autocast's plain backward rounds it once
                part = logits.T @ x[start:stop]  # (P, C)
                if start == 0 and stop == N:  # the only chunk: no float32 sum needed
                    grad_w = part
                elif grad_w is None:
                    grad_w = part.float()
                else:
                    grad_w += part
        grad_w = grad_w[:V] if grad_w is not None else None  # (V, C)
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.dtypes = (features.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(nll, correct)
        return loss, nll, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll, _grad_correct):
        grad_x, grad_w, grad_b = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes

        # scaled in float32: a loss scale of 2**16 (fp16 AMP's first) is not representable in
        # float16; one new tensor each (the stored gradients stay as they are)
        def scaled(grad, dtype):
            return None if grad is None else grad.to(torch.float32, copy=True).mul_(grad_loss).to(dtype)

        return scaled(grad_x, x_dtype), scaled(grad_w, w_dtype), scaled(grad_b, b_dtype), *([None] * 6)


def linear_cross_entropy(
    features: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    z_loss: float = 0.0,
    chunk_rows: int = CHUNK_ROWS,
    count_correct: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """features (N, C), weight (V, C), bias (V,) or None, labels (N,) with IGNORE_INDEX skipped
    -> (loss_sum, nll_sum, count, correct), the same values as `token_cross_entropy` (with the
    same label smoothing and z-loss) on
    `features @ weight.T + bias`, plus the argmax hits (0 without `count_correct`: an extra
    pass over the logits). The logits are computed in the autocast
    dtype when autocast is on (as nn.Linear would), else in the features' dtype."""
    device = features.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else features.dtype
    with torch.autocast(device, enabled=False):
        loss, nll, correct = _LinearCrossEntropy.apply(
            features, weight, bias, labels, label_smoothing, z_loss, chunk_rows, dtype, count_correct
        )
    return loss, nll, (labels != IGNORE_INDEX).sum(), correct
