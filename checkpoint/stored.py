"""Tensors that already live in a [`TierStore`][] (an offloaded optimizer's state), checkpointed
tier to tier instead of through the training process's memory.

[`stored_tensors`][] puts stand-ins for store objects into a state dict: tensors of the objects'
shapes and dtypes that hold no data (one element, expanded). A save of one copies the object's
committed version from its store into the writer's with [`TierStore.copy_to`][] (written back first
if it is only in DRAM): without reading it where the backends allow (a hard link where both are nvme
directories on one file system, a kernel copy between nvme directories on two), else read into
memory and put like any tensor. A load into one puts the saved object back into the store under its
key.

The store's workloads must leave those keys alone while a save or a load runs (the training
loop is paused in ``dcp.save``, and in ``dcp.async_save`` until its staging returns). Each rank
names its own objects in the state dict (``{f"optimizer.rank{rank}": ...}``): DCP takes an item
saved under one name on every rank for a replicated one and keeps one rank's copy.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch

from ..errors import BufferMismatchError
from ..store import TierStore


class StoredTensor(torch.Tensor):
    """A stand-in for a store object in a state dict (see [`stored_tensors`][]).

    A tensor of the object's shape and dtype that holds no data (one element, expanded); a save
    copies the object tier to tier, a load puts the saved object back into the store. Create them
    with [`stored_tensors`][], not directly.
    """


_owners: dict[int, tuple[weakref.ref[TierStore], str, weakref.ref[torch.Tensor]]] = {}
"""Each stand-in's store and key, by the address of its one element (its views share it)."""
_lock = threading.Lock()


def stored_tensors(store: TierStore, keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Stand-ins for store objects, to put in a state dict that ``dcp.save`` or ``dcp.load`` takes.

    Args:
        store: the store holding the objects.
        keys: the objects' keys; each must be committed.

    Returns:
        By key, a [`StoredTensor`][] of the object's shape and dtype.

    Raises:
        KeyNotFoundError: a key has no committed object.
        StoreClosedError: the store is closed.
    """
    stand_ins: dict[str, torch.Tensor] = {}
    with _lock:  # stand-ins no longer held are forgotten (a save holds its state dict throughout)
        for address in [address for address, entry in _owners.items() if entry[2]() is None]:
            del _owners[address]
    for key in keys:
        info = store.info(key)
        element = torch.zeros((), dtype=info.dtype)
        stand_in = torch.Tensor._make_subclass(StoredTensor, element.expand(info.shape))
        with _lock:
            _owners[element.data_ptr()] = (weakref.ref(store), key, weakref.ref(stand_in))
        stand_ins[key] = stand_in
    return stand_ins


def owner(tensor: torch.Tensor) -> tuple[TierStore, str] | None:
    """The store and key a stand-in (or a view of one) stands for; None for any other tensor."""
    if not isinstance(tensor, StoredTensor):
        return None
    with _lock:
        found = _owners.get(tensor.data_ptr())
    store = None if found is None else found[0]()
    if store is None or found is None:
        raise BufferMismatchError("a stand-in for a store object whose store or stand-in is gone")
    return store, found[1]
