"""Efficient attention (docs/efficient-attention.md): sliding windows, global tokens, document
masks for packed rows, linear attention, and their decoding states, each against an explicit
reference; Mistral parity for the causal window."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import V, optional, seeded_model, tiny_config

from lit_transformer.data.batches.collate import CLMCollator, MLMCollator, document_ids, positions_in_documents
from lit_transformer.data.tokens.tokenizer import SpecialTokens
from lit_transformer.model.attention import RollingKVCache, attend
from lit_transformer.model.config import ConfigError
from lit_transformer.model.generate import generate
from lit_transformer.model.language_model import LanguageModel
from lit_transformer.model.linear_attention import (
    LinearMask,
    causal_chunked,
    causal_recurrent,
    feature_map,
    linear_attention,
)
from lit_transformer.model.masks import chunked_attention, document_bounds, flex_block_mask, interval_mask

POSITIONS = ["rope", "learned", "sinusoidal", "alibi", "t5_relative"]


def same_weights(cfg, reference: LanguageModel) -> LanguageModel:
    other = LanguageModel(cfg)
    other.load_state_dict(reference.state_dict())
    return other.eval()


def banded_reference(T: int, w: int, causal: bool, g: int = 0) -> torch.Tensor:
    """The textbook mask, element by element: (T, T) bool."""
    keep = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            inside = i - w < j <= i if causal else abs(i - j) <= w
            keep[i, j] = inside or i < g or j < g
    return keep


def qkv(B=3, H=3, K=3, T=37, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, H, T, D, generator=g),
        torch.randn(B, K, T, D, generator=g),
        torch.randn(B, K, T, D, generator=g),
    )


def reference_attention(q, k, v, keep, scale):
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = (q @ k.transpose(-2, -1)) * scale
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


# ----------------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
@pytest.mark.parametrize("position", POSITIONS)
def test_a_window_as_long_as_the_sequence_is_full_attention(arch, position):
    cfg = tiny_config(arch, position=position)
    full = seeded_model(cfg)
    windowed = same_weights(cfg.replace(sliding_window=11), full)
    ids = torch.randint(0, V, (3, 11))
    extra = {"decoder_input_ids": ids[:, :7]} if arch == "encoder_decoder" else {}
    torch.testing.assert_close(windowed(ids, **extra), full(ids, **extra), rtol=0, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_a_window_equals_the_explicit_banded_mask(causal, impl):
    arch = "decoder" if causal else "encoder"
    cfg = tiny_config(arch, position="none", attention_impl="math")
    reference = seeded_model(cfg)
    windowed = same_weights(cfg.replace(sliding_window=3, attention_impl=impl), reference)
    ids = torch.randint(0, V, (3, 13))
    keep = banded_reference(13, 3, causal)
    bias = torch.zeros(13, 13).masked_fill(~keep, float("-inf"))
    # the reference model's math path with the textbook mask, layer by layer
    stack = reference.transformer.decoder if causal else reference.transformer.encoder
    x = stack.embed(ids, torch.arange(13).expand(3, 13))
    for block in stack.blocks:
        x = block(x, bias)
    expected = reference.lm_head(stack.final_norm(x))
    torch.testing.assert_close(windowed(ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("global_tokens", [0, 2])
def test_blocked_computation_equals_the_dense_mask(causal, global_tokens):
    """The chunked route (queries by chunks against their key band) gives the dense answer,
    with global tokens and key padding too; GQA (3 heads, 1 kv head) included."""
    q, k, v = qkv(K=1, T=53)
    key_mask = torch.ones(3, 53, dtype=torch.bool)
    key_mask[1, 40:] = False
    mask = interval_mask(
        torch.arange(53), 53, causal=causal, window=5, key_mask=key_mask, global_tokens=0 if causal else global_tokens
    )
    keep = banded_reference(53, 5, causal, 0 if causal else global_tokens) & key_mask[:, None, None, :]
    expected = reference_attention(q, k, v, keep, 0.3)
    got = chunked_attention(q, k, v, mask, scale=0.3, dropout=0.0, size=8)
    seen = keep.any(-1).expand(3, 3, 53)  # (B, H, T): a query whose keys are all padding is meaningless
    torch.testing.assert_close(got[seen], expected[seen], rtol=1e-5, atol=1e-5)
    assert mask.chunks(8)[-1][2] >= 53 - 8 - 5 - 1  # the last chunk reads a band, not every key


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_flex_block_mask_is_the_same_mask():
    """flex_attention's mask (the CUDA route) marks exactly the dense mask's entries; its forward
    runs on CPU too, so the mask function is checked here."""
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        pytest.skip("torch.nn.attention.flex_attention came with torch 2.5 (pyproject allows 2.4)")
    from torch.nn.attention import flex_attention as flex

    q, k, v = qkv(T=40)
    mask = interval_mask(torch.arange(40), 40, causal=False, window=4, global_tokens=2)
    block = flex_block_mask(mask, 3)
    got = flex.flex_attention(q, k, v, block_mask=block, scale=0.25)
    expected = reference_attention(q, k, v, banded_reference(40, 4, False, 2), 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("position", ["rope", "alibi", "t5_relative", "learned"])
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_rolling_cache_generation_equals_recomputation(position, kv_heads):
    cfg = tiny_config(position=position, sliding_window=4, n_kv_heads=kv_heads, max_seq_len=40)
    lm = seeded_model(cfg)
    ids = torch.randint(0, V, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :3] = 0  # a left-padded prompt longer than the window
    cached = generate(lm, ids, mask, max_new_tokens=17)
    recomputed = generate(lm, ids, mask, max_new_tokens=17, use_cache=False)
    assert torch.equal(cached, recomputed)
    cache = lm.transformer.new_cache(3, capacity=26)
    assert isinstance(cache, RollingKVCache) and cache.keys.shape[3] == 4  # w entries, not 26


def test_the_rolling_cache_stays_at_w_entries_while_decoding():
    cfg = tiny_config(sliding_window=5, max_seq_len=64)
    lm = seeded_model(cfg)
    cache = lm.transformer.new_cache(2, capacity=64)
    ids = torch.randint(0, V, (2, 60))
    shape = cache.keys.shape
    with torch.no_grad():
        lm.transformer.decode(ids[:, :8], cache=cache)
        for t in range(8, 60):
            lm.transformer.decode(ids[:, t : t + 1], cache=cache)
            assert cache.keys.shape == shape
    assert shape[3] == 5 and cache.length == 60
    assert sorted(cache.slot_index.tolist()) == list(range(55, 60))


# ----------------------------------------------------------------------------- global tokens


def test_global_tokens_equal_the_explicit_mask():
    cfg = tiny_config("encoder", position="learned", attention_impl="math")
    reference = seeded_model(cfg)
    local = same_weights(cfg.replace(sliding_window=2, global_tokens=3), reference)
    ids = torch.randint(0, V, (3, 15))
    bias = torch.zeros(15, 15).masked_fill(~banded_reference(15, 2, False, 3), float("-inf"))
    stack = reference.transformer.encoder
    x = stack.embed(ids, torch.arange(15).expand(3, 15))
    for block in stack.blocks:
        x = block(x, bias)
    torch.testing.assert_close(local(ids), reference.lm_head(stack.final_norm(x)), rtol=1e-5, atol=1e-5)
    sdpa = same_weights(local.config.replace(attention_impl="sdpa"), reference)
    torch.testing.assert_close(sdpa(ids), local(ids), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- document masks


@pytest.mark.parametrize("arch", ["decoder", "encoder"])
@pytest.mark.parametrize("position", POSITIONS)
def test_every_packed_document_gets_the_logits_it_gets_alone(arch, position):
    cfg = tiny_config(arch, position=position)
    lm = seeded_model(cfg)
    lengths = [4, 7, 1, 5]
    ids = torch.randint(0, V, (2, sum(lengths)))
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).expand(2, -1)
    packed = lm(ids, document_ids=doc)
    start = 0
    for n in lengths:
        alone = lm(ids[:, start : start + n])
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
        start += n


def test_document_masks_combine_with_a_window_and_padding():
    cfg = tiny_config(sliding_window=3)
    lm = seeded_model(cfg)
    ids = torch.randint(0, V, (1, 12))
    doc = torch.tensor([[0] * 5 + [1] * 7])
    mask = torch.ones(1, 12, dtype=torch.long)
    packed = lm(ids, mask, document_ids=doc)
    torch.testing.assert_close(packed[:, 5:], lm(ids[:, 5:]), rtol=1e-5, atol=1e-5)
    start, end = document_bounds(doc)
    assert start.tolist() == [[0] * 5 + [5] * 7] and end.tolist() == [[5] * 5 + [12] * 7]


def test_collators_send_document_ids_and_restarting_positions():
    special = SpecialTokens(pad_id=0, eos_id=2, mask_id=3)
    assert special.separator_id == 2
    block = [5, 6, 2, 7, 8, 9, 2, 10]  # two documents end in the separator 2, a third begins
    clm = CLMCollator(special=special, document_mask=True)([block, block])
    assert clm["document_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert clm["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert "document_ids" not in CLMCollator(special=special)([block])
    mlm = MLMCollator(special=special, vocab_size=20, document_mask=True)([block])
    assert mlm["document_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    assert positions_in_documents(document_ids(torch.tensor([block]), 2)).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]


def test_separators_give_the_token_stores_document_boundaries(tmp_path):
    """The collator's boundaries (after each separator) are the cache's recorded doc_starts."""
    import numpy as np

    from lit_transformer.data.tokens.pack import LMBlocks

    class Entry:
        meta = {"block_len": 6, "stride": 6, "blocks": 3}

        def __init__(self):
            docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15, 16, 17, 18]]
            self.arrays = {
                "tokens": np.concatenate([d + [2] for d in docs]),
                "doc_starts": np.cumsum([0] + [len(d) + 1 for d in docs[:-1]]),
            }

        def __getitem__(self, key):
            return self.arrays[key]

    blocks = LMBlocks(Entry())
    for i in range(len(blocks)):
        ours = document_ids(torch.tensor(blocks[i])[None], 2)[0].numpy()
        stored = blocks.document_ids(i)
        assert (ours == stored - stored[0]).all()


# ----------------------------------------------------------------------------- linear attention


@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_parallel_recurrent_and_explicit_agree(causal):
    q, k, v = qkv(T=29, K=1)
    mask = LinearMask(causal=causal)
    parallel = linear_attention(q, k, v, mask)
    fq, fk = feature_map(q), feature_map(k).repeat_interleave(3, 1)
    vv = v.repeat_interleave(3, 1)
    weights = fq @ fk.transpose(-2, -1)  # (B, H, T, T): the kernel phi(q_i) . phi(k_j), explicitly
    if causal:
        weights = weights.tril()
    explicit = (weights / weights.sum(-1, keepdim=True)) @ vv
    torch.testing.assert_close(parallel, explicit, rtol=1e-5, atol=1e-5)
    if causal:
        torch.testing.assert_close(causal_recurrent(fq, fk, vv), explicit, rtol=1e-5, atol=1e-5)
        chunked, _, _ = causal_chunked(fq, fk, vv, chunk=4)
        torch.testing.assert_close(chunked, explicit, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", ["rope", "learned", "none"])
def test_linear_generation_with_the_recurrent_state_equals_recomputation(position):
    cfg = tiny_config(position=position, attention_kind="linear", n_kv_heads=1, max_seq_len=40)
    lm = seeded_model(cfg)
    ids = torch.randint(0, V, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    cached = generate(lm, ids, mask, max_new_tokens=15)
    assert torch.equal(cached, generate(lm, ids, mask, max_new_tokens=15, use_cache=False))
    state = lm.transformer.new_cache(3)
    assert state.state.shape == (2, 3, 3, 8, 8)  # (L, B, H, D, D) whatever the length


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_linear_decoding_in_bfloat16_under_a_bfloat16_default_dtype(arch):
    """Lightning's bf16-true makes bfloat16 the default dtype around every step: the recurrent
    state must still be float32, the dtype of the features it sums, or the validation's BLEU
    decoding of a bf16-true seq2seq run fails (the option-pairs matrix found it)."""
    lm = seeded_model(tiny_config(arch, position="sinusoidal", attention_kind="linear")).to(torch.bfloat16)
    ids = torch.randint(0, V, (3, 6))
    extra = {"decoder_start_token_id": 0} if arch == "encoder_decoder" else {}
    expected = generate(lm, ids, max_new_tokens=4, **extra)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        assert lm.transformer.new_cache(3).state.dtype == torch.float32
        assert torch.equal(generate(lm, ids, max_new_tokens=4, **extra), expected)
    finally:
        torch.set_default_dtype(default)


def test_a_linear_encoder_ignores_padding():
    cfg = tiny_config("encoder", attention_kind="linear")
    lm = seeded_model(cfg)
    ids = torch.randint(0, V, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 6:] = 0
    torch.testing.assert_close(lm(ids, mask)[:1, :6], lm(ids[:1, :6]), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- Mistral parity


def test_sliding_window_logits_match_mistral():
    transformers = optional("transformers", "dev")
    hf_cfg = transformers.MistralConfig(
        vocab_size=V,
        hidden_size=24,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=5,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(hf_cfg).eval()
    ours = LanguageModel(
        tiny_config(
            position="rope",
            norm="rmsnorm",
            activation="swiglu",
            bias=False,
            tie_embeddings=False,
            n_kv_heads=1,
            head_dim=8,
            max_seq_len=64,
            sliding_window=5,
            rope_base=hf_cfg.rope_parameters["rope_theta"],
        )
    ).eval()
    state = hf.state_dict()
    names = {
        "transformer.tokens.weight": "model.embed_tokens.weight",
        "lm_head.decoder.weight": "lm_head.weight",
        "transformer.decoder.embed.tokens.weight": "model.embed_tokens.weight",  # the same shared module
        "transformer.decoder.final_norm.weight": "model.norm.weight",
    }
    for i in range(2):
        h, c = f"model.layers.{i}", f"transformer.decoder.blocks.{i}"
        names |= {f"{c}.attn.{p}.weight": f"{h}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"{c}.ffn.{p}.weight": f"{h}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        names |= {
            f"{c}.norm1.weight": f"{h}.input_layernorm.weight",
            f"{c}.norm2.weight": f"{h}.post_attention_layernorm.weight",
        }
    ours.load_state_dict({core: state[hf_name] for core, hf_name in names.items()}, strict=True)
    ids = torch.randint(0, V, (3, 19))  # longer than the window
    with torch.no_grad():
        expected = hf(ids).logits
        unwindowed = same_weights(ours.config.replace(sliding_window=None), ours)(ids)
    torch.testing.assert_close(ours(ids), expected, rtol=1e-4, atol=1e-4)
    assert (unwindowed - expected).abs().max() > 1e-3  # the window matters at this length


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        (dict(sliding_window=0), "model.sliding_window"),
        (dict(sliding_window=-3), "model.sliding_window"),
        (dict(global_tokens=2, sliding_window=4), "model.global_tokens"),  # on a decoder
        (dict(arch="encoder", global_tokens=2), "model.global_tokens"),  # without a window
        (dict(attention_kind="linear", position="alibi"), "model.attention_kind"),
        (dict(attention_kind="linear", position="t5_relative"), "model.attention_kind"),
        (dict(attention_kind="linear", sliding_window=4), "model.sliding_window"),
        (dict(attention_kind="softmx"), "model.attention_kind"),
    ],
)
def test_impossible_settings_are_one_line_errors_naming_the_key(changes, key):
    values = dict(changes)
    arch = values.pop("arch", "decoder")
    with pytest.raises(ConfigError) as error:
        tiny_config(arch, **values)
    assert key in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("objective", "extra", "message"),
    [
        ("span", [], "data.document_mask=true applies to objective.name in ['clm', 'mlm']"),
        ("clm", ["model.attention_kind=linear"], "data.document_mask=true needs model.attention_kind='softmax'"),
    ],
)
def test_document_mask_errors_name_the_key(objective, extra, message):
    from pathlib import Path

    from lit_transformer.recipe.load import RecipeError, load_recipe

    recipe = Path(__file__).resolve().parents[2] / "recipes" / f"tiny-{objective}.yaml"
    with pytest.raises(RecipeError) as error:
        load_recipe(recipe, ["data.document_mask=true", *extra])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_attend_math_path_is_the_reference_for_interval_masks():
    q, k, v = qkv(T=11)
    mask = interval_mask(torch.arange(11), 11, causal=True, window=3)
    got = attend(q, k, v, mask.dense_bias(torch.float32), is_causal=False, scale=0.5, dropout=0.0, impl="math")
    torch.testing.assert_close(got, reference_attention(q, k, v, banded_reference(11, 3, True), 0.5))


# ----------------------------------------------------------------------------- recipes

NEW_RECIPES = {
    "tiny-clm-sliding-window": "sliding_window",
    "tiny-clm-linear": "attention_kind",
    "tiny-clm-document-mask": "document_mask",
    "tiny-mlm-longformer": "global_tokens",
}


@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("name", sorted(NEW_RECIPES))
def test_each_efficient_attention_recipe_trains_a_few_steps(name, tmp_path):
    """Each option's recipe runs end to end at test_cli's small sizes (window and global token
    counts shrunk with the blocks, so they still cut the attention)."""
    import json
    import math
    from pathlib import Path

    from helpers import SMALL  # the tiny runs' small sizes (about 3 s a recipe)

    from lit_transformer.commands.cli import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / f"{name}.yaml"
    extra = ["model.sliding_window=8"] if "window" in name or "longformer" in name else []
    assert main(["pretrain", str(recipe), *SMALL, "tokenizer.vocab_size=400", f"run.dir={tmp_path}", *extra]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert math.isfinite(metrics["val/loss"])
    from lit_transformer.model.interop.directories import load_pretrained

    loaded = load_pretrained(tmp_path)  # the run's model loads back with the option on
    option = NEW_RECIPES[name]
    if option == "document_mask":
        assert loaded.config.attention_kind == "softmax"
    else:
        assert getattr(loaded.config, option) not in (None, 0, "softmax")
