"""A checkpoint is data: what its files may hold and how each is read, so that loading a checkpoint someone else
wrote (shared, downloaded, edited) can never run code.

    iter_N/meta.json        JSON (``json.load``)
    iter_N/.metadata        torch.distributed.checkpoint's index: a pickle, read by ``MetadataUnpickler``, which
                            builds only the classes that index is made of (``DCP_CLASSES``: ``Metadata``,
                            ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``,
                            ``StorageMeta``, ``MetadataIndex``, ``_StorageInfo``, ``torch.Size``, dtypes, layouts,
                            paths); then every entry is checked (tensors only, pieces in plain files of the directory)
    iter_N/__0_0.distcp     tensors, read by DCP with ``torch.load(weights_only=True)``
    iter_N/rng_rank*.pt     tensors and numbers (``rng_state``), ``torch.load(weights_only=True)``
    iter_N/model_tp*.pt, optim_tp*.pt   (format 2) tensors and plain values, ``torch.load(weights_only=True)``

A file that needs anything else (a crafted ``.metadata`` whose pickle calls ``os.system``; an RNG file of an
older format, which pickled numpy arrays) is refused with one line naming it. ``checkpoint.trust_pickle: true``
loads such a file anyway, with a warning naming it: only for a checkpoint you trust.

Why a reader of our own: ``FileSystemReader.read_metadata`` is a bare ``pickle.load``, and the metadata decides how
each piece is read -- an entry marked ``BytesStorageMetadata`` is loaded by DCP with ``torch.load(weights_only=False)``.
Our checkpoints hold tensors only, so that class is not on the list and every entry must be a tensor.

``weights_only`` means torch's own list of types here (``torch_types_only``): importing megatron-core (its datasets
and tokenizers) adds numpy arrays, ``argparse.Namespace``, ``PosixPath`` and its own classes to torch's process-wide
list of safe globals (``megatron.core.safe_globals``), which would let an older RNG file through unsaid.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
from typing import IO

import numpy as np
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from ...config import ConfigError

log = logging.getLogger("megatron_lc")

_META = "torch.distributed.checkpoint.metadata"
DCP_CLASSES = {(_META, n) for n in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                    "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided and friends pickle as _get_layout("torch.strided")
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")}  # StorageMeta.checkpoint_id (pathlib moved in 3.13)

TRUST_HINT = "set checkpoint.trust_pickle: true to load it anyway, only for a checkpoint you trust"


class UntrustedCheckpointError(ConfigError):
    """A checkpoint file holds more than data; the message names it (refused, never retried on another
    checkpoint: a planted file is not damage)."""


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that builds only ``DCP_CLASSES`` and torch dtypes: a pickle can call nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which is not part of a checkpoint's metadata")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id, which no checkpoint metadata has")


def _check_metadata(md, path: str) -> None:
    """Every entry a tensor, every piece a plain file of the checkpoint directory; else UnpicklingError."""
    bad = pickle.UnpicklingError
    if type(md) is not Metadata or not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data,
                                                                                                    dict):
        raise bad(f"it holds a {type(md).__name__}, not DCP metadata")
    for key, entry in md.state_dict_metadata.items():
        if not (isinstance(key, str) and type(entry) is TensorStorageMetadata and type(entry.size) is torch.Size
                and type(entry.properties) is TensorProperties and isinstance(entry.chunks, list)
                and all(type(c) is ChunkStorageMetadata for c in entry.chunks)):
            raise bad(f"its entry {key!r} is not a tensor")
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        if not (type(index) is MetadataIndex and type(info) is _StorageInfo and isinstance(name, str)
                and name == os.path.basename(name) and name not in ("", ".", "..") and not info.transform_descriptors
                and isinstance(info.offset, int) and isinstance(info.length, int)):
            raise bad(f"its piece {getattr(index, 'fqn', index)!r} is not a plain file of the checkpoint "
                      f"({name!r})")
    if md.storage_meta is not None and type(md.storage_meta) is not StorageMeta:
        raise bad("its storage_meta is not StorageMeta")


def read_dcp_metadata(f: IO[bytes], path: str, trust_pickle: bool) -> Metadata:
    """DCP's metadata from the open file ``f`` (``path`` names it in messages), as data (see module doc)."""
    try:
        md = MetadataUnpickler(f).load()
        _check_metadata(md, path)
        return md
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not trust_pickle:
            raise UntrustedCheckpointError(f"{path} is not a checkpoint's metadata as data ({why}): refused, since "
                                           f"unpickling it could run code; {TRUST_HINT}") from None
        log.warning("%s: unpickled without restrictions (checkpoint.trust_pickle: true): %s", path, why)
        f.seek(0)
        return pickle.load(f)


class DataOnlyReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by ``read_dcp_metadata`` once (tensors are read by DCP with
    ``weights_only=True`` already). Call ``read_metadata()`` before ``dcp.load``: inside it DCP logs a failed read
    with its traceback and retries a per-rank ``__N.metadata``; this signature (no ``**kwargs``) turns that retry
    off."""

    def __init__(self, path: str, trust_pickle: bool = False):
        super().__init__(path)
        self.trust_pickle = trust_pickle
        self._metadata = None

    def read_metadata(self) -> Metadata:
        if self._metadata is None:
            path = self._get_metadata_path()
            with self.fs.create_stream(path, "rb") as f:
                md = read_dcp_metadata(f, str(path), self.trust_pickle)
            if md.storage_meta is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            self._metadata = md
        return self._metadata


@contextlib.contextmanager
def torch_types_only():
    """``weights_only`` loads inside allow torch's own types only: the safe globals others registered process-wide
    (megatron-core: numpy arrays, argparse.Namespace, ...) are set aside meanwhile and put back after."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.add_safe_globals(registered)


def load_torch_file(path: str, trust_pickle: bool, mmap: bool = False):
    """``torch.load(path, weights_only=True)``: tensors and plain values. A file that needs more is an
    ``UntrustedCheckpointError`` naming it, or with ``trust_pickle`` loaded in full (said in the log)."""
    try:
        with torch_types_only(), unset_fake_temporarily():  # (values: real tensors, also in a rehearsal)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = [ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln][:1]
        if not trust_pickle:
            raise UntrustedCheckpointError(
                f"{path} holds pickled Python objects, not only tensors ({found[0][:120] if found else 'pickle'}): "
                f"refused, since unpickling it could run code (an older checkpoint format, or a planted file); "
                f"{TRUST_HINT}") from None
        log.warning("%s: unpickled without restrictions (checkpoint.trust_pickle: true)", path)
        with unset_fake_temporarily():
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)


# ---- RNG states as tensors and numbers ----------------------------------------------------------------------------
def rng_state() -> dict:
    """This process' RNG states as tensors and numbers (``torch.load(weights_only=True)`` reads them back): real
    host tensors, also in a rehearsal (outside its fake mode: the states are values)."""
    with unset_fake_temporarily():
        return _rng_state()


def _rng_state() -> dict:
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": torch.tensor(mt, dtype=torch.int64), "python_version": version, "python_gauss": gauss,
             "numpy": torch.from_numpy(keys.astype(np.int64)), "numpy_pos": int(pos),
             "numpy_gauss": [int(has_gauss), float(cached)], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``'s states (or an older checkpoint's pickled ones, loaded with trust_pickle)."""
    with unset_fake_temporarily():
        _set_rng_state(state)


def _set_rng_state(state: dict) -> None:
    if torch.is_tensor(state["python"]):
        random.setstate((state["python_version"], tuple(state["python"].tolist()), state["python_gauss"]))
        has_gauss, cached = state["numpy_gauss"]
        np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], has_gauss,
                             cached))
    else:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
