"""A shared store (data.store_dir) on a real S3-compatible server: moto's, in server mode on
127.0.0.1, reached through the environment as boto3 and litdata read it (AWS_ENDPOINT_URL, ...).

`prepare` writes a store from local files, and two parts write one from the same files under an
s3:// prefix: the same blocks, the same validation stream. A second prepare reuses a store, other
data is refused, an interrupted prepare leaves no manifest, and an endpoint that does not answer,
missing credentials or a missing bucket fail in one line with nothing written. Two gloo ranks
train from the object store with no local training cache, stop and resume exactly, and one
process resumes their checkpoint with the same examples in every step.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections import Counter
from pathlib import Path

import pytest
from helpers import RECIPES, TINY_RUN, RecordSteps, optional, tiny_run_config

optional("litdata", "store")
moto_server = optional("moto.server", "dev")

from lit_transformer.data.data_config import DataConfig, TokenizerConfig  # noqa: E402
from lit_transformer.data.sources.corpus import build_sources  # noqa: E402
from lit_transformer.data.sources.files import ReadStats  # noqa: E402
from lit_transformer.data.sources.stdlib import corpus_split  # noqa: E402
from lit_transformer.data.tokens import remote_store  # noqa: E402
from lit_transformer.data.tokens.object_store import s3_client  # noqa: E402
from lit_transformer.data.tokens.remote_store import FILE_BLOCKS, prepare_store  # noqa: E402
from lit_transformer.data.tokens.tokenizer import check_tokenizer, load_tokenizer  # noqa: E402
from lit_transformer.errors import DataError, RecipeError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BUCKET = "lit-store"
CHUNK = 3000  # bytes: a few dozen blocks a chunk, so that the store has chunks for every rank
STEPS, STOP = 6, 3
COMMON = [
    *TINY_RUN,
    "data.max_train_bytes=null",
    "data.max_val_bytes=null",
    "data.store=litdata",
    "data.store_cache_limit=10KB",
    f"trainer.max_steps={STEPS}",
    "trainer.checkpoint_every_n_steps=1",
    f"trainer.keep_checkpoints={STEPS}",
    "trainer.limit_val_batches=1",
    "optim.warmup_steps=0",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server for this module, the environment pointing at it, and one bucket."""
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookups for credentials
        "AWS_CONFIG_FILE": "/nonexistent",  # nothing of the machine's own AWS setup
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "LIT_TRANSFORMER_CACHE": str(tmp_path_factory.mktemp("node-cache")),
        "HF_HUB_OFFLINE": "1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("AWS_PROFILE", raising=False)
        s3_client().create_bucket(Bucket=BUCKET)
        try:
            yield f"s3://{BUCKET}"
        finally:
            server.stop()


@pytest.fixture(scope="module")
def corpus(s3, tmp_path_factory) -> Path:
    """Six training files and a validation file of the embedded corpus's text, on disk and under
    s3://BUCKET/corpus/ (the same names)."""
    folder = tmp_path_factory.mktemp("corpus")
    texts = [path.read_text(errors="replace")[:7000] for _, path in corpus_split("train", 0.02)[:7]]
    (folder / "train").mkdir()
    for i, text in enumerate(texts[:6]):
        (folder / "train" / f"part{i}.txt").write_text(text)
    (folder / "val.txt").write_text(texts[6])
    client = s3_client()
    for path in sorted(folder.rglob("*.txt")):
        client.upload_file(str(path), BUCKET, f"corpus/{path.relative_to(folder)}")
    return folder


def objects(prefix: str) -> dict[str, str]:
    """{key: ETag} under s3://BUCKET/prefix/."""
    pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1 :]: o["ETag"] for page in pages for o in page.get("Contents", [])}


def local_data(corpus: Path, store: str) -> list[str]:
    return [
        f"data.train_files=[{corpus / 'train'}]",
        f"data.val_files=[{corpus / 'val.txt'}]",
        f"data.store_dir={store}",
    ]


@pytest.fixture(scope="module")
def stores(s3, corpus, tmp_path_factory) -> dict:
    """`one`: prepared whole from the local files (the tokenizer trained on them); `two`: the same
    files under s3://, prepared in two parts through the command line with that tokenizer."""
    from lit_transformer.commands.cli import main
    from lit_transformer.commands.train import prepare

    runs = tmp_path_factory.mktemp("prepare-runs")
    out = {"runs": runs}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(remote_store, "CHUNK_BYTES", CHUNK)
        out["one"] = prepare(tiny_run_config(runs / "one", *local_data(corpus, f"{s3}/one"), base=COMMON))
        tokenizer = runs / "one" / "tokenizer.json"
        parts = [
            f"data.train_files=[{s3}/corpus/train/]",
            f"data.val_files=[{s3}/corpus/*.txt]",
            f"data.store_dir={s3}/two",
            f"tokenizer.path={tokenizer}",
        ]
        args = ["prepare", str(RECIPES / "tiny-clm.yaml"), *COMMON, f"run.dir={runs / 'two'}", *parts]
        assert main([*args, "--part", "1/2"]) == 0
        out["after one part"] = objects("two")
        assert main([*args, "--part", "0/2"]) == 0  # completes the set: merges
    return out


def store_items(store: str, cache: Path) -> list[tuple[int, tuple]]:
    """Every training item of a store, as (key, tokens), sorted."""
    from litdata import StreamingDataset

    from lit_transformer.data.tokens.store import _s3_options

    dataset = StreamingDataset(f"{store}/train", cache_dir=str(cache), storage_options=_s3_options())
    return sorted((int(item["index"]), tuple(int(t) for t in item["tokens"])) for item in dataset)


def manifest(prefix: str) -> dict:
    return json.loads(s3_client().get_object(Bucket=BUCKET, Key=f"{prefix}/manifest.json")["Body"].read())


def test_two_parts_hold_the_blocks_and_validation_stream_of_one_prepare(s3, stores, tmp_path):
    assert "manifest.json" not in stores["after one part"]  # one part alone: no manifest yet
    assert any(k.startswith("parts/part-00001-of-00002") for k in stores["after one part"])
    one, two = store_items(f"{s3}/one", tmp_path / "one"), store_items(f"{s3}/two", tmp_path / "two")
    assert len(one) > 200 and one == two
    m1, m2 = manifest("one"), manifest("two")
    assert m2["parts"] == 2 and m1["splits"]["train"] == m2["splits"]["train"]
    assert m1["splits"]["validation"] == m2["splits"]["validation"]
    body = s3_client().get_object
    for name in ("tokens.bin", "doc_starts.bin"):
        assert body(Bucket=BUCKET, Key=f"one/validation/{name}")["Body"].read() == (
            body(Bucket=BUCKET, Key=f"two/validation/{name}")["Body"].read()
        )
    # the parts took disjoint runs of the files, together all of them, and the merged index lists
    # the chunks of both
    files = [
        json.loads(body(Bucket=BUCKET, Key=f"two/parts/part-0000{i}-of-00002.json")["Body"].read()) for i in (0, 1)
    ]
    names = [f["splits"]["train"]["files"] for f in files]
    assert names[0] and names[1] and names[0] + names[1] == sorted(names[0] + names[1])
    assert [Path(n).name for n in names[0] + names[1]] == [f"part{i}.txt" for i in range(6)]
    index = json.loads(body(Bucket=BUCKET, Key="two/train/index.json")["Body"].read())
    assert {c["filename"][:19] for c in index["chunks"]} == {"part-00000-of-00002", "part-00001-of-00002"}


def test_a_shared_directory_holds_the_store_of_an_object_store(s3, stores, corpus, tmp_path):
    """The same two parts into a directory (a filesystem every node mounts): the same blocks, read in place."""
    from litdata import StreamingDataset

    store = tmp_path / "shared"
    files = dict(train_files=[f"{s3}/corpus/train/"], val_files=[str(corpus / "val.txt")], block_size=24)
    cfg = DataConfig(**files, store="litdata", store_dir=str(store))
    tok = TokenizerConfig(path=str(stores["runs"] / "one" / "tokenizer.json"), vocab_size=300, num_sentinels=0)
    for part in ("1/2", "0/2"):
        prepare_store(cfg, tok, "clm", tmp_path / "run", part=part, chunk_bytes=CHUNK, print_fn=None)
    items = sorted((int(x["index"]), tuple(map(int, x["tokens"]))) for x in StreamingDataset(str(store / "train")))
    assert items == store_items(f"{s3}/one", tmp_path / "one")
    assert json.loads((store / "manifest.json").read_text())["splits"] == manifest("one")["splits"]
    assert not [p for p in store.rglob("*") if p.name.startswith(".tmp-")]  # every file renamed into place


def test_each_file_is_packed_as_its_own_token_stream(s3, stores, corpus, tmp_path):
    """Brute force: encode each file's documents one by one, cut blocks of 25 tokens every 24."""
    tokenizer = load_tokenizer(stores["runs"] / "one" / "tokenizer.json")
    sep = check_tokenizer(tokenizer, "clm", None, block_size=24, noise_density=0.15, mean_span_length=3.0).separator_id
    expected = []
    for f, path in enumerate(sorted((corpus / "train").glob("*.txt"))):
        cfg = DataConfig(train_files=[str(path)], val_fraction=0.0)
        docs = build_sources(cfg, "clm")["train"].iterate(ReadStats())
        stream = [t for doc in docs for t in [*tokenizer.encode(doc, add_special_tokens=False).ids, sep]]
        blocks = (len(stream) - 25) // 24 + 1
        expected += [(f * FILE_BLOCKS + k, tuple(stream[k * 24 : k * 24 + 25])) for k in range(blocks)]
    assert store_items(f"{s3}/one", tmp_path) == expected
    assert manifest("one")["splits"]["train"]["blocks"] == len(expected)


def test_a_second_prepare_reuses_the_store_and_another_recipes_data_is_refused(s3, stores, corpus, tmp_path):
    from lit_transformer.commands.train import prepare
    from lit_transformer.data.modules.text_module import TextDataModule

    before = objects("one")
    again = prepare(tiny_run_config(tmp_path / "again", *local_data(corpus, f"{s3}/one"), base=COMMON))
    assert again["store"]["status"] == "cached" and objects("one") == before
    other = tiny_run_config(tmp_path / "other", *local_data(corpus, f"{s3}/one"), "data.block_size=16", base=COMMON)
    with pytest.raises(DataError, match=r"holds another recipe's data") as err:
        prepare(other)
    assert "\n" not in str(err.value) and objects("one") == before
    module = TextDataModule(other.data, other.tokenizer, "clm")  # a training node refuses it too
    with pytest.raises(DataError, match=r"holds another recipe's data"):
        module.setup("fit")


def test_an_interrupted_prepare_leaves_no_manifest_and_is_not_read(s3, stores, corpus, tmp_path, monkeypatch):
    from lit_transformer.data.modules.text_module import TextDataModule

    files = dict(train_files=[str(corpus / "train")], val_files=[str(corpus / "val.txt")], block_size=24)
    cfg = DataConfig(**files, store="litdata", store_dir=f"{s3}/cut")
    tok = TokenizerConfig(path=str(stores["runs"] / "one" / "tokenizer.json"), vocab_size=300, num_sentinels=0)
    upload = remote_store._Chunks._upload
    calls = []

    def killed(self, path):  # the process dies after its first chunk reached the store
        if calls:
            raise KeyboardInterrupt
        calls.append(path)
        upload(self, path)

    monkeypatch.setattr(remote_store._Chunks, "_upload", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_store(cfg, tok, "clm", tmp_path / "run", chunk_bytes=CHUNK, print_fn=None)
    left = objects("cut")
    assert "manifest.json" not in left and any(k.startswith("train/part-") for k in left)
    with pytest.raises(DataError, match=r"has no manifest.json: its prepare has not finished") as err:
        TextDataModule(cfg, tok, "clm").setup("fit")
    assert "\n" not in str(err.value)
    monkeypatch.setattr(remote_store._Chunks, "_upload", upload)
    prepare_store(cfg, tok, "clm", tmp_path / "run", chunk_bytes=CHUNK * 2, print_fn=None)  # starts again
    index = json.loads(s3_client().get_object(Bucket=BUCKET, Key="cut/train/index.json")["Body"].read())
    chunks = {k for k in objects("cut") if k.startswith("train/part-")}
    assert chunks == {f"train/{c['filename']}" for c in index["chunks"]}  # the first attempt's chunks are gone
    assert manifest("cut")["splits"]["train"] == manifest("one")["splits"]["train"]


def test_merge_n_writes_the_manifest_last_listing_exactly_the_shards_there(s3, stores, corpus, tmp_path, monkeypatch):
    """`prepare --merge 2` where no part saw the other's record (a filesystem that caches "no such
    file", docs/data.md): the index lists exactly the chunks under train/, the manifest counts what
    they hold and is the last thing written, after every shard it counts. A merge that fails while
    copying the validation split leaves no manifest, and run again it completes the store."""
    from litdata import StreamingDataset

    from lit_transformer.commands.cli import main
    from lit_transformer.data.tokens import store_manifest
    from lit_transformer.data.tokens.object_store import LocalLocation

    store = tmp_path / "shared"
    tokenizer = stores["runs"] / "one" / "tokenizer.json"
    args = ["prepare", str(RECIPES / "tiny-clm.yaml"), *COMMON, *local_data(corpus, str(store))]
    args += [f"tokenizer.path={tokenizer}", f"run.dir={tmp_path / 'run'}"]
    merge = store_manifest.merge_parts
    monkeypatch.setattr(remote_store, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(  # each part finds the other's record missing
        store_manifest, "merge_parts", lambda *a, required, **k: merge(*a, required=True, **k) if required else None
    )
    written: list[str] = []
    write_bytes, upload = LocalLocation.write_bytes, LocalLocation.upload
    monkeypatch.setattr(
        LocalLocation, "write_bytes", lambda self, rel, data: (written.append(rel), write_bytes(self, rel, data))
    )

    def failing_upload(self, local, rel):
        if rel == "validation/doc_starts.bin" and "failed" not in written:  # once, mid-copy of a split
            written.append("failed")
            raise OSError(28, "No space left on device")
        written.append(rel)
        upload(self, local, rel)

    monkeypatch.setattr(LocalLocation, "upload", failing_upload)
    for part in ("1/2", "0/2"):
        assert main([*args, "--part", part]) == 0
    assert not (store / "manifest.json").exists() and not (store / "train" / "index.json").exists()
    with pytest.raises(OSError, match="No space left"):
        main([*args, "--merge", "2"])
    assert not (store / "manifest.json").exists() and "manifest.json" not in written
    assert main([*args, "--merge", "2"]) == 0
    assert written[-1] == "manifest.json" and written.count("manifest.json") == 1  # last, and once
    index = json.loads((store / "train" / "index.json").read_text())
    listed = [f"train/{c['filename']}" for c in index["chunks"]]
    assert sorted(listed) == sorted(str(p.relative_to(store)) for p in store.glob("train/*.bin"))
    before_manifest = written[: written.index("manifest.json")]
    assert set(listed) <= set(before_manifest) and "train/index.json" in before_manifest
    assert {"validation/tokens.bin", "validation/meta.json"} <= set(before_manifest)
    merged = json.loads((store / "manifest.json").read_text())
    blocks = merged["splits"]["train"]["blocks"]
    assert merged["parts"] == 2 and blocks == sum(c["chunk_size"] for c in index["chunks"])
    assert blocks == manifest("one")["splits"]["train"]["blocks"]
    items = sorted((int(x["index"]), tuple(map(int, x["tokens"]))) for x in StreamingDataset(str(store / "train")))
    assert items == store_items(f"{s3}/one", tmp_path / "one")
    assert not [p for p in store.rglob("*") if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("endpoint", r"cannot reach the object store at http://127\.0\.0\.1:\d+ .*check AWS_ENDPOINT_URL"),
        ("credentials", r"no credentials for the object store .*AWS_ACCESS_KEY_ID"),
        ("bucket", r"data.store_dir=s3://no-such-bucket/x: the bucket does not exist"),
    ],
)
def test_bad_endpoint_credentials_or_bucket_fail_in_one_line_writing_nothing(
    s3, stores, corpus, tmp_path, monkeypatch, case, message
):
    store = "s3://no-such-bucket/x" if case == "bucket" else f"{s3}/never"
    if case == "endpoint":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    if case == "credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    cfg = DataConfig(train_files=[str(corpus / "train")], store="litdata", store_dir=store)
    with pytest.raises(DataError, match=message) as err:
        prepare_store(cfg, TokenizerConfig(vocab_size=300, num_sentinels=0), "clm", tmp_path / "run", print_fn=None)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    assert objects("never") == {}


def test_parts_and_merges_that_cannot_run_are_refused_in_one_line(s3, stores, corpus, capsys):
    from lit_transformer.commands.cli import main

    base = ["prepare", str(RECIPES / "tiny-clm.yaml"), *COMMON, *local_data(corpus, f"{s3}/unmerged")]
    cases = [
        (["--merge", "2"], r"part\(s\) 0, 1 of 2 have not finished \(no parts/part-00000-of-00002.json\)"),
        (["--part", "2/2"], r"--part '2/2': expected I/N with 0 <= I < N"),
        (["--part", "0/2"], r"every part must tokenize with the same tokenizer.*set tokenizer.path"),
        (["--part", "0/2", "--merge", "2"], r"--part 0/2 and --merge 2 are two steps: give one"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        assert re.fullmatch(f"error: .*{message}.*\n", capsys.readouterr().err), extra
    assert objects("unmerged") == {}
    assert main(["prepare", str(RECIPES / "tiny-clm.yaml"), *TINY_RUN, "--part", "0/2"]) == 2
    assert "prepare --part and --merge write a shared store" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.store_dir=gs://b/x"], "gs:// is not supported"),
        (["data.store=cache"], "holds a litdata store: set data.store=litdata"),
        (["data.max_train_bytes=1000"], "data.max_train_bytes=1000 caps the corpus in file order"),
        (["data.train_files=[]"], "is prepared from data.train_files"),
        (["data.store_dir=null"], "data.store_cache_limit='10KB' bounds the chunk cache"),
        (["data.store_cache_limit=lots"], "data.store_cache_limit='lots' is not a size"),
    ],
)
def test_shared_store_settings_are_refused_when_the_recipe_is_read(tmp_path, overrides, message):
    with pytest.raises(RecipeError, match=message) as err:
        tiny_run_config(tmp_path, "data.train_files=[x.txt]", "data.store_dir=s3://b/x", *overrides, base=COMMON)
    assert "\n" not in str(err.value)


def test_the_local_chunk_cache_stays_under_its_limit(s3, stores, tmp_path):
    """One epoch read from the object store: past the limit, chunks already read are deleted, so the
    node's disk holds about data.store_cache_limit, never the store, 4x larger (without a limit the
    whole store stayed on disk)."""
    from lit_transformer.data.tokens.store import StoreLoader

    limit = 4 * CHUNK
    loader = StoreLoader(
        f"{s3}/one/train",
        collator=lambda x, g: len(x),
        batch_size=3,
        cache_dir=str(tmp_path),
        max_cache_size=f"{limit}B",
    )
    loader.start(0, 0)
    on_disk, blocks = [], 0
    for n in loader:
        blocks += n
        on_disk.append(sum(_size(p) for p in tmp_path.rglob("*.bin")))
    total = sum(c["chunk_bytes"] for c in json.loads((next(tmp_path.rglob("index.json"))).read_text())["chunks"])
    assert blocks == manifest("one")["splits"]["train"]["blocks"] // 3 * 3
    assert total > 3 * limit and max(on_disk) <= limit + 2 * CHUNK  # the chunk being read and the next


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # litdata deleted it since the listing
        return 0


# ----------------------------------------------------------------------------- training from S3

_SCRIPT = r"""
import json
import sys
from pathlib import Path

from lit_transformer.commands.train import train
from lit_transformer.recipe.load import load_recipe
from helpers import RecordSteps, StopAt  # tests/ is on the scripts' path (helpers.job_env)

for overrides, stop, record in json.loads(Path(sys.argv[1]).read_text()):
    callbacks = [RecordSteps(record)] + ([StopAt(stop)] if stop else [])
    train(load_recipe(sys.argv[2], overrides), callbacks=callbacks, progress_bar=False)
"""
TWO = ["trainer.devices=2", "trainer.strategy=ddp", "data.batch_size=3"]


@pytest.fixture(scope="module")
def runs(s3, stores, corpus, tmp_path_factory, launcher) -> dict:
    """One two-rank job (the runs read store `one` from S3, with a local cache of their own):
    a whole run, one stopped at step STOP and resumed, and another stopped at STOP; then this
    process resumes the other on one rank (accumulating 2 micro-batches: the same global batch)."""
    out, node = tmp_path_factory.mktemp("s3-runs"), tmp_path_factory.mktemp("rank-node-cache")
    data = local_data(corpus, f"{s3}/one")

    def job(name, *extra, stop=None, part="first"):
        return [[*COMMON, *data, *TWO, f"run.dir={out / name}", *extra], stop, str(out / name / f"record-{part}")]

    jobs = [job("whole"), job("parts", stop=STOP), job("parts", "resume=auto", part="resumed"), job("other", stop=STOP)]
    (out / "jobs.json").write_text(json.dumps(jobs))
    (out / "run.py").write_text(_SCRIPT)
    launcher.run(out / "run.py", [str(out / "jobs.json"), str(RECIPES / "tiny-clm.yaml")], node, out, timeout=500)
    from lit_transformer.commands.train import train

    # one process, no process group left behind in pytest: the single-device strategy
    one_rank = tiny_run_config(
        out / "other", *data, *TWO, "trainer.devices=1", "trainer.strategy=auto", "resume=auto", base=COMMON
    )
    train(one_rank, callbacks=[RecordSteps(out / "other" / "record-resumed")], progress_bar=False)
    return {"out": out, "node": node}


def steps(record: Path) -> dict[int, dict]:
    """Per optimizer step over every rank: its rows (a multiset), epochs and mean loss per rank."""
    ranks = [json.loads(p.read_text()) for p in sorted(record.glob("rank*.json"))]
    out: dict[int, dict] = {}
    for rows in ranks:
        for row in rows:
            step = out.setdefault(row["step"], {"rows": Counter(), "epochs": set(), "loss": 0.0})
            step["rows"].update(tuple(r) for r in row["rows"])
            step["epochs"].add(row["epoch"])
            step["loss"] += row["loss"] / len(ranks)
    return out


@pytest.mark.distributed
def test_two_ranks_train_from_s3_with_no_local_training_cache_and_resume_exactly(runs, stores):
    out, node = runs["out"], runs["node"]
    whole = [json.loads((out / "whole" / "record-first" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in (0, 1):  # each rank's micro-batches and losses, stopped at STOP and resumed: the same
        parts = [
            json.loads((out / "parts" / f"record-{p}" / f"rank{r}.json").read_text()) for p in ("first", "resumed")
        ]
        assert parts[0] + parts[1] == whole[r]
    assert {s["step"] for s in whole[0]} == set(range(STEPS)) and {s["epoch"] for s in whole[0]} == {0}
    # the ranks read disjoint blocks
    assert not {tuple(x) for s in whole[0] for x in s["rows"]} & {tuple(x) for s in whole[1] for x in s["rows"]}
    # the node's local cache: the store's tokenizer, validation split and chunk cache, no token cache
    files = [p.relative_to(node) for p in node.rglob("*") if p.is_file()]
    assert all(p.parts[0] in ("stores", ".lock") for p in files), files
    assert {p.parts[2] for p in files if p.parts[0] == "stores"} == {".lock", "tokenizer", "validation", "chunks"}
    # a chunk cache per rank (text_module's _chunk_cache: two ranks sharing one raced on litdata's
    # index), each with its own index, under stores/<data fingerprint>/chunks/r<rank>
    chunks = [p for p in files if p.parts[0] == "stores" and p.parts[2] == "chunks"]
    assert {p.parts[1] for p in chunks} == {manifest("one")["data"][:32]}
    assert {p.parts[3] for p in chunks} == {"r0", "r1"}, chunks
    assert sorted(p.parts[3] for p in chunks if p.name == "index.json") == ["r0", "r1"], chunks
    stored = sum(c["chunk_bytes"] for c in json.loads(next(node.rglob("index.json")).read_text())["chunks"])
    cached = sum((node / p).stat().st_size for p in files if p.suffix == ".bin" and "chunks" in p.parts)
    assert cached < stored
    from lit_transformer.commands.evaluate import evaluate_suite  # validation from the store, in this process

    assert evaluate_suite(str(out / "whole"), split="validation", max_batches=1)["eval/validation/loss"] > 0


@pytest.mark.distributed
def test_one_rank_resumes_a_two_rank_checkpoint_with_the_same_examples_in_every_step(runs):
    out = runs["out"]
    expected, resumed = steps(out / "whole" / "record-first"), steps(out / "other" / "record-resumed")
    assert sorted(resumed) == list(range(STOP, STEPS))
    for step in range(STOP, STEPS):
        assert resumed[step]["rows"] == expected[step]["rows"], f"step {step}: other examples"
        assert resumed[step]["epochs"] == expected[step]["epochs"] == {0}
    got = [resumed[s]["loss"] for s in range(STOP, STEPS)]  # two micro-batches, each loss / 2
    assert got == pytest.approx([expected[s]["loss"] for s in range(STOP, STEPS)], abs=1e-5, rel=0)
    shutil.rmtree(out / "other" / "checkpoints", ignore_errors=True)
