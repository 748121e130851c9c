"""Checkpoints through the tiers: a ``torch.distributed.checkpoint`` (DCP) storage layer.

>>> import torch.distributed.checkpoint as dcp
>>> from tierstore.checkpoint import TieredStorageReader, TieredStorageWriter
>>> writer = TieredStorageWriter("tierstore.toml")                       # doctest: +SKIP
>>> dcp.save(state, checkpoint_id="tierstore://step-100", storage_writer=writer)  # doctest: +SKIP
>>> dcp.load(state, storage_reader=TieredStorageReader("tierstore.toml"))  # doctest: +SKIP

The config is a store config: its ``tiers`` are where checkpoints go, fastest first.

* **Save** (``dcp.save``, or ``dcp.async_save``): every rank writes its items to the first tier,
  striped over its paths, each data object checksummed; the coordinating rank then writes the
  checkpoint's commit record there (:mod:`.layout`), last, and the save returns. With
  ``async_save``, the writer is also the stager: it copies the state into the config's
  ``cache.budget`` of pinned, page-aligned DRAM (spilling to the fast tier while the budget is
  full) instead of a second full copy, and training goes on once the copy is done (:mod:`.staging`).
* **Drain**: the coordinating rank copies the committed checkpoint to every following tier in the
  background, tier to tier without passing through its memory where the backends allow (a hard
  link or a kernel copy between nvme directories), and commits it there; it is durable once the
  last tier has it (:mod:`.drain`). ``wait_durable`` waits for that.
* **Load** (``dcp.load``): from the first tier holding the checkpoint, resharding as DCP does.
* **State already in a store** (an offloaded optimizer's): :func:`stored_tensors` puts stand-ins
  for its objects in the state dict; a save copies them from the store's tier to the checkpoint's
  without reading them (a hard link on one file system), a load puts them back (:mod:`.stored`).
* **Retention** (``keep``): the newest N per tier, never deleting one from a tier before the last
  until it is durable.
* **Crash consistency**: a checkpoint exists on a tier only once its record is whole there, so a
  ``kill -9`` at any moment of a save, drain or deletion leaves every tier with the checkpoints
  it had (the interrupted one absent or complete); what the dead process left is collected when
  the next writer opens the tiers (:mod:`.tiers`).
"""

from .reader import TieredStorageReader
from .stored import StoredTensor, stored_tensors
from .writer import TieredStorageWriter

__all__ = ["StoredTensor", "TieredStorageReader", "TieredStorageWriter", "stored_tensors"]
