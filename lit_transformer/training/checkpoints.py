"""Crash-safe checkpoint files and safe checkpoint reading.

Writing (`AtomicCheckpointIO`, the Trainer's CheckpointIO plugin): a checkpoint is written to a
hidden temporary file in the same directory (`.last.ckpt.<pid>.tmp`: not `*.ckpt`, so nothing
that looks for checkpoints ever sees it), flushed and fsync'ed, then `os.replace`d over the
final name, and the directory entry fsync'ed. `os.replace` is atomic on POSIX within one file
system, so a `kill -9`, a power cut or a full disk at any moment leaves either the previous
complete file or the new complete file under the final name, never a partial one. On an
error the temporary file is removed and the previous checkpoint is untouched.

Distributed (FSDP2) checkpoints are directories: one shard file per rank (torch.distributed
.checkpoint) and meta.pt, which rank 0 writes last with everything but the tensors.

Reading (`read_checkpoint`): `torch.load(weights_only=True)`, whose unpickler accepts tensors
and plain containers only, so a pickle carrying code (a `__reduce__` that calls os.system) is
refused before anything runs. Lightning checkpoints of our objectives hold nothing else: the
hyperparameters are plain dicts (`TransformerConfig.to_dict`, `OptimConfig.to_dict`). Every
failure is one RunError line naming the file.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback

from lit_transformer.errors import RunError, first_line

TEMP_SUFFIX = ".tmp"
# Fixed keys every objective writes into its checkpoints (ObjectiveBase.on_save_checkpoint), so
# that loading never guesses: the registered objective name and the model config's dict.
OBJECTIVE_KEY = "objective"
MODEL_CONFIG_KEY = "model_config"


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")


def is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX)


# ----------------------------------------------------------------------------- writing


def atomic_save(obj: Any, path: str | os.PathLike, *, write: Callable[[Any, Any], None] | None = None) -> None:
    """`write(obj, file)` (default torch.save) into a temporary file beside `path`, fsync,
    rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as file:
            (write or torch.save)(obj, file)
            file.flush()
            os.fsync(file.fileno())  # the data reaches the disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Persist the rename itself (the directory entry); not possible on every platform."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO with atomic, fsync'ed writes and weights_only reads.

    A failed write (a full disk: OSError ENOSPC) becomes a RunError saying that the previous
    checkpoint is intact."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        try:
            atomic_save(checkpoint, path)
        except OSError as error:
            raise RunError(
                f"{path}: could not write the checkpoint ({type(error).__name__}: {first_line(error)}); nothing was "
                f"replaced, the previous checkpoint is intact"
            ) from error

    def load_checkpoint(
        self, path, map_location: Callable | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # weights_only is always True here, whatever the caller asks: no checkpoint runs code.
        return read_checkpoint(path, map_location=map_location if map_location is not None else "cpu")


# ----------------------------------------------------------------------------- reading


SHARDED_META = "meta.pt"  # what ModelParallelStrategy writes beside the shards (rank 0, last)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A distributed (FSDP2) checkpoint: a directory of per-rank shard files plus meta.pt."""
    return Path(path).is_dir() and (Path(path) / SHARDED_META).is_file()


def read_sharded_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A distributed checkpoint as one ordinary Lightning checkpoint dict (meta.pt's contents
    plus a whole `state_dict`), in this process without a process group: every weight is
    read in full from the shards (torch.distributed.checkpoint.load, no_dist=True) into a
    tensor allocated from the checkpoint's metadata. Optimizer states are not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    checkpoint = torch.load(path / SHARDED_META, map_location="cpu", weights_only=True)
    entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "state_dict."  # Lightning saves {"state_dict": ..., "optimizer_0": ...}
    weights = {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load({"state_dict": weights}, checkpoint_id=str(path), no_dist=True)
    checkpoint["state_dict"] = weights
    return checkpoint


def read_checkpoint(path: str | os.PathLike, *, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """A Lightning checkpoint as a dict, loaded with weights_only=True; a RunError naming the
    file when it is missing, truncated, corrupted, not a checkpoint, or holds pickled code."""
    path = Path(path)
    if is_sharded_checkpoint(path):  # FSDP2: a directory of shards, consolidated here
        return read_sharded_checkpoint(path)
    if not path.is_file():
        raise RunError(f"{path}: no such checkpoint file")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        blocked = unsafe_global(error)
        if blocked:
            raise RunError(
                f"{path}: refused: it pickles {blocked}, not only tensors and plain data; "
                f"checkpoints load with weights_only=True, so it did not run"
            ) from None
        raise RunError(
            f"{path}: not a readable Lightning checkpoint, truncated or corrupted "
            f"({type(error).__name__}: {first_line(error)})"
        ) from None
    except Exception as error:  # zip errors, EOF, invalid load keys: a truncated or corrupted file
        raise RunError(
            f"{path}: not a readable Lightning checkpoint, truncated or corrupted "
            f"({type(error).__name__}: {first_line(error)})"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise RunError(f"{path}: not a Lightning checkpoint (no state_dict)")
    return checkpoint


def unsafe_global(error: BaseException) -> str | None:
    """The class or function a weights_only load refused (`posix.system`), or None when the
    error is about something else (a corrupted pickle stream)."""
    match = re.search(r"GLOBAL (\S+)", str(error))
    return match.group(1) if match else None


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The global step a checkpoint was saved at, or None when it cannot be read. Memory-maps
    the tensors, so only the small pickle is read. A distributed (FSDP2) checkpoint is a
    directory whose meta.pt rank 0 writes after every shard: without it, it is incomplete."""
    path = Path(path)
    try:
        if path.is_dir():
            meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
            return int(meta.get("global_step", -1))
        return int(read_checkpoint(path, mmap=True).get("global_step", -1))
    except Exception:
        return None


def newest_complete(folder: str | os.PathLike, unreadable: list[Path] | None = None) -> Path | None:
    """The readable `*.ckpt` in `folder` with the highest global step (last.ckpt on a tie);
    temporary files of interrupted writes and unreadable files are skipped (the unreadable ones
    appended to `unreadable` when given, so that the caller can say so)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    ranked = []
    for path in sorted(folder.glob("*.ckpt")):
        if is_temp(path):
            continue
        step = checkpoint_step(path)
        if step is not None:
            ranked.append((step, path.name == "last.ckpt", path.stat().st_mtime, path))
        elif unreadable is not None:
            unreadable.append(path)
    return max(ranked)[3] if ranked else None


def remove_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that killed writes left behind; returns them."""
    folder = Path(folder)
    stale = [p for p in folder.glob(f".*{TEMP_SUFFIX}") if p.is_file()] if folder.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def check_architecture(checkpoint: dict[str, Any], model_config: dict[str, Any], path: str | os.PathLike) -> None:
    """A RunError naming every model config field where the checkpoint differs from the model
    about to load it (fields that change no weight shape, such as dropout, do not count)."""
    saved = checkpoint.get(MODEL_CONFIG_KEY)
    if not isinstance(saved, dict):
        return  # not one of our objectives' checkpoints: load_state_dict will judge
    harmless = {"dropout", "attention_dropout", "init_std", "attention_impl"}
    diff = [
        f"{k}={saved.get(k)!r} (checkpoint) vs {model_config.get(k)!r}"
        for k in sorted(set(saved) | set(model_config))
        if k not in harmless and saved.get(k) != model_config.get(k)
    ]
    if diff:
        raise RunError(f"{path}: a checkpoint of another architecture: {'; '.join(diff)}")


def checkpoint_objective(checkpoint: dict[str, Any], path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """(objective name, hyperparameters) under the fixed keys; a RunError when they are absent."""
    name, hp = checkpoint.get(OBJECTIVE_KEY), checkpoint.get("hyper_parameters")
    if not isinstance(name, str) or not isinstance(hp, dict):
        raise RunError(
            f"{path}: not a Lightning checkpoint of a lit-transformer objective "
            f"(no {OBJECTIVE_KEY!r} and hyper_parameters)"
        )
    return name, hp


# ----------------------------------------------------------------------------- another layout
#
# A run saved on W ranks may resume on W' (trainer.devices, trainer.num_nodes): the data modules
# save the layout their position was counted on and carry it (data/batches/sampler.py), `accumulate_for`
# keeps the global batch, and `ResumeCounters` moves Lightning's batch counters to the carried
# position, so that accumulation, validation every trainer.val_check_interval steps and the
# epoch's end fall where they would have in a run on W' from the start.


def checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's dict without reading its weights: a sharded checkpoint's meta.pt, else the
    file memory-mapped."""
    path = Path(path)
    if is_sharded_checkpoint(path):
        return torch.load(path / SHARDED_META, map_location="cpu", weights_only=True)
    return read_checkpoint(path, mmap=True)


def saved_data_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The data module's state in a Lightning checkpoint (filed under the module's class name)."""
    return next((v for k, v in checkpoint.items() if k.endswith("DataModule") and isinstance(v, dict)), None)


def saved_units(state: dict[str, Any]) -> list[int]:
    """Per task, what one rank's micro-batch holds in its sampler's units: examples, or 1 batch
    under data.batch_tokens."""
    if "batch_sizes" in state:  # a mixture
        return [int(b) for b in state["batch_sizes"]]
    return [int(state["batch_size"]) if state.get("batch_tokens") is None else 1]


def accumulate_for(
    state: dict[str, Any], *, world_size: int, units: list[int], accumulate: int, path: str | os.PathLike
) -> int:
    """The trainer.accumulate_grad_batches that keeps the global batch (micro-batch x accumulation
    x ranks) the checkpoint's data `state` was trained with, on `world_size` ranks of `units`:
    `accumulate` when it keeps it, the one that does when the recipe left accumulation as it was
    saved (a run resumed on half the ranks accumulates twice as many micro-batches), else a
    RunError saying what to set. Old checkpoints, without a layout, keep `accumulate`."""
    if "world_size" not in state:
        return accumulate
    was_world, was_accumulate, was_units = int(state["world_size"]), int(state["accumulate"]), saved_units(state)
    wanted = [u * was_accumulate * was_world for u in was_units]
    if [u * accumulate * world_size for u in units] == wanted:
        return accumulate
    exact = None
    if len(units) == len(was_units) and all(g % (u * world_size) == 0 for g, u in zip(wanted, units)):
        options = {g // (u * world_size) for g, u in zip(wanted, units)}
        exact = options.pop() if len(options) == 1 else None
    if exact is not None and accumulate == was_accumulate:
        return exact
    was = f"{'/'.join(map(str, was_units))} x {was_accumulate} x {was_world} ranks = {'/'.join(map(str, wanted))}"
    now = f"{'/'.join(map(str, units))} x {accumulate} x {world_size} ranks"
    fix = (
        f"set trainer.accumulate_grad_batches={exact}"
        if exact is not None
        else f"choose data.batch_size and trainer.accumulate_grad_batches so that batch x accumulation x {world_size} "
        f"= {'/'.join(map(str, wanted))}"
    )
    raise RunError(
        f"{path}: trained with a global batch (data.batch_size x trainer.accumulate_grad_batches x ranks) of {was}, "
        f"resumed as {now}; {fix}"
    )


class ResumeCounters(Callback):
    """After a resume whose data module carried its position to another layout (its `carried`:
    this rank's micro-batches (saved, carried)), Lightning's batch counters are moved to match
    before the first batch: the epoch's count to the carried one (where accumulation and the
    epoch's end are judged) and the total, which times validation, to the earlier epochs' count
    scaled by the change in accumulation plus this epoch's. The optimizer step is not touched."""

    def __init__(self):
        self._accumulate: int | None = None

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        state = saved_data_state(checkpoint) or {}
        self._accumulate = int(state["accumulate"]) if "accumulate" in state else None

    def on_train_start(self, trainer, pl_module) -> None:
        carried = getattr(trainer.datamodule, "carried", None)
        if carried is None or self._accumulate is None:
            return
        saved, now = carried
        progress = trainer.fit_loop.epoch_loop.batch_progress
        earlier = progress.total.ready - progress.current.ready
        total = earlier * trainer.accumulate_grad_batches // self._accumulate + progress.current.ready + now - saved
        for tracker, delta in ((progress.current, now - saved), (progress.total, total - progress.total.ready)):
            for field in ("ready", "started", "processed", "completed"):
                setattr(tracker, field, getattr(tracker, field) + delta)
