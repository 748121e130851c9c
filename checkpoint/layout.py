"""How a checkpoint lies on a tier: object names, the commit record, and what an item points to.

On each tier a checkpoint is

* **data objects** ``d-<session>-<n>``, written through the tier (striped over its paths, an
  xxHash3 checksum per extent): a large tensor is cut into objects of a bounded size, and small
  items share *pack* objects of up to 4 MiB;
* one **commit record** ``c-<name>-<session>-<n>`` on the tier's first path, written last: a
  header (magic, payload length, xxHash3 of the payload) and the payload, which holds the
  checkpoint's name and save id, every data object it uses with its extents and checksums, and
  DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` whose ``storage_data`` says, for
  each item, which byte ranges of which objects hold it (:data:`Item`).

A record that is absent, short or fails its checksum commits nothing, so a checkpoint whose save
(or drain) was interrupted at any point is simply not there, and the one before it is. When two
records name the same checkpoint (a save under a name already used), the newest commit wins.
``<session>`` is the id of the writer's session directory (:mod:`tierstore.backends.private`),
which tells the objects of a live writer from the leftovers of one that died.

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
"""Checkpoint names: portable, flat, short enough for the record's object name."""
SESSION = r"[0-9a-f]{16}"
DATA_OBJECT = re.compile(rf"d-({SESSION})-[0-9a-f]+")
RECORD_OBJECT = re.compile(rf"c-(.+)-({SESSION})-[0-9a-f]+")
FORMAT = 1
MAGIC = b"TSDCP\x00\x00\x01"
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
    concatenation of ``pieces``, each ``[object, offset in it, length]``."""

    dtype: str | None
    """The tensor's dtype name (``"bfloat16"``), None for a serialized object."""
    shape: list[int] | None
    nbytes: int
    pieces: list[tuple[str, int, int]]


ObjectTable = dict[str, dict[str, Any]]
"""Data object name -> its placement on the tier (``nbytes`` and ``extents``: path, offset,
length, checksum each), as :meth:`tierstore.Placement.describe` gives them."""


@dataclass(frozen=True)
class Committed:
    """One commit record as read back."""

    name: str
    save_id: str
    committed_at: int
    """``time.time_ns()`` at the commit: the newest record of a name wins."""
    record: str
    """The record's object name on the tier's first path."""
    objects: ObjectTable
    metadata: dcp_metadata.Metadata

    @property
    def session(self) -> str:
        return session_of(self.record) or ""


def checkpoint_name(checkpoint_id: str | os.PathLike[str]) -> str:
    """The name in a checkpoint id, ``tierstore://<name>`` or ``<name>``;
    :class:`InvalidKeyError` for anything else."""
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


def session_of(object_name: str) -> str | None:
    """The writer session of a data object or record, None for a name that is neither."""
    match = DATA_OBJECT.fullmatch(object_name) or RECORD_OBJECT.fullmatch(object_name)
    return None if match is None else match.group(match.re.groups)


def record_name(object_name: str) -> str | None:
    """The checkpoint a record object commits, None if the name is not a record's."""
    match = RECORD_OBJECT.fullmatch(object_name)
    return None if match is None else match.group(1)


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
