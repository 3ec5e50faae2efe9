"""Bad input gives a DataError whose one-line message names the file, key or value."""

import json
import time

import pytest
from omegaconf import OmegaConf

from lit_transformer.data.data_config import DataConfig, TokenizerConfig, from_dict
from lit_transformer.data.sources.corpus import build_sources
from lit_transformer.data.sources.files import ReadStats
from lit_transformer.data.tokens.prepare import build
from lit_transformer.errors import DataError

TOK = TokenizerConfig(vocab_size=300, num_sentinels=0, min_frequency=1)


def run(cfg, objective="clm"):
    return build(cfg, TOK, objective)


def lm_cfg(tmp_path, files, **kw):
    return DataConfig(train_files=[str(f) for f in files], cache_dir=str(tmp_path / "cache"), val_fraction=0, **kw)


def one_line(exc_info):
    assert "\n" not in str(exc_info.value)
    return str(exc_info.value)


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"data.train_files: no such file or directory: '.*nope.txt'") as e:
        run(lm_cfg(tmp_path, [tmp_path / "nope.txt"]))
    one_line(e)


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(DataError, match=r"the glob '.*\*.jsonl' matches no file"):
        run(lm_cfg(tmp_path, [tmp_path / "*.jsonl"]))


def test_directory_without_data(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="holds no data file"):
        run(lm_cfg(tmp_path, [tmp_path / "d"]))


def test_empty_file(tmp_path):
    (tmp_path / "e.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"e.txt is an empty file"):
        run(lm_cfg(tmp_path, [tmp_path / "e.txt"]))


def test_binary_file(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"text\x00\x01\x02 more")
    with pytest.raises(DataError, match=r"b.txt looks binary \(NUL byte in the first KB\)"):
        run(lm_cfg(tmp_path, [tmp_path / "b.txt"]))


def test_blank_file_is_never_a_silent_empty_dataset(tmp_path):
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    with pytest.raises(DataError, match=r"blank.txt.*0 documents"):
        run(lm_cfg(tmp_path, [tmp_path / "blank.txt"]))


def test_too_little_text_for_one_block(tmp_path):
    (tmp_path / "t.txt").write_text("tiny\n")
    with pytest.raises(DataError, match=r"t.txt: 1 documents, \d+ tokens: not enough for one block of 129"):
        run(lm_cfg(tmp_path, [tmp_path / "t.txt"]))


def test_missing_column_lists_available(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"body": f"x {i}", "label": 1}) + "\n" for i in range(5)))
    with pytest.raises(
        DataError, match=r"no column 'text' \(data.text_column\); available columns: \['body', 'label'\]"
    ):
        run(lm_cfg(tmp_path, [path]))


def test_validation_labels_absent_from_training(tmp_path):
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text("".join(json.dumps({"text": f"t {i}", "label": ["cat", "dog"][i % 2]}) + "\n" for i in range(20)))
    val.write_text("".join(json.dumps({"text": f"v {i}", "label": ["cat", "bird"][i % 2]}) + "\n" for i in range(6)))
    cfg = DataConfig(train_files=[str(train)], val_files=[str(val)], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"val.jsonl: labels \['bird'\] do not occur in the training data") as e:
        run(cfg, "classify")
    one_line(e)


def test_misaligned_source_target(tmp_path):
    (tmp_path / "a.en").write_text("one\ntwo\nthree\n")
    (tmp_path / "a.de").write_text("eins\nzwei\n")
    cfg = DataConfig(
        source_files=[str(tmp_path / "a.en")], target_files=[str(tmp_path / "a.de")], cache_dir=str(tmp_path / "cache")
    )
    with pytest.raises(DataError, match=r"misaligned seq2seq files: .*a.en has 3 lines but .*a.de has 2"):
        run(cfg, "seq2seq")


def test_plain_text_for_classification(tmp_path):
    (tmp_path / "x.txt").write_text("hello\n")
    with pytest.raises(DataError, match="plain text; classify data needs jsonl"):
        run(DataConfig(train_files=[str(tmp_path / "x.txt")]), "classify")


def test_invalid_utf8_replaced_and_counted(tmp_path):
    (tmp_path / "u.txt").write_bytes(b"caf\xe9 ok\nbad \xff\xfe bytes\nfine \xef\xbf\xbd already\n")
    stats = ReadStats()
    docs = list(
        build_sources(lm_cfg(tmp_path, [tmp_path / "u.txt"], text_format="lines"), "clm")["train"].iterate(stats)
    )
    assert docs[0] == "caf\ufffd ok" and docs[1] == "bad \ufffd\ufffd bytes"
    assert stats.replaced_chars == 3  # the U+FFFD written in the file is not counted


def test_absurdly_long_line_skipped_and_counted(tmp_path):
    (tmp_path / "l.txt").write_bytes(b"before\n" + b"x" * (3 << 20) + b"\nafter\n" + b"y" * 2000)
    stats = ReadStats()
    cfg = lm_cfg(tmp_path, [tmp_path / "l.txt"], text_format="lines", max_line_bytes=1000)
    docs = list(build_sources(cfg, "clm")["train"].iterate(stats))
    assert docs == ["before", "after"] and stats.long_lines_skipped == 2


def test_hub_offline_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"data.hub_name='wikitext' needs the network but HF_DATASETS_OFFLINE=1"):
        build_sources(DataConfig(hub_name="wikitext", hub_config="wikitext-2-raw-v1"), "clm")
    assert time.perf_counter() - t0 < 1


def test_hub_unreachable_fails_at_once(monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"needs the network but 127.0.0.1:9 is unreachable"):
        build_sources(DataConfig(hub_name="wikitext"), "clm")
    assert time.perf_counter() - t0 < 5


def test_config_values_and_keys():
    with pytest.raises(DataError, match=r"data.text_format='line' is not one of .* \(did you mean `lines`\?\)"):
        DataConfig(text_format="line")
    with pytest.raises(DataError, match=r"tokenizer.kind='wordpeice' .*did you mean `wordpiece`"):
        TokenizerConfig(kind="wordpeice")
    with pytest.raises(DataError, match=r"unknown key data.blocksize \(did you mean `block_size`\?\)"):
        from_dict(DataConfig, {"blocksize": 3}, "data")
    with pytest.raises(DataError, match="data.block_size=0 must be a positive integer"):
        DataConfig(block_size=0)
    with pytest.raises(DataError, match="data.source_files has 1 entries but data.target_files has 0"):
        DataConfig(source_files=["a"])
    # the schema owner embeds these in OmegaConf: Literal fields are validated there too
    schema = OmegaConf.structured(DataConfig)
    with pytest.raises(Exception, match="text_format"):
        OmegaConf.merge(schema, {"text_format": "line"})
    assert OmegaConf.to_object(OmegaConf.merge(schema, {"train_files": ["a.txt"]})).train_files == ["a.txt"]


def test_streaming_is_for_lm_objectives(tmp_path):
    with pytest.raises(DataError, match="data.streaming=true is for LM objectives"):
        build(DataConfig(streaming=True, cache_dir=str(tmp_path)), TOK, "classify")
