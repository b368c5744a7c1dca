"""What a checkpoint holds beyond the run state: RNG states per worker, fingerprints, the resume check.

A checkpoint directory has ``state.pt`` (rank 0: the run state of
:meth:`raystudy.core.finetune.Finetuner.state_dict`) and ``rng_rank{r}.pt`` (every rank ``r``: its torch,
CUDA, numpy and Python RNG states).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch

from raystudy.core.finetune.config import RENAMED_KEYS, FinetuneConfig
from raystudy.core.tensors import torch_load_reason
from raystudy.precision import upgrade_settings
from raystudy.setting_roles import fields_with, legacy_values
from raystudy.settings import accuracy_batches

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
RNG_FILE = "rng_rank{rank}.pt"


def rng_state(device: torch.device | None = None) -> dict:
    """torch (CPU and the CUDA device), numpy and Python RNG states, as plain tensors/lists."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": _to_lists(random.getstate()),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached_gaussian"]))
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, tuple | list) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def fingerprint(obj) -> str:
    """SHA-256 over a nested structure of tensors, arrays and scalars (dict keys sorted): equal
    fingerprints mean bitwise-equal state."""
    h = hashlib.sha256()

    def feed(o):
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(o, np.ndarray):
            h.update(f"A{o.dtype}{o.shape}".encode())
            h.update(np.ascontiguousarray(o).tobytes())
        elif isinstance(o, dict):
            h.update(b"{")
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                feed(o[k])
            h.update(b"}")
        elif isinstance(o, list | tuple):
            h.update(b"[")
            for v in o:
                feed(v)
            h.update(b"]")
        else:
            h.update(repr(o).encode())

    feed(obj)
    return h.hexdigest()


def resume_config(cfg: FinetuneConfig) -> dict:
    """The fields of ``cfg`` a checkpoint records and must agree on (its settings declared with the role
    ``resume``: :func:`~raystudy.setting_roles.fields_with`), and the batches of a per-batch accuracy
    (:func:`~raystudy.settings.accuracy_batches`)."""
    batches, keys = accuracy_batches(cfg), fields_with(cfg, "resume")
    return {**{k: v for k, v in cfg.to_dict().items() if k in keys},
            "accuracy_batches": None if batches is None else list(batches)}


def write_checkpoint(directory: str | os.PathLike, state: dict | None, *, rank: int,
                     device: torch.device | None = None) -> None:
    """Write this worker's part of a checkpoint: ``state`` (rank 0's run state; None on other ranks) and
    this rank's RNG states."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if state is not None:
        torch.save(state, directory / STATE_FILE)
    torch.save(rng_state(device), directory / RNG_FILE.format(rank=rank))


def checkpoint_problem(directory: str | os.PathLike) -> str | None:
    """Why the checkpoint folder ``directory`` cannot be resumed from, or ``None`` when it is whole.

    Every ``*.pt`` file must be a complete archive (``torch.save`` writes a zip whose entries carry CRCs,
    all checked here: a file cut short by a full disk or a killed writer fails), rank 0's ``state.pt`` must
    be there, and every rank's RNG file must load without running code (:func:`load_checkpoint_file`);
    ``state.pt`` itself is loaded, the same way, when the run resumes (:func:`read_state`).
    """
    import zipfile

    directory = Path(directory)
    if not (directory / STATE_FILE).is_file():
        return f"checkpoint {directory} has no {STATE_FILE}"
    for path in sorted(directory.glob("*.pt")):
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except (OSError, zipfile.BadZipFile, EOFError) as e:
            return f"checkpoint file {path} is unreadable (truncated or corrupt: {e})"
        if bad is not None:
            return f"checkpoint file {path} is corrupt (entry {bad} fails its CRC)"
    for path in sorted(directory.glob(RNG_FILE.format(rank="*"))):  # small: every rank's, loaded here by rank 0
        try:
            load_checkpoint_file(path)
        except UnreadableCheckpoint as e:
            return str(e)
    return None


class UnreadableCheckpoint(ValueError):
    """A checkpoint file ``torch.load(weights_only=True)`` cannot load: cut short, corrupt, or a pickle of
    objects other than tensors (refused, never run). Its message names the file and never repeats PyTorch's
    advice to load it with ``weights_only=False`` (:func:`~raystudy.core.tensors.torch_load_reason`)."""


def load_checkpoint_file(path: str | os.PathLike):
    """The contents of one checkpoint file, loaded without running code (:class:`UnreadableCheckpoint`)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError (a refused global), a truncated zip, EOFError, OSError, ...
        raise UnreadableCheckpoint(f"checkpoint file {path} cannot be loaded safely: {torch_load_reason(e)}") from None


class ForeignCheckpoint(ValueError):
    """A checkpoint written by another run (other settings) or for another store than the one resuming."""


def read_state(directory: str | os.PathLike, cfg: FinetuneConfig, *, train_rows: int,
               checksum: str | None) -> dict:
    """The run state of a checkpoint, checked to belong to ``cfg`` on a store with ``train_rows`` train
    rows and this ``checksum`` (:class:`ForeignCheckpoint` otherwise; :class:`UnreadableCheckpoint` for an
    unreadable one).
    Checkpoints of older versions name the configuration ``component``; it is renamed on read."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {directory} has no {STATE_FILE}")
    state = load_checkpoint_file(path)
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise UnreadableCheckpoint(f"checkpoint file {path} holds no run state")
    saved = upgrade_settings(state["config"])  # older settings in today's spelling
    for old, new in RENAMED_KEYS.items():
        if old in saved:
            saved.setdefault(new, saved.pop(old))
    mine = resume_config(cfg)
    for k, v in legacy_values(cfg).items():  # a checkpoint older than the field ran its only behaviour
        saved.setdefault(k, v)
    saved.setdefault("precision", mine["precision"])  # older checkpoints did not record it
    saved.setdefault("accuracy_batches", mine["accuracy_batches"])
    changed = {k: (saved.get(k), mine[k]) for k in mine if saved.get(k) != mine[k]}
    if changed:
        raise ForeignCheckpoint(f"checkpoint {directory} belongs to another run: (checkpoint, now) differ for "
                                f"{changed}")
    if state["data"]["train_rows"] != train_rows or state["data"]["checksum"] != checksum:
        raise ForeignCheckpoint(f"checkpoint {directory} was written for another store than {cfg.store}")
    state["config"] = saved
    return state


def read_rng(directory: str | os.PathLike, *, rank: int) -> dict | None:
    """This rank's RNG states in the checkpoint (:func:`set_rng_state` sets them), or None with a warning
    when it has none for this rank; read before anything of the checkpoint is applied."""
    path = Path(directory) / RNG_FILE.format(rank=rank)
    if not path.is_file():
        log.warning("checkpoint %s has no RNG state for rank %d; RNG not restored", directory, rank)
        return None
    state = load_checkpoint_file(path)
    if not isinstance(state, dict) or not {"torch", "numpy", "python"} <= set(state):
        raise UnreadableCheckpoint(f"checkpoint file {path} holds no RNG state")
    return state


def restore_rng(directory: str | os.PathLike, *, rank: int, device: torch.device | None = None) -> None:
    """Set this rank's RNG states from the checkpoint (:func:`read_rng`; a warning when it has none)."""
    rng = read_rng(directory, rank=rank)
    if rng is not None:
        set_rng_state(rng, device)
