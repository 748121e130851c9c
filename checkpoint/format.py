"""How checkpoints lie on a tier: stores, the commit record, and what an item points to.

A checkpoint tier keeps persistent [`TierStore`][] manifests under ``<root>/.checkpoints``
(``<root>``: the local directory of the tier's first path), their objects on the tier's paths,
striped and checksummed by the store:

* **data stores** ``d-<session><n>``: on the first tier, one per writer, open (and so locked)
  while the writer lives, its keys ``<save id>/<n>`` holding every save's items, a large item cut into
  several keys of a bounded size (a tensor copied from another store: ``<save id>/stored/<its
  key>``); on the following tiers, one per drained (checkpoint, source
  store), holding the source's keys;
* **commit stores** ``c-<name>-<session><n>``: one per committed checkpoint, with a single key
  `RECORD_KEY`, written last: a header (magic, payload length, xxHash3 of the payload) and the
  payload, which holds the checkpoint's name and save id and DCP's `Metadata` whose ``storage_data``
  says, for each item, which keys of which data store hold it (`Item`).

A commit store without a whole record commits nothing, so a checkpoint whose save (or drain) was
interrupted at any point is simply not there, and the one before it is. When two records name the
same checkpoint (a save under a name already used), the newest commit wins.

The payload is written with ``torch.save`` and read with ``torch.load(weights_only=True)``,
allowing only DCP's metadata classes: a record never runs code when it is read.
"""

from __future__ import annotations

import io
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
import xxhash
from torch.distributed.checkpoint import metadata as dcp_metadata

from ..errors import InvalidKeyError

SCHEME = "tierstore://"
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
"""Checkpoint names: portable, flat, short enough for a commit store's directory name."""
DIRECTORY = ".checkpoints"
"""Where a tier's checkpoint stores keep their manifests, under the root of its first path."""
DATA_STORE = re.compile(r"d-[0-9a-f]{16}")
COMMIT_STORE = re.compile(r"c-(.+)-[0-9a-f]{16}")
RECORD_KEY = "record"
FORMAT = 2
MAGIC = b"TSDCP\x00\x00\x02"
HEADER = struct.Struct("<8sQQ")
"""Magic, payload length, xxHash3-64 of the payload."""

SAFE_GLOBALS: list[Any] = [
    dcp_metadata.Metadata,
    dcp_metadata.TensorStorageMetadata,
    dcp_metadata.BytesStorageMetadata,
    dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.TensorProperties,
    dcp_metadata.MetadataIndex,
    dcp_metadata.StorageMeta,
    dcp_metadata._MEM_FORMAT_ENCODING,
    torch.Size,
]
"""What a record may contain besides plain data: DCP's metadata classes."""


class Item(TypedDict):
    """Where one DCP item (a tensor chunk or a serialized object) lies on a tier: the
    concatenation of ``keys`` in data store ``store``."""

    dtype: str | None
    """The tensor's dtype name (``"bfloat16"``), None for a serialized object."""
    shape: list[int] | None
    nbytes: int
    store: str
    """The data store's name (``d-<id>``)."""
    keys: list[str]


@dataclass(frozen=True)
class Committed:
    """One commit record as read back."""

    name: str
    save_id: str
    committed_at: int
    """``time.time_ns()`` at the save's commit on the first tier (a drained copy keeps it): the
    newest record of a name wins."""
    store: str
    """The commit store holding the record (``c-<name>-<id>``)."""
    metadata: dcp_metadata.Metadata

    def items(self) -> dict[dcp_metadata.MetadataIndex, Item]:
        items: dict[dcp_metadata.MetadataIndex, Item] = self.metadata.storage_data
        return items

    def keys_by_store(self) -> dict[str, list[str]]:
        """The data stores the checkpoint uses, with its keys in each."""
        used: dict[str, list[str]] = {}
        for item in self.items().values():
            used.setdefault(item["store"], []).extend(item["keys"])
        return used


def checkpoint_name(checkpoint_id: str | os.PathLike[str]) -> str:
    """The name in a checkpoint id, ``tierstore://<name>`` or ``<name>``; [`InvalidKeyError`][] for
    anything else."""
    text = os.fspath(checkpoint_id)
    name = text.removeprefix(SCHEME)
    if not NAME.fullmatch(name):
        raise InvalidKeyError(
            f"checkpoint id {text!r}: use 'tierstore://<name>' or '<name>', the name 1-100 characters "
            "from [A-Za-z0-9._-], not starting with '.' or '-'"
        )
    return name


def is_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> bool:
    try:
        checkpoint_name(checkpoint_id)
    except InvalidKeyError:
        return False
    return True


def encode_record(payload: dict[str, Any]) -> bytes:
    body = io.BytesIO()
    torch.save(payload, body)
    data = body.getvalue()
    return HEADER.pack(MAGIC, len(data), xxhash.xxh3_64_intdigest(data)) + data


def decode_record(data: bytes) -> dict[str, Any] | None:
    """The payload of a whole, intact record; None for one that is torn (short, or failing its
    checksum), or not a record at all."""
    if len(data) < HEADER.size:
        return None
    magic, length, checksum = HEADER.unpack_from(data)
    body = data[HEADER.size :]
    if magic != MAGIC or len(body) != length or xxhash.xxh3_64_intdigest(body) != checksum:
        return None
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        payload: dict[str, Any] = torch.load(io.BytesIO(body), weights_only=True)
    return payload if payload.get("format") == FORMAT else None
