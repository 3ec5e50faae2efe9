"""The single-token decoding step at fixed shapes, replayed as a CUDA graph on a GPU.

On a GPU a decoding step of a small model is bound by the host, not the device: a 12-layer
GPT-2 step launches a few hundred small kernels one by one from Python, and the GPU waits for
them (benchmarks/README.md, "Decoding on a GPU"). A CUDA graph records those launches once and
replays them with one call (the approach of gpt-fast and of transformers' static cache).

A graph replays the same kernels on the same memory, so the step must have the same shapes
every time: the KV cache writes the new token at a device index (`KVCache.write_at`) and
attention reads all M slots of the cache, the slots not yet written being masked
(`Stack._self_bias`). The step's inputs (token, position, write index) are copied into
buffers the graph reads before each replay; its logits come out in a buffer the graph owns.

`FixedShapeStep(decoder, capture=False)` runs the same fixed-shape step eagerly, on any
device: the tests check it against the ordinary step on CPU, and the GPU check
(`benchmarks/gpu_check.py`, kv_decoding) checks the captured graph against it.

Shape legend: R rows (prompts times beams), V vocabulary.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Protocol

import torch

from lit_transformer.model.attention import KVCache
from lit_transformer.model.language_model import LanguageModel


class DecoderState(Protocol):
    """What the step reads of generate.StepDecoder (named here: generate.py imports this module)."""

    model: LanguageModel
    cache: KVCache | None
    ids: torch.Tensor  # (R, W) token buffer
    positions: torch.Tensor | None  # (R, W) decoder-only; None: an encoder-decoder's decoder
    memory: torch.Tensor | None
    memory_mask: torch.Tensor | None
    prefix_lengths: torch.Tensor | None
    length: int  # tokens in the buffer


# Eager steps before the capture, on a side stream, as torch.cuda.graphs asks: the first calls
# of cuBLAS and of the caching allocator set up state that must not be recorded.
WARMUP_STEPS = 2


def graph_step_supported(decoder: DecoderState) -> str | None:
    """None when the decoder's steps can run at fixed shapes, else why not (one phrase)."""
    cfg = decoder.model.config
    if cfg.sliding_window is not None or cfg.attention_kind != "softmax":
        return "model.sliding_window or linear attention"
    if type(decoder.cache) is not KVCache:
        return "no KV cache (use_cache=False)"
    if decoder.model.training:
        return "the model is in training mode (dropout)"
    return None


class FixedShapeStep:
    """One new token per row through `decoder`'s model at fixed shapes; see the module doc.
    capture: record the step as a CUDA graph after WARMUP_STEPS eager steps, and replay it."""

    def __init__(self, decoder: DecoderState, *, capture: bool):
        why = graph_step_supported(decoder)
        if why is not None:
            raise ValueError(f"a fixed-shape decoding step needs full softmax attention with a KV cache; {why}")
        if capture and decoder.ids.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {decoder.ids.device}")
        # The decoder is passed to each call, not kept: a step and its decoder in a reference cycle
        # would be freed by the cycle collector at any later moment, and a CUDA graph destroyed
        # while another is being captured breaks that capture (an evaluate run on an H100 died of
        # it). Without the cycle, a finished decoder frees its graph at once.
        self.capture = capture
        R, device = decoder.ids.shape[0], decoder.ids.device
        self.rows = R
        self.ids = torch.zeros(R, 1, dtype=torch.long, device=device)  # (R, 1) the graph's input
        self.positions = torch.zeros(R, 1, dtype=torch.long, device=device)  # (R, 1)
        self.write_at = torch.zeros(1, dtype=torch.long, device=device)  # (1,) the cache slot
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # (R, V) float32, written by every replay
        self.eager_steps = 0
        # An autocast region around generation (validation inside a bf16-mixed run) is kept,
        # with autocast's weight cache off: cached casts made during capture would be freed.
        self.autocast = (
            torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
            if capture and torch.is_autocast_enabled("cuda")
            else contextlib.nullcontext()
        )

    def __call__(self, decoder: DecoderState) -> torch.Tensor:
        """Float32 logits (R, V) for the token after the decoder's sequences; the decoder's cache
        holds everything before its last token. The tensor is overwritten by the next call. The
        decoder is the one the step was made for (a captured graph reads its tensors)."""
        cache = decoder.cache
        start = cache.length
        if decoder.length != start + 1:
            raise ValueError(f"a fixed-shape step takes one new token; {decoder.length - start} are uncached")
        if start >= cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} tokens; {start + 1} requested")
        self.ids.copy_(decoder.ids[:, start : start + 1])
        if decoder.positions is not None:
            self.positions.copy_(decoder.positions[:, start : start + 1])
        else:  # an encoder-decoder's decoder: positions 0, 1, 2, ... as Stack builds them
            self.positions.fill_(start)
        self.write_at.fill_(start)
        cache.write_at = self.write_at
        try:
            if self.graph is not None:
                self.graph.replay()
            elif not self.capture:
                self.logits = self._forward(decoder)
            elif self.eager_steps < WARMUP_STEPS:
                self.eager_steps += 1
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.logits = self._forward(decoder)
                torch.cuda.current_stream().wait_stream(side)
            else:
                self.graph = torch.cuda.CUDAGraph()
                collecting = gc.isenabled()
                gc.disable()  # no other graph (of code beyond ours) may be destroyed mid-capture either
                try:
                    with torch.cuda.graph(self.graph):
                        self.logits = self._forward(decoder)
                finally:
                    if collecting:
                        gc.enable()
                self.graph.replay()  # capturing records the kernels without running them
        finally:
            cache.write_at = None
        cache.length = start + 1
        return self.logits

    def _forward(self, decoder: DecoderState) -> torch.Tensor:
        with self.autocast:
            hidden = decoder.model.transformer.decode(
                self.ids,
                None,
                memory=decoder.memory,
                memory_mask=decoder.memory_mask,
                position_ids=self.positions,
                cache=decoder.cache,
                prefix_lengths=decoder.prefix_lengths,
            )  # (R, 1, C)
            return decoder.model.lm_head(hidden)[:, 0].float()  # (R, V)
