"""Where a shared store lives, and where its input files may come from: a directory (local or on a
shared filesystem) or an `s3://bucket/prefix` URL (AWS S3, or any S3-compatible server).

Object stores are reached with boto3 and configured the way boto3 and litdata read it, never from
a recipe (a recipe is shared; credentials are not): AWS_ENDPOINT_URL (an S3-compatible server),
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or AWS_PROFILE or an instance role,
and AWS_DEFAULT_REGION. Only s3:// is offered: it is the scheme the tests exercise against a real
server (moto's); litdata's other schemes (gs://, azure://, hf://) are refused in one line.

`open_location` probes the bucket before anything is read or written, and every call turns
botocore's errors into one-line DataErrors: an endpoint that does not answer, no credentials,
a bucket that does not exist, access denied. Calls retry S3_ATTEMPTS times (botocore's "standard"
mode: exponential backoff with jitter), so a dead endpoint fails in seconds, not after litdata's
own 1000 attempts (its S3Client default).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lit_transformer.data.data_config import URL_SCHEMES
from lit_transformer.data.sources import files as F
from lit_transformer.errors import DataError, first_line

S3_ATTEMPTS = 4  # botocore's default for "standard" mode is 3; one more rides out a brief blip
# the probe before anything is read or written, once: an endpoint that refuses it is named in under
# a second (S3_ATTEMPTS took 6 to 10 s against a closed port, 2 attempts 1 to 2.5 s); a blip at that
# moment fails the command, which starts again as it was (nothing is written before the probe)
PROBE_ATTEMPTS = 1
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 120  # a 64 MB chunk at ~1 MB/s on a congested link still completes


def is_url(spec: str) -> bool:
    return "://" in str(spec)


def check_url(spec: str, key: str) -> None:
    scheme = str(spec).split("://", 1)[0].lower()
    if scheme not in URL_SCHEMES:
        raise DataError(
            f"{key}={spec!r}: {scheme}:// is not supported; use a directory (local or shared) or an s3:// URL "
            "(AWS S3 or an S3-compatible server, with AWS_ENDPOINT_URL)"
        )


def s3_config(attempts: int = S3_ATTEMPTS):
    """botocore's client settings here: bounded retries and timeouts (module docstring)."""
    from botocore.config import Config

    return Config(
        retries={"max_attempts": attempts, "mode": "standard"},
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
    )


_clients: dict[tuple, object] = {}


def s3_client(attempts: int = S3_ATTEMPTS):
    """A boto3 S3 client configured from the environment (module docstring), with `s3_config`;
    one per process and AWS_* environment (building one loads botocore's models: ~0.2 s; a client
    is not fork-safe, and the environment holds its endpoint and credentials)."""
    import boto3

    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
    key = (os.getpid(), attempts, *env)
    if key not in _clients:
        for old in [k for k in _clients if k[0] != os.getpid() or k[2:] != tuple(env)]:
            del _clients[old]
        _clients[key] = boto3.session.Session().client("s3", config=s3_config(attempts))
    return _clients[key]


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes at either end) of an s3:// URL."""
    parsed = urllib.parse.urlparse(url)
    return parsed.netloc, parsed.path.strip("/")


def explain(error: Exception, where: str, client=None) -> DataError:
    """A botocore error as one line naming `where` and what to do."""
    from botocore import exceptions as E

    endpoint = getattr(getattr(client, "meta", None), "endpoint_url", None) or "the default AWS endpoint"
    if isinstance(error, (E.NoCredentialsError, E.PartialCredentialsError)):
        return DataError(
            f"{where}: no credentials for the object store ({first_line(error)}): set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or run where an instance role provides them)"
        )
    if isinstance(error, (E.EndpointConnectionError, E.ConnectTimeoutError, E.ReadTimeoutError, E.ConnectionError)):
        return DataError(
            f"{where}: cannot reach the object store at {endpoint} ({first_line(error)}); check "
            "AWS_ENDPOINT_URL and the network"
        )
    if isinstance(error, E.ClientError):
        info = error.response.get("Error", {})
        code, message = str(info.get("Code", "")), info.get("Message", "") or first_line(error)
        if code in ("NoSuchBucket", "404", "NotFound") and error.operation_name == "HeadBucket":
            return DataError(f"{where}: the bucket does not exist at {endpoint}; create it or fix the URL")
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
            return DataError(
                f"{where}: access denied by {endpoint} ({code}); check the credentials and the bucket's policy"
            )
        return DataError(f"{where}: the object store at {endpoint} answered {code or 'an error'}: {message}")
    return DataError(f"{where}: {first_line(error)}")


@contextlib.contextmanager
def _s3_errors(where: str, client):
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, ClientError) as error:
        raise explain(error, where, client) from None


class LocalLocation:
    """A directory, local or on a shared filesystem. Writes land under a temporary name and are
    renamed into place, so a reader on another node never sees half a file."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()

    def url(self, rel: str = "") -> str:
        return str(self.root / rel) if rel else str(self.root)

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return (self.root / rel).read_bytes()
        except FileNotFoundError:
            return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self._replacing(rel) as tmp:
            tmp.write_bytes(data)

    def upload(self, local: Path, rel: str) -> None:
        with self._replacing(rel) as tmp:
            shutil.copyfile(local, tmp)

    def download(self, rel: str, local: Path) -> None:
        shutil.copyfile(self.root / rel, local)

    def list(self, rel: str = "") -> dict[str, int]:
        """{path relative to the root: size} of the files under `rel`."""
        base = self.root / rel
        if not base.is_dir():
            return {}
        return {str(p.relative_to(self.root)): p.stat().st_size for p in base.rglob("*") if p.is_file()}

    def delete(self, rels) -> None:
        for rel in rels:
            with contextlib.suppress(FileNotFoundError):
                (self.root / rel).unlink()

    @contextlib.contextmanager
    def _replacing(self, rel: str):
        target = self.root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
        os.close(fd)
        try:
            yield Path(name)
            os.replace(name, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)


class S3Location:
    """The objects under s3://bucket/prefix/. Every call's error is one line naming `key`."""

    def __init__(self, url: str, key: str):
        self.bucket, self.prefix = split_url(url)
        self.key, self.client = key, s3_client()

    def url(self, rel: str = "") -> str:
        return "s3://" + "/".join(p for p in (self.bucket, self.prefix, rel) if p)

    def _object(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def probe(self) -> None:
        client = s3_client(PROBE_ATTEMPTS)
        with _s3_errors(f"{self.key}={self.url()}", client):
            client.head_bucket(Bucket=self.bucket)

    def read_bytes(self, rel: str) -> bytes | None:
        from botocore.exceptions import ClientError

        with _s3_errors(f"{self.key}: {self.url(rel)}", self.client):
            try:
                return self.client.get_object(Bucket=self.bucket, Key=self._object(rel))["Body"].read()
            except ClientError as error:
                if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise

    def write_bytes(self, rel: str, data: bytes) -> None:
        with _s3_errors(f"{self.key}: {self.url(rel)}", self.client):
            self.client.put_object(Bucket=self.bucket, Key=self._object(rel), Body=data)

    def upload(self, local: Path, rel: str) -> None:
        with _s3_errors(f"{self.key}: {self.url(rel)}", self.client):
            self.client.upload_file(str(local), self.bucket, self._object(rel))

    def download(self, rel: str, local: Path) -> None:
        with _s3_errors(f"{self.key}: {self.url(rel)}", self.client):
            self.client.download_file(self.bucket, self._object(rel), str(local))

    def list(self, rel: str = "") -> dict[str, int]:
        start = len(self.prefix) + 1 if self.prefix else 0
        return {
            name[start:]: size for name, size, _ in list_objects(self.client, self.bucket, self._object(rel), self.key)
        }

    def delete(self, rels) -> None:
        keys = [{"Key": self._object(r)} for r in rels]
        with _s3_errors(f"{self.key}: {self.url()}", self.client):
            for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys a request
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i : i + 1000]})


Location = LocalLocation | S3Location


def open_location(spec: str, key: str) -> Location:
    """The store at `spec`, its bucket probed now when it is an object store (one-line errors)."""
    if not is_url(spec):
        return LocalLocation(spec)
    check_url(spec, key)
    location = S3Location(spec, key)
    location.probe()
    return location


def list_objects(client, bucket: str, prefix: str, key: str) -> Iterator[tuple[str, int, str]]:
    """(object key, size, ETag) of every object whose key starts with `prefix`, in key order."""
    with _s3_errors(f"{key}: s3://{bucket}/{prefix}", client):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                yield obj["Key"], int(obj["Size"]), str(obj.get("ETag", "")).strip('"')


# ----------------------------------------------------------------------------- input files


@dataclass(frozen=True)
class InputFile:
    name: str  # a path, or an s3:// URL
    size: int
    version: str = ""  # an object's ETag: another upload under the same name changes it

    def fingerprint(self) -> list:
        # name and size (and ETag), not mtime: nodes that hold their own copies of a corpus give
        # them other mtimes, and every part of a store must agree on the corpus's fingerprint
        return [self.name, self.size, self.version]


def resolve_inputs(specs: list[str], key: str, fmt: str = "auto") -> list[InputFile]:
    """Files, globs and directories (as data.train_files takes them: files.resolve_files), or the
    same under s3:// URLs: an object, a glob over object keys, or a prefix read as a directory."""
    out: list[InputFile] = []
    client = None
    for spec in specs:
        if not is_url(spec):
            out.extend(InputFile(str(p), p.stat().st_size) for p in F.resolve_files([spec], key, fmt))
            continue
        check_url(spec, key)
        client = client or s3_client()
        out.extend(_objects(client, spec, key))
    return out


def _objects(client, spec: str, key: str) -> list[InputFile]:
    bucket, path = split_url(spec)
    magic = min((path.find(c) for c in "*?[" if c in path), default=-1)
    if magic >= 0:  # a glob: list from the fixed part of the key, match the whole key
        found = [o for o in list_objects(client, bucket, path[:magic], key) if glob_match(path, o[0])]
        if not found:
            raise DataError(f"{key}: the glob {spec!r} matches no object")
    else:
        found = [o for o in list_objects(client, bucket, path, key) if o[0] == path]
        if not found:  # a prefix, read as a directory: its data files, recursively
            found = [
                o
                for o in list_objects(client, bucket, path.rstrip("/") + "/" if path else "", key)
                if Path(o[0]).suffix.lower() in F.EXTENSIONS
            ]
            if not found:
                raise DataError(f"{key}: no object {spec!r}, and no data file ({', '.join(F.EXTENSIONS)}) under it")
    for name, size, _ in found:
        if size == 0:
            raise DataError(f"{key}: s3://{bucket}/{name} is an empty file")
    return [InputFile(f"s3://{bucket}/{name}", size, etag) for name, size, etag in found]


def glob_match(pattern: str, name: str) -> bool:
    """Whether an object key matches a glob as glob.glob(recursive=True) matches paths: `*` and
    `?` within one /-separated level, `**` across any number of them."""
    return _match(pattern.split("/"), name.split("/"))


def _match(pattern: list[str], parts: list[str]) -> bool:
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_match(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _match(pattern[1:], parts[1:])


@contextlib.contextmanager
def local_copy(item: InputFile, workdir: Path, key: str):
    """A local path to read `item` from: the file itself, or an object downloaded into `workdir`
    (its name kept: the extension says the format) and deleted afterwards, so that a node holds one
    input file at a time. A reading error names the object, not the temporary copy."""
    if not is_url(item.name):
        yield Path(item.name)
        return
    bucket, name = split_url(item.name)
    local = Path(tempfile.mkdtemp(dir=workdir)) / Path(name).name
    client = s3_client()
    try:
        with _s3_errors(f"{key}: {item.name}", client):
            client.download_file(bucket, name, str(local))
        try:
            yield local
        except DataError as error:
            raise DataError(str(error).replace(str(local), item.name)) from None
    finally:
        shutil.rmtree(local.parent, ignore_errors=True)
