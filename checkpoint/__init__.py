"""Checkpoints through the tiers: a ``torch.distributed.checkpoint`` (DCP) storage layer.

>>> import torch.distributed.checkpoint as dcp
>>> from tierstore.checkpoint import TieredStorageReader, TieredStorageWriter
>>> writer = TieredStorageWriter("tierstore.toml")                       # doctest: +SKIP
>>> dcp.save(state, checkpoint_id="tierstore://step-100", storage_writer=writer)  # doctest: +SKIP
>>> dcp.load(state, storage_reader=TieredStorageReader("tierstore.toml"))  # doctest: +SKIP

The config is a store config: its ``tiers`` are where checkpoints go, fastest first.

Every tier holds its checkpoints in persistent [`TierStore`][] s (`format`): the package uses the
store's public API, and the store does the striping, checksums, packing and crash-safe commits.

* **Save** (``dcp.save``, or ``dcp.async_save``): every rank puts its items into its writer's data
  store on the first tier, through that store's DRAM cache (the config's ``cache.budget``), and
  flushes it; the coordinating rank then writes the checkpoint's commit record there, last, in a
  commit store of its own, and the save returns. With ``async_save``, the writer is also the stager:
  it puts the state into that cache (spilling to the fast tier while it is full) instead of a second
  full copy, and training goes on once the copy is done (`save_items`).
* **Drain**: the coordinating rank copies the committed checkpoint to every following tier in the
  background, store by store with [`copy_to`][tierstore.store.TierStore.copy_to] (a hard link or a
  kernel copy between nvme directories, through memory elsewhere), and commits it there; it is
  durable once the last tier has it (`drain`). ``wait_durable`` waits for that.
* **Load** (``dcp.load``): from the first tier holding the checkpoint, its data stores opened
  read-only (every rank reads every rank's), resharding as DCP does.
* **State already in a store** (an offloaded optimizer's): [`stored_tensors`][] puts stand-ins for
  its objects in the state dict; a save copies them from that store into the checkpoint's without
  reading them (a hard link on one file system), a load puts them back (`stored`).
* **Retention** (``keep``): the newest N per tier, never deleting one from a tier before the last
  until it is durable.
* **Crash consistency**: a checkpoint exists on a tier only once its record is committed there, so a
  ``kill -9`` at any moment of a save, drain or deletion leaves every tier with the checkpoints it
  had (the interrupted one absent or complete); what the dead process left is collected when the
  next writer opens the tiers (`tiers`).
"""

from .reader import TieredStorageReader
from .stored import StoredTensor, stored_tensors
from .writer import TieredStorageWriter

__all__ = ["StoredTensor", "TieredStorageReader", "TieredStorageWriter", "stored_tensors"]
