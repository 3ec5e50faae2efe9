"""Autoregressive generation for decoder-only and encoder-decoder models: greedy, sampling
(temperature, top-k, top-p; the pieces in sampling.py) and beam search, with or without the KV cache.

`StepDecoder` is the model side of the loop (token buffer, cache, next-token logits); the
search functions only choose tokens. Decoder-only prompts are left-padded internally so every
row appends at the same column; positions come from the attention mask, so padding shifts
nothing. Without the cache every step recomputes the full forward: the reference the cache is
tested against (tests/model/test_generate.py). On CPU the linear layers run on oneDNN-packed weights
while decoding where that measured faster than plain F.linear on this machine (packed_linear.py);
`benchmarks/generation.py` measures decoding against transformers' generate.

Shape legend: B prompts, N beams per prompt, R = B*N rows the model sees, T prompt length,
W buffer width (prompt + new tokens), G generated length, V vocabulary, C model width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from lit_transformer.model.graph_step import FixedShapeStep, graph_step_supported
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.model.packed_linear import packed_linears
from lit_transformer.model.sampling import GenerationConfig, filter_logits, left_pad, positions_from_mask, sample_next


class StepDecoder:
    """The model side of the decoding loop: a pre-allocated token buffer (R, W), the optional
    KV cache, and next-token logits. Callers choose tokens, `append` them, and `reorder`
    rows for beam search. Decoder-only: the buffer holds the left-padded prompt then the new
    tokens. Encoder-decoder: the prompt is encoded once; the buffer holds the decoder tokens.
    bidirectional_prompt (decoder-only; an encoder-decoder's encoder already is): the prompt's
    tokens all see each other (prefix LM), the new tokens are causal."""

    def __init__(
        self,
        model: LanguageModel,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int,
        use_cache: bool = True,
        pad_token_id: int = 0,
        decoder_start_token_id: int | None = None,
        expand: int = 1,
        bidirectional_prompt: bool = False,
        cuda_graph: bool = False,
    ):
        """cuda_graph: on a CUDA device, run the single-token steps as a CUDA graph where the
        model allows it (graph_step.py), else as usual."""
        cfg = model.config
        if cfg.arch == "encoder":
            raise ValueError(
                "generation needs a decoder; model.arch='encoder' has none "
                "(a masked-LM encoder fills masks, it does not write left to right)"
            )
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        self.model, self.arch = model, cfg.arch
        device = model.lm_head.decoder.weight.device
        input_ids = input_ids.to(device)
        B, T = input_ids.shape
        mask = (
            torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
        )
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        real = mask.sum(1)
        if (real == 0).any():
            raise ValueError(f"prompt rows {torch.nonzero(real == 0)[:, 0].tolist()} have no real token")
        self.padded = not bool(mask.all())  # no padding: the fused causal kernel, no bias tensor
        self.memory = self.memory_mask = self.mask = self.positions = None
        if cfg.arch == "decoder":
            needed = int(real.max()) + max_new_tokens
            if cfg.position == "learned" and needed > cfg.max_seq_len:
                raise ValueError(
                    f"longest prompt ({int(real.max())}) + max_new_tokens ({max_new_tokens}) = {needed} "
                    f"exceeds model.max_seq_len={cfg.max_seq_len} (learned positions)"
                )
            ids, mask = left_pad(input_ids, mask, pad_token_id)
            width = T + max_new_tokens
            self.ids = torch.full((B, width), pad_token_id, dtype=torch.long, device=device)  # (B, W)
            self.ids[:, :T] = ids
            self.mask = torch.ones(B, width, dtype=torch.bool, device=device)
            self.mask[:, :T] = mask
            prompt_positions = positions_from_mask(mask)  # (B, T)
            new_positions = prompt_positions[:, -1:] + 1 + torch.arange(max_new_tokens, device=device)  # (B, G)
            self.positions = torch.cat((prompt_positions, new_positions), dim=1)  # (B, W)
            self.prompt_length = T
        else:
            if cfg.position == "learned" and 1 + max_new_tokens > cfg.max_seq_len:
                raise ValueError(
                    f"1 + max_new_tokens ({max_new_tokens}) exceeds model.max_seq_len={cfg.max_seq_len} "
                    "(learned decoder positions)"
                )
            # Positions from the mask make the encoder indifferent to the padding side; for
            # right padding they equal the arange used in training.
            self.memory = model.transformer.encode(
                input_ids, mask if self.padded else None, position_ids=positions_from_mask(mask)
            )  # (B, T, C)
            self.memory_mask = mask if self.padded else None
            width = 1 + max_new_tokens
            start = pad_token_id if decoder_start_token_id is None else decoder_start_token_id
            self.ids = torch.full((B, width), pad_token_id, dtype=torch.long, device=device)
            self.ids[:, 0] = start
            self.prompt_length = 1
        if expand > 1:  # beam search: N copies of every row, rows b*N .. b*N+N-1
            for name in ("ids", "mask", "positions", "memory", "memory_mask"):
                value = getattr(self, name)
                if value is not None:
                    setattr(self, name, value.repeat_interleave(expand, dim=0))
        self.length = self.prompt_length
        self._logits: torch.Tensor | None = None  # next_logits' float32 buffer for a 16-bit model
        self.cache = model.transformer.new_cache(B * expand, capacity=width) if use_cache else None
        # The prompt fills buffer columns 0..T-1 (left-padded; the padding stays masked), so a
        # prefix of T in key coordinates is the whole prompt, with or without the cache; every
        # later token sees all of it anyway, so later steps may pass the same prefix.
        self.prefix_lengths = None
        if bidirectional_prompt and cfg.arch == "decoder":
            self.prefix_lengths = torch.full((B * expand,), T, dtype=torch.long, device=device)  # (R,)
        self.graph_step = None
        if cuda_graph and device.type == "cuda" and graph_step_supported(self) is None:
            self.graph_step = FixedShapeStep(self, capture=True)

    @property
    def sequences(self) -> torch.Tensor:
        return self.ids[:, : self.length]  # (R, T + G)

    def next_logits(self) -> torch.Tensor:
        """Float32 logits (R, V) for the token after the current sequences. With the cache only
        the tokens not yet cached go through the model (the prompt first, then one per step).
        For a 16-bit model the tensor is reused by the next call: use it before calling again."""
        start = self.cache.length if self.cache is not None else 0
        if self.graph_step is not None and start > 0 and self.length == start + 1:
            return self.graph_step(self)
        ids = self.ids[:, start : self.length]
        mask = positions = None
        if self.arch == "decoder":
            positions = self.positions[:, start : self.length]
            # With a cache the mask covers only the new tokens (the cache keeps the rest).
            if self.padded and (self.cache is None or start == 0):
                mask = self.mask[:, : self.length]
        hidden = self.model.transformer.decode(
            ids,
            mask,
            memory=self.memory,
            memory_mask=self.memory_mask,
            position_ids=positions,
            cache=self.cache,
            prefix_lengths=self.prefix_lengths,
        )  # (R, t, C)
        logits = self.model.lm_head(hidden[:, -1:])[:, 0]  # only the last position: (R, V)
        if logits.dtype == torch.float32:
            return logits
        # A 16-bit model's logits in float32, in one buffer kept for the whole run: a fresh
        # (R, V) tensor a step costs more in page faults than the conversion itself.
        R = logits.shape[0]
        if self._logits is None or self._logits.shape[0] < R:
            self._logits = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        return self._logits[:R].copy_(logits)

    def append(self, tokens: torch.Tensor) -> None:
        self.ids[:, self.length] = tokens
        self.length += 1

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` (R',) for beam search: each prompt's surviving beams' parents, in
        the prompt's own group of rows, and no rows at all for a prompt that has finished. A
        reorder that keeps every group moves rows only among beams of one prompt, whose
        encoder memory is identical, so memory and the cross-attention cache stay as they are."""
        same_groups = index.numel() == self.ids.shape[0]
        self.ids = self.ids.index_select(0, index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
            self.positions = self.positions.index_select(0, index)
        if not same_groups:
            for name in ("memory", "memory_mask", "prefix_lengths"):
                value = getattr(self, name)
                if value is not None:
                    setattr(self, name, value.index_select(0, index))
        if self.cache is not None:
            self.cache.reorder(index, within_groups=same_groups)
        if self.graph_step is not None and not same_groups:
            # Fewer rows (prompts finished): a step at the new shapes. The cache moved its rows in
            # place while the number stays, so a captured step goes on reading the right memory.
            self.graph_step = FixedShapeStep(self, capture=self.graph_step.capture)


def generate(
    model: LanguageModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    length_normalization: Literal["power", "gnmt"] = "power",
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    decoder_start_token_id: int | None = None,
    use_cache: bool = True,
    bidirectional_prompt: bool = False,
    cuda_graph: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue the prompts input_ids (B, T) (padding marked 0 in attention_mask, either side).

    Decoder-only: returns (B, T + G), the left-padded prompt then the new tokens.
    Encoder-decoder: returns (B, 1 + G), the decoder start token then the new tokens.
    After a row's eos, and for rows shorter than the longest, the rest is pad_token_id.
    temperature, top_k and top_p apply only with do_sample=True. bidirectional_prompt: a
    decoder-only model reads the prompt bidirectionally (a UniLM / prefix-LM model); ignored
    for encoder-decoder models. Runs in eval mode (dropout
    off) and restores the model's mode afterwards. A generator for sampling must live on the
    model's device.
    """
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_beams=num_beams,
        length_penalty=length_penalty,
        length_normalization=length_normalization,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        decoder_start_token_id=decoder_start_token_id,
        use_cache=use_cache,
        bidirectional_prompt=bidirectional_prompt,
        cuda_graph=cuda_graph,
    )
    return generate_with(model, input_ids, attention_mask, config, generator=generator)


@torch.inference_mode()
def generate_with(
    model: LanguageModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    config: GenerationConfig,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`generate` with the options in a GenerationConfig (e.g. built from a recipe)."""
    was_training = model.training
    model.eval()
    try:
        # weights pre-packed for oneDNN while decoding on CPU, where a first measurement at
        # these rows found them faster than plain F.linear on this machine (packed_linear.py)
        with packed_linears(model, rows=input_ids.shape[0] * config.num_beams):
            decoder = StepDecoder(
                model,
                input_ids,
                attention_mask,
                max_new_tokens=config.max_new_tokens,
                use_cache=config.use_cache,
                pad_token_id=config.pad_token_id,
                decoder_start_token_id=config.decoder_start_token_id,
                expand=config.num_beams,
                bidirectional_prompt=config.bidirectional_prompt,
                cuda_graph=config.cuda_graph,
            )
            if config.num_beams > 1:
                return beam_search(decoder, config)
            return _sample_loop(decoder, config, generator)
    finally:
        model.train(was_training)


def _sample_loop(decoder: StepDecoder, config: GenerationConfig, generator: torch.Generator | None):
    """Greedy or sampling: one token per row per step; finished rows emit pad."""
    eos = torch.tensor(config.eos_ids, device=decoder.ids.device) if config.eos_ids else None
    finished = torch.zeros(decoder.ids.shape[0], dtype=torch.bool, device=decoder.ids.device)  # (B,)
    for _ in range(config.max_new_tokens):
        tokens = sample_next(decoder.next_logits(), config, generator)  # (B,)
        if eos is not None:
            tokens = tokens.masked_fill(finished, config.pad_token_id)
            finished |= torch.isin(tokens, eos)
        decoder.append(tokens)
        if eos is not None and bool(finished.all()):  # one host sync per step, as in HF
            break
    return decoder.sequences.clone()


def beam_search(decoder: StepDecoder, config: GenerationConfig) -> torch.Tensor:
    """Beam search over a StepDecoder built with expand=num_beams; the best hypothesis per prompt.

    Follows the HF convention: candidates are the top (1 + #eos) * N continuations of all
    beams; an eos candidate ranked within the top N becomes a finished hypothesis with score
    sum log p / generated_length ** length_penalty (eos counted; with length_normalization="gnmt",
    / ((5 + generated_length) / 6) ** length_penalty); the best N non-eos candidates
    continue. A prompt is done when it holds N finished hypotheses and no running beam can
    still beat the worst of them: with length_penalty > 0 a beam is bounded by its score
    divided by max_new_tokens ** length_penalty, otherwise by its current length (HF's
    early_stopping="never", which is exact rather than heuristic). A finished prompt leaves the
    batch: its rows are dropped from the decoder and the cache, so the model's work per step
    shrinks as prompts finish. tests/model/test_generate.py checks token-for-token parity with
    transformers' generate for GPT-2, LLaMA and T5.
    """
    N, G, lp = config.num_beams, config.max_new_tokens, config.length_penalty

    def norm(n: int) -> float:  # both forms grow with n when lp > 0, so the stopping bound holds
        return ((5 + n) / 6) ** lp if config.length_normalization == "gnmt" else n**lp

    R, device = decoder.ids.shape[0], decoder.ids.device
    B = R // N
    prompt = decoder.ids[::N, : decoder.prompt_length].clone()  # (B, T): identical within a group
    eos = torch.tensor(config.eos_ids, device=device) if config.eos_ids else None
    neg_inf = float("-inf")
    fin_scores = torch.full((B, N), neg_inf, device=device)  # best N finished hypotheses per prompt
    fin_tokens = torch.full((B, N, G), config.pad_token_id, dtype=torch.long, device=device)
    # The A prompts still searching: their ids, running beams' summed log-probabilities and
    # tokens. A prompt that finishes leaves these and the decoder's rows (no more model calls).
    active = torch.arange(B, device=device)  # (A,)
    scores = torch.zeros(B, N, device=device)  # (A, N)
    scores[:, 1:] = neg_inf  # all beams start identical: expand only the first one at step 0
    tokens = fin_tokens.clone()  # (A, N, G)
    is_top = None
    length = 0
    for step in range(G):
        length = step + 1
        A = active.numel()
        logits = decoder.next_logits()  # (A*N, V)
        V = logits.shape[-1]
        n_cand = min((1 + len(config.eos_ids)) * N, N * V)  # enough that N non-eos survive
        # A prompt's best n_cand continuations are among each of its beams' best n_cand tokens
        # (a beam's score adds the same amount to all its tokens), so only those get a
        # log-probability: no (A*N, V) log-softmax or sum is written each step.
        row_best, row_tok = logits.topk(min(n_cand, V), dim=-1)  # (A*N, n)
        logp = row_best - logits.logsumexp(-1, keepdim=True)  # log-softmax of the kept tokens
        n = row_best.shape[-1]
        logp = logp.view(A, N, n) + scores[..., None]  # (A, N, n)
        cand_scores, flat = logp.view(A, N * n).topk(n_cand, dim=-1)  # (A, 2N)
        cand_beam, cand_tok = flat // n, row_tok.view(A, N * n).gather(1, flat)
        cand_tokens = tokens.gather(1, cand_beam[..., None].expand(-1, -1, G)).clone()  # (A, 2N, G)
        cand_tokens[:, :, step] = cand_tok
        running = cand_scores
        if eos is not None:
            is_eos = torch.isin(cand_tok, eos)  # (A, 2N)
            if is_top is None:
                is_top = torch.arange(n_cand, device=device) < N
            new_scores = torch.where(is_eos & is_top, cand_scores / norm(length), neg_inf)
            kept_scores, kept_tokens = _keep_best(fin_scores[active], fin_tokens[active], new_scores, cand_tokens, N)
            fin_scores[active], fin_tokens[active] = kept_scores, kept_tokens
            running = cand_scores.masked_fill(is_eos, neg_inf)
        scores, keep = running.topk(N, dim=-1)  # (A, N), sorted: scores[:, 0] is the best beam
        rows = cand_beam.gather(1, keep) + torch.arange(A, device=device)[:, None] * N  # (A, N): parents' rows
        tokens = cand_tokens.gather(1, keep[..., None].expand(-1, -1, G))  # (A, N, G)
        next_tokens = cand_tok.gather(1, keep)  # (A, N)
        if length == G:
            break
        if eos is not None:
            horizon = G if lp > 0 else length
            full = torch.isfinite(kept_scores).all(1)
            done = full & (scores[:, 0] / norm(horizon) <= kept_scores.min(1).values)  # (A,)
            if bool(done.any()):
                searching = torch.nonzero(~done)[:, 0]  # (A',)
                active, scores, tokens = active[searching], scores[searching], tokens[searching]
                rows, next_tokens = rows[searching], next_tokens[searching]
                if active.numel() == 0:
                    break
        decoder.reorder(rows.view(-1))
        decoder.append(next_tokens.view(-1))
    # Prompts still searching when the budget ran out finish with their running beams.
    if active.numel():
        kept_scores, kept_tokens = _keep_best(fin_scores[active], fin_tokens[active], scores / norm(length), tokens, N)
        fin_scores[active], fin_tokens[active] = kept_scores, kept_tokens
    best = fin_tokens[torch.arange(B, device=device), fin_scores.argmax(1)]  # (B, G), pad after eos
    generated = best[:, :length]
    if eos is not None:  # trim columns where every row is already padding after its eos
        ends = _lengths_after_eos(generated, eos)
        generated = generated[:, : int(ends.max())]
    return torch.cat((prompt, generated), dim=1)


def _keep_best(scores, tokens, new_scores, new_tokens, n: int):
    """Merge (B, n) kept and (B, M) new hypotheses, keep the best n."""
    merged = torch.cat((scores, new_scores), dim=1)  # (B, n + M)
    top, index = merged.topk(n, dim=-1)
    G = tokens.shape[-1]
    kept = torch.cat((tokens, new_tokens), dim=1).gather(1, index[..., None].expand(-1, -1, G))  # (B, n, G)
    return top, kept


def _lengths_after_eos(generated: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Generated length per row counting the first eos, or the full width without one: (B, G) -> (B,)."""
    G = generated.shape[1]
    hit = torch.isin(generated, eos)
    first = torch.where(hit.any(1), hit.float().argmax(1), torch.full_like(hit[:, 0], G - 1, dtype=torch.long))
    return first + 1


__all__ = [
    "GenerationConfig",
    "StepDecoder",
    "beam_search",
    "filter_logits",
    "generate",
    "generate_with",
    "left_pad",
    "positions_from_mask",
    "sample_next",
]
