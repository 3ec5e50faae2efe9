"""lit-transformer's own model directory (save_pretrained, load_pretrained): an exact round trip
for each family, ties kept (also in bfloat16), an interrupted save that leaves nothing, and the
errors of loading any directory: missing paths, unsupported families, missing or unexpected
tensors, an unknown config key."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import padded_interop_batch
from helpers import perturb as _perturb
from helpers import tiny_preset as _tiny
from safetensors.torch import load_file, save_file

from lit_transformer.model import LanguageModel, TransformerConfig
from lit_transformer.model.config import ConfigError
from lit_transformer.model.interop.directories import InteropError, load_pretrained, save_pretrained


@pytest.fixture
def batch():
    return padded_interop_batch()  # right-padded encoder and decoder ids, token types


# ----------------------------------------------------------------------------- native format
NATIVE = {
    "encoder": _tiny("bert-base"),
    "decoder-untied": _tiny("gpt2-small", tie_embeddings=False),
    "llama": _tiny("tinyllama-1.1b"),
    "t5": _tiny("t5-base"),
    "transformer-base": _tiny("transformer-base"),
}


@pytest.mark.parametrize("name", list(NATIVE))
@torch.no_grad()
def test_native_roundtrip(tmp_path, batch, name):
    cfg = NATIVE[name]
    torch.manual_seed(0)
    model = _perturb(LanguageModel.from_config(cfg))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tokenizer.json").write_text("{}")  # other files of a run directory stay
    save_pretrained(model, tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary directory left
    assert (tmp_path / "run" / "tokenizer.json").exists()
    raw = json.loads((tmp_path / "run" / "config.json").read_text())
    assert raw["lit_transformer"] == 1 and TransformerConfig.from_dict(raw["model"]) == cfg
    stored = load_file(tmp_path / "run" / "model.safetensors")
    assert ("lm_head.decoder.weight" in stored) == (not cfg.tie_embeddings)

    loaded = load_pretrained(tmp_path / "run")
    assert loaded.config == cfg
    assert (loaded.lm_head.decoder.weight is loaded.transformer.tokens.weight) == cfg.tie_embeddings
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    kwargs = {}
    if cfg.arch == "encoder_decoder":
        kwargs = dict(decoder_input_ids=batch["dec"], decoder_attention_mask=batch["dec_mask"])
    assert torch.equal(loaded(batch["ids"], batch["mask"], **kwargs), model(batch["ids"], batch["mask"], **kwargs))


def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    import lit_transformer.model.interop.directories as interop

    def crash(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(interop, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(LanguageModel(NATIVE["encoder"]), tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_native_bfloat16_keeps_ties(tmp_path):
    save_pretrained(LanguageModel.from_config(NATIVE["encoder"]), tmp_path / "m")
    model = load_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    assert model.transformer.tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.decoder.weight is model.transformer.tokens.weight


# ----------------------------------------------------------------------------- errors
def _write(path, config, tensors=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(path / "model.safetensors"))
    return path


def test_missing_paths(tmp_path):
    with pytest.raises(InteropError, match="no such model directory"):
        load_pretrained(tmp_path / "nowhere")
    with pytest.raises(InteropError, match=r"config\.json: missing"):
        load_pretrained(tmp_path)
    with pytest.raises(InteropError, match=r"no weights found \(looked for model\.safetensors"):
        load_pretrained(_write(tmp_path / "hf", {"model_type": "gpt2"}))
    with pytest.raises(InteropError, match=r"model\.safetensors: missing"):
        load_pretrained(_write(tmp_path / "ours", {"lit_transformer": 1, "model": NATIVE["encoder"].to_dict()}))


def test_unsupported_family(tmp_path):
    with pytest.raises(InteropError, match=r"unsupported model_type 'roberta'; supported: bert, gpt2, t5, llama"):
        load_pretrained(_write(tmp_path / "r", {"model_type": "roberta"}, {}))
    with pytest.raises(InteropError, match=r"unsupported architecture 'BertForSequenceClassification'"):
        config = {"model_type": "bert", "architectures": ["BertForSequenceClassification"]}
        load_pretrained(_write(tmp_path / "c", config, {}))


def test_native_missing_unexpected_and_unknown_key(tmp_path):
    save_pretrained(LanguageModel.from_config(NATIVE["encoder"]), tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors["transformer.encoder.blocks.1.ffn.up.bias"]
    tensors["transformer.encoder.blocks.9.ffn.up.bias"] = torch.zeros(74)
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(
        InteropError,
        match=r"missing 1: transformer\.encoder\.blocks\.1\.ffn\.up\.bias; "
        r"unexpected 1: transformer\.encoder\.blocks\.9\.ffn\.up\.bias",
    ):
        load_pretrained(tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["model"]["d_modle"] = raw["model"].pop("d_model")
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"d_modle.*did you mean `d_model`"):
        load_pretrained(tmp_path / "m")
