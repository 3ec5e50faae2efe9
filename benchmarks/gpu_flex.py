"""flex_attention against the dense-mask path, for benchmarks/gpu_check.py's flex_attention
check: the masks (sliding window, global tokens with padding, documents with GQA), one attention
call compiled with fullgraph against float32 dense attention, and whole models with compiled
blocks against eager ones.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402, F401  (puts the repository on sys.path)


def flex_masks(B: int, T: int, device: str) -> list[tuple]:
    """(name, IntervalMask, valid queries (B, T) bool, key/value heads) of the three structured
    masks, built as transformer.py builds them."""
    from lit_transformer.model.masks import interval_mask

    q_index = torch.arange(T, device=device)
    sliding = interval_mask(q_index, T, causal=True, window=T // 4)
    padded = torch.ones(B, T, dtype=torch.bool, device=device)
    padded[-1, T - T // 5 :] = False  # the last row ends in padding
    longformer = interval_mask(q_index, T, causal=False, window=T // 8, key_mask=padded, global_tokens=2)
    g = torch.Generator().manual_seed(0)
    starts = torch.rand(B, T, generator=g) < 8 / T  # about 8 documents per row
    starts[:, 0] = True
    documents = interval_mask(q_index, T, causal=True, window=None, document_ids=starts.cumsum(1).to(device))
    everything = torch.ones(B, T, dtype=torch.bool, device=device)
    return [("sliding_window", sliding, everything, 4), ("global+padding", longformer, padded, 4)] + [
        ("documents+gqa", documents, everything, 2)
    ]


def relative_error(x: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None = None) -> float:
    """max |x - ref| / max |ref| over the rows that count (rows broadcasts against x)."""
    x, ref = x.detach().float(), ref.detach().float()
    if rows is not None:
        x, ref = x * rows, ref * rows
    return float((x - ref).abs().max() / ref.abs().max().clamp(min=1e-12))


def flex_kernel_case(mask, valid, kv_heads: int, B: int, T: int, device: str, backward: bool) -> dict[str, float]:
    """Errors of compiled masked_attention (flex) and of the eager dense path in bfloat16,
    against float32 dense attention: {"out": (flex, eager), "dq": ..., ...}."""
    import torch.nn.functional as F

    from lit_transformer.model.masks import flex_block_mask, masked_attention

    H, D = 4, 64
    mask.block_mask = flex_block_mask(mask, B)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, device=device, dtype=torch.bfloat16).requires_grad_(backward)
    k, v = (
        torch.randn(B, kv_heads, T, D, generator=g, device=device, dtype=torch.bfloat16).requires_grad_(backward)
        for _ in range(2)
    )
    rows = valid[:, None, :, None]  # (B, 1, T, 1): padded queries' outputs are never used
    gqa = kv_heads != H

    def attention(q, k, v):
        return masked_attention(q, k, v, mask, scale=D**-0.5, dropout=0.0)

    def reference(q, k, v):
        bias = mask.dense_bias(torch.float32)
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias, enable_gqa=gqa)

    # fullgraph: a graph break would otherwise run the frame eagerly, i.e. the dense path, unseen
    paths = {"flex": torch.compile(attention, fullgraph=True), "eager": attention, "ref": reference}
    grad_out = torch.randn(B, H, T, D, generator=g, device=device) * rows
    results = {}
    for name, fn in paths.items():
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype)) if backward else ()
        results[name] = (out, *grads)
    errors = {}
    for i, part in enumerate(("out", "dq", "dk", "dv")[: len(results["ref"])]):
        masked = rows if part in ("out", "dq") else None
        ref = results["ref"][i]
        errors[part] = tuple(relative_error(results[p][i], ref, masked) for p in ("flex", "eager"))
    return errors


def flex_model_case(name: str, device: str) -> tuple[float, float, float]:
    """A whole model with compiled blocks (Block.compile, flex inside) against eager, both in
    bf16 autocast, errors against float32 eager: (compiled error, eager error, decoy change).
    The decoy: transformer.flex_block_mask made to return the block mask of another (self-only)
    mask; the compiled output must then change, or the blocks did not run flex."""
    import dataclasses

    import lit_transformer.model.transformer as transformer
    from lit_transformer.model import LanguageModel, TransformerConfig

    B, T = 2, 256
    sizes = dict(vocab_size=128, d_model=128, n_heads=4, n_layers=2, d_ff=256, max_seq_len=T, position="rope")
    if name == "decoder":
        cfg = TransformerConfig(arch="decoder", n_kv_heads=2, sliding_window=64, **sizes)
        extra = {"document_ids": (torch.rand(B, T) < 8 / T).cumsum(1).to(device)}
    else:
        cfg = TransformerConfig(arch="encoder", sliding_window=16, global_tokens=2, **sizes)
        mask = torch.ones(B, T, dtype=torch.long, device=device)
        mask[-1, T - 40 :] = 0
        extra = {"attention_mask": mask}
    torch.manual_seed(0)
    model = LanguageModel.from_config(cfg, device=device).eval()
    compiled = copy.deepcopy(model)
    for block in compiled.modules():
        if isinstance(block, transformer.Block):
            block.compile()
    ids = torch.randint(0, 128, (B, T), device=device)
    rows = extra.get("attention_mask", torch.ones(B, T, device=device))[..., None]  # (B, T, 1)
    weights = torch.randn(B, T, 128, device=device) * rows

    def run(m, autocast: bool):
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = m(ids, **extra)  # (B, T, V)
        (logits.float() * weights).sum().backward()
        grads = torch.cat([p.grad.flatten().float() for p in m.parameters() if p.grad is not None])
        return logits.detach().float(), grads

    ref, eager, flex = run(model, False), run(model, True), run(compiled, True)

    def error(x):
        grad_error = float((x[1] - ref[1]).norm() / ref[1].norm())
        return max(relative_error(x[0], ref[0], rows), grad_error)

    original = transformer.flex_block_mask
    transformer.flex_block_mask = lambda m, b: original(dataclasses.replace(m, lo=m.hi - 1, global_tokens=0), b)
    try:
        decoy = run(compiled, True)
    finally:
        transformer.flex_block_mask = original
    return error(flex), error(eager), relative_error(decoy[0], flex[0], rows)
