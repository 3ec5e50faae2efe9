"""The LM head's last linear layer and the token cross-entropy in one pass over row chunks.

The plain path materialises logits (N, V) in the compute dtype, upcasts them to float32 for
the log-softmax, keeps both for backward, and in backward fills an (N, V) zero gradient for
the NLL and another for the log-softmax: for GPT-2's 50,257-token vocabulary at N = 16 x 1024
that is over 5 GB of tensors, more than the rest of the model's activations. Here each chunk of
`chunk_rows` rows computes its logits, its loss terms and at once the gradient of the loss with
respect to those logits, p - (1 - eps) onehot - eps / V (softmax cross-entropy's gradient,
label smoothing as in F.cross_entropy; with PaLM's z-loss z * lse^2 also + 2 z lse p, lse the
log of the softmax normaliser), turns that into the gradients of the features, weight
and bias with two matrix products, and drops the logits. Backward only scales the stored
gradients. The same idea as Liger-Kernel's FusedLinearCrossEntropy (Hsu et al. 2024), written
with torch operations.

Costs and limits: the gradients are computed in forward, so the objectives call it only when a
backward follows (`ObjectiveBase.fuse_head_and_loss`); the weight must be a plain tensor (under
FSDP2 the LM head's weight is sharded outside the model's forward, so the objectives use plain
logits there).

Shape legend: N rows (tokens), C features, V vocabulary, R rows in a chunk.
"""

from __future__ import annotations

import torch

from .metrics import IGNORE_INDEX

CHUNK_ROWS = 2048  # (R, V) float32 logits: 400 MB at V = 50,257; a few chunks keep matmuls large


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, weight, bias, labels, label_smoothing: float, z_loss: float, chunk_rows: int,
                compute_dtype, count_correct: bool):
        x = features.to(compute_dtype)  # (N, C)
        w = weight.to(compute_dtype)  # (V, C)
        b = bias.to(compute_dtype) if bias is not None else None
        N, V = x.shape[0], w.shape[0]
        keep = labels != IGNORE_INDEX  # (N,)
        targets = labels.clamp(min=0)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        grad_b = (torch.zeros(V, dtype=torch.float32, device=w.device)
                  if b is not None and ctx.needs_input_grad[2] else None)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        nll = torch.zeros((), dtype=torch.float32, device=x.device)
        correct = torch.zeros((), dtype=torch.long, device=x.device)
        eps = label_smoothing
        # Each (R, V) pass over the logits costs about as much as the loss itself, so the chunk
        # makes as few as it can: the log-softmax (with the z-loss a logsumexp and a subtraction
        # instead), a gather, (with smoothing) a mean, the exp
        # and mask into the gradient (no host sync to skip the mask), one scatter.
        for start in range(0, N, chunk_rows):
            rows = slice(start, min(start + chunk_rows, N))
            mask = keep[rows, None].float()  # (R, 1)
            # logits by the kernel the plain head's nn.Linear uses (in the compute dtype), then
            # float32: a bf16 log-softmax over a large vocabulary loses the small probabilities
            logits = torch.nn.functional.linear(x[rows], w, b).float()  # (R, V)
            if count_correct:
                correct += ((logits.argmax(-1) == labels[rows]) & keep[rows]).sum()
            if z_loss:
                lse = logits.logsumexp(-1, keepdim=True)  # (R, 1): log Z, which the z-loss keeps near 0
                log_probs = logits.sub_(lse)  # (R, V)
                loss += z_loss * (lse.square() * mask).sum()
            else:
                log_probs = logits.log_softmax(-1)  # (R, V)
            del logits
            chunk_nll = -(log_probs.gather(-1, targets[rows, None]) * mask).sum()
            nll += chunk_nll
            loss += (1 - eps) * chunk_nll
            if eps:
                loss -= eps * (log_probs.mean(-1, keepdim=True) * mask).sum()  # mean over V of -log p
            if grad_x is None and grad_w is None and grad_b is None:
                continue
            # d loss / d logits = p (1 + 2 z lse) - (1 - eps) onehot - eps / V, zero on ignored rows
            scale = mask * (1 + 2 * z_loss * lse) if z_loss else mask  # (R, 1)
            grad = log_probs.exp_().mul_(scale)  # (R, V): the (scaled) softmax, zero on ignored rows
            grad.scatter_add_(-1, targets[rows, None], -(1 - eps) * mask)
            if eps:
                grad.sub_(eps / V * mask)
            if grad_b is not None:
                grad_b += grad.sum(0)
            grad = grad.to(compute_dtype)
            if grad_x is not None:
                grad_x[rows] = grad @ w  # (R, C)
            if grad_w is not None:
                # rounded to the compute dtype per chunk, as autocast's plain backward rounds it once
                grad_w += grad.T @ x[rows]  # (V, C)
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        ctx.dtypes = (features.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(nll, correct)
        return loss, nll, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_nll, _grad_correct):
        grad_x, grad_w, grad_b = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        scale = grad_loss
        # scaled in float32: a loss scale of 2**16 (fp16 AMP's first) is not representable in float16
        out_x = (grad_x.float() * scale).to(x_dtype) if grad_x is not None else None
        out_w = (grad_w * scale).to(w_dtype) if grad_w is not None else None
        out_b = (grad_b * scale).to(b_dtype) if grad_b is not None else None
        return out_x, out_w, out_b, None, None, None, None, None, None


def linear_cross_entropy(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                         chunk_rows: int = CHUNK_ROWS, count_correct: bool = True
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
        loss, nll, correct = _LinearCrossEntropy.apply(features, weight, bias, labels, label_smoothing, z_loss,
                                                       chunk_rows, dtype, count_correct)
    return loss, nll, (labels != IGNORE_INDEX).sum(), correct
