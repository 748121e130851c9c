"""Admission and reads: the offloader's staging memory, the captures it writes to the store, and
the bytes it reads back for backward, each decision taken by the step's
:class:`~tierstore.spill_policy.SpillPolicy`.

All memory comes from one :class:`~tierstore.staging.StagingArea` of ``budget`` bytes: captures
being written, captures the plan keeps, and bytes read back ahead of backward or being used by it.
A tensor rebuilt for backward shares its staging memory, which returns when autograd lets go of
the tensor. When the policy can make no room (tensors rebuilt earlier are still held outside the
offloader), a save stays where autograd keeps it and a read goes to ordinary memory instead of
waiting for ever; ``overflow_bytes`` counts those bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import torch

from ..buffers import Lease
from ..device import DeviceCopies
from ..errors import ConfigError, StoreClosedError
from ..namespaces import NamespaceClaim
from ..spill_policy import Residence, Room
from ..staging import StagingArea
from ..store import TierStore
from . import cuda
from .entries import Entry, Step
from .layout import Capture, copy_out

OUT_OF_ROOM_WAIT_S = 0.05
"""How long a save or a read waits for memory that nothing in flight will free (tensors rebuilt
earlier and still held) before it overflows to ordinary memory instead."""


class Transfers:
    """Captures into staging memory, their writes, the reads back, and the room they need.

    It is the :class:`~tierstore.spill_policy.SpilledTensors` of every step: the policy names
    entries, and this carries its decisions out.

    Args:
        store: where spilled captures go (as scratch objects).
        claim: the offloader's namespace: the spilled objects' keys.
        staging: the memory of every capture and read (its budget is the offloader's).
        lock: the offloader's lock, notified whenever memory or I/O in flight changes.
        stats: the offloader's counters (updated under ``lock``).
        background: runs deletions and what waits on CUDA copies, off the caller's thread.
        device: the copies between CUDA devices and staging memory (:mod:`.cuda`).
    """

    def __init__(
        self,
        store: TierStore,
        claim: NamespaceClaim,
        staging: StagingArea,
        lock: threading.Condition,
        stats: dict[str, float],
        background: Executor,
        device: DeviceCopies,
    ) -> None:
        self._store = store
        self._claim = claim
        self._serials = itertools.count()
        self._staging = staging
        self._lock = lock
        self._stats = stats
        self._background = background
        self._device = device
        self._writes_in_flight = 0
        self._reads_in_flight = 0
        self._warned = False

    # -- forward: admission and writes ------------------------------------------------------------
    def admit(
        self, step: Step, tensor: torch.Tensor, capture: Capture, storage: torch.UntypedStorage
    ) -> Entry | None:
        """Capture ``tensor`` into staging memory and start its write if the step's policy spills
        it; None if no room can be made."""
        if not self._staging.fits(capture.nbytes):
            raise ConfigError(
                f"budget: {self._staging.budget} bytes cannot hold one saved tensor of {capture.nbytes} "
                f"bytes ({tensor.type()} {list(tensor.shape)}); raise budget, or min_bytes above it"
            )
        stalled = time.perf_counter()
        if tensor.device.type == "cuda":
            with self._device.runtime.using(tensor.device):  # where the pool's memory is pinned
                if not self._staging.pinned:
                    with self._lock:
                        self._staging.pin_for_device()
                lease = self._lease(capture.nbytes, step)
        else:
            lease = self._lease(capture.nbytes, step)
        waited = time.perf_counter() - stalled
        with self._lock:
            self._stats["write_stall_s"] += waited
            step.stalls += waited
        if lease is None:
            return None
        entry = Entry(
            step=step,
            index=len(step.entries),
            key=self._claim.key(str(next(self._serials))),
            capture=capture,
            dtype=tensor.dtype,
            device=tensor.device,
            storage=weakref.ref(storage),
            saved_at=step.now(),
            data=lease.tensor,
            io=lease.io,
        )
        if tensor.device.type == "cuda":
            entry.copied = cuda.to_host(self._device, tensor, capture, lease.tensor)
        else:
            copy_out(tensor, capture, lease.tensor)
        with self._lock:
            step.add(entry)
            self._stats["step_saved_bytes"] += capture.nbytes
            if entry.spill:
                self._start_write(entry)
            else:
                self._stats["kept_bytes"] += capture.nbytes
                if entry.copied is not None:  # its memory held until the copy's end, no longer
                    self._background.submit(self._device.wait, entry.copied)
        return entry

    def _start_write(self, entry: Entry) -> None:
        """Write the entry's capture to the store in the background (under the lock)."""
        data, copied = entry.io, entry.copied
        assert data is not None
        entry.writing = True
        self._writes_in_flight += 1
        self._stats["spilled_bytes"] += entry.capture.nbytes
        self._stats["spilled_tensors"] += 1

        def put() -> Future[None]:
            if copied is not None:  # CUDA: the bytes are in host memory once the copy has ended
                self._device.wait(copied)
            return self._store.put(entry.key, data, scratch=True)

        if copied is None:
            self._run(entry, put, self._write_done)
        else:
            self._background.submit(self._run, entry, put, self._write_done)

    def to_device(self, data: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``data``, an entry's bytes in staging memory, copied to ``device`` for the calling
        thread's current stream (which waits for the copy); the staging memory is held until the
        copy has ended, and let go of then by the background thread."""
        restored, transfer = cuda.to_device(self._device, data, device)
        self._background.submit(self._device.wait, transfer)
        return restored

    def _write_done(self, entry: Entry, error: BaseException | None) -> None:
        with self._lock:
            entry.writing = False
            self._writes_in_flight -= 1
            if error is not None:  # the capture stays in memory: backward still gets it
                entry.error = error
                self._stats["write_errors"] += 1
            else:
                entry.written = True
                if entry.dead:
                    self.delete(entry)
                elif not entry.step.policy.keeps_after_write(
                    handed_back=entry.handed_back, used=entry.served()
                ):
                    entry.drop()
            self._lock.notify_all()

    # -- backward: reads --------------------------------------------------------------------------
    def read_ahead(self, step: Step) -> None:
        """Start reads in backward's order for as many spilled tensors as staging memory has room
        for now (under the lock)."""
        step.reads.advance(self)

    def bytes_for(self, entry: Entry, what: str) -> torch.Tensor:
        """The entry's captured bytes: still in memory (forwarded), read ahead, or read now.
        ``what`` names the saved tensor in the error raised if its bytes are lost."""
        stalled = time.perf_counter()
        with self._lock:
            while entry.data is None or entry.reading:
                if entry.error is not None:
                    raise RuntimeError(
                        f"saved tensor {what} cannot be restored: {entry.error}"
                    ) from entry.error
                if entry.reading:
                    self._lock.wait()
                    continue
                lease = self._lease(entry.capture.nbytes, entry.step, wanted=entry)
                if lease is None:  # no room: read into ordinary memory
                    self._stats["overflow_bytes"] += entry.capture.nbytes
                    memory = torch.empty(entry.capture.nbytes, dtype=torch.uint8)
                    lease = Lease(memory, memory)
                if entry.data is None and not entry.reading:
                    self._start_read(entry, lease)
            if entry.spill and not entry.read_back and entry.used_at is None:
                self._stats["forwarded_bytes"] += entry.capture.nbytes
            waited = time.perf_counter() - stalled
            self._stats["read_stall_s"] += waited
            entry.step.stalls += waited
            return entry.data

    def _start_read(self, entry: Entry, lease: Lease) -> None:
        """Read the entry's object into ``lease`` (under the lock)."""
        self._note_resident()
        self._stats["read_bytes"] += entry.capture.nbytes
        entry.data, entry.io = lease
        entry.reading = entry.read_back = True
        self._reads_in_flight += 1
        self._run(entry, lambda: self._store.get(entry.key, out=lease.io, cache=False), self._read_done)

    def _read_done(self, entry: Entry, error: BaseException | None) -> None:
        with self._lock:
            entry.reading = False
            self._reads_in_flight -= 1
            if error is not None:
                entry.error = error
            if error is not None or entry.dead:
                entry.data = entry.io = None
            self._lock.notify_all()

    # -- the policy's view of the entries (under the lock) ------------------------------------------
    def residence(self, tensor: Entry) -> Residence:
        return tensor.residence()

    def hand_back(self, tensor: Entry) -> None:
        tensor.handed_back = True

    def try_read_ahead(self, tensor: Entry) -> bool:
        lease = self._staging.try_lease(tensor.capture.nbytes, self._returned)
        if lease is None:
            return False
        self._start_read(tensor, lease)
        return True

    def drop(self, tensor: Entry) -> None:
        self._stats["dropped_read_ahead_bytes"] += tensor.capture.nbytes
        tensor.drop()

    # -- room in staging memory -------------------------------------------------------------------
    def _lease(self, nbytes: int, step: Step, wanted: Entry | None = None) -> Lease | None:
        """Staging memory for ``nbytes``, room made as ``step``'s policy says: for a save, or for
        the entry backward is waiting for (``wanted``); then by taking fresh pages where buffers in
        use split up the free ones. None when nothing the offloader does can make room."""
        with self._lock:
            while True:
                lease = self._staging.try_lease(nbytes, self._returned)
                if lease is None:
                    writing, reading = self._writes_in_flight > 0, self._reads_in_flight > 0
                    room = (
                        step.policy.room_to_save(writing=writing)
                        if wanted is None
                        else step.policy.room_to_read(
                            self, step.reads, wanted, writing=writing, reading=reading
                        )
                    )
                    if room is Room.DROPPED:
                        continue
                    if room is Room.WAIT:
                        self._lock.wait()
                        continue
                    lease = self._staging.try_lease(nbytes, self._returned, fresh_pages=True)
                if lease is not None:
                    self._note_resident()
                    return lease
                if not self._lock.wait(OUT_OF_ROOM_WAIT_S):
                    self._warn_overflow(nbytes)
                    return None

    def _warn_overflow(self, nbytes: int) -> None:
        """Say once that the budget is too small for what is held at once (under the lock)."""
        if self._warned:
            return
        self._warned = True
        held = self._staging.pool.in_use_bytes
        warnings.warn(
            f"ActivationOffload: {nbytes} more bytes of saved tensors are needed while {held} bytes "
            f"of the budget ({self._staging.budget}) are held by tensors autograd is still using (one "
            "backward operation needs them all at once, or a graph built with create_graph=True "
            f"keeps them); they go to ordinary memory (stats()['overflow_bytes']). A budget of at "
            f"least {held + nbytes} bytes keeps them within it.",
            RuntimeWarning,
            stacklevel=2,
        )

    def _returned(self) -> None:
        """Staging memory came back (autograd or the store let go of a tensor over it)."""
        with self._lock:
            self._lock.notify_all()

    def _note_resident(self) -> None:
        resident = self._staging.pool.in_use_bytes
        self._stats["peak_resident_bytes"] = max(self._stats["peak_resident_bytes"], resident)
        self._stats["step_peak_resident_bytes"] = max(self._stats["step_peak_resident_bytes"], resident)

    # -- the store --------------------------------------------------------------------------------
    def _run(
        self,
        entry: Entry,
        start: Callable[[], Future[Any]],
        finished: Callable[[Entry, BaseException | None], None],
    ) -> None:
        """Start a store operation for ``entry``; ``finished`` gets its error (None when it
        succeeds), also when it fails to start."""
        try:
            future = start()
        except BaseException as error:
            finished(entry, error)
            return
        future.add_done_callback(lambda done: finished(entry, done.exception()))

    def delete(self, entry: Entry) -> None:
        """Delete the entry's store object in the background (under the lock)."""
        if not entry.written:
            return
        entry.written = False
        self._stats["deleted_objects"] += 1

        def delete() -> None:
            with contextlib.suppress(StoreClosedError):  # a closed store has let go of it already
                self._store.delete(entry.key)

        # Shut down, or the interpreter is exiting: a scratch store deletes its objects when it
        # closes, and a persistent one collects scratch objects when it next opens.
        with contextlib.suppress(RuntimeError):
            self._background.submit(delete)

    def wait_for_io(self) -> None:
        """Wait until no write or read is in flight."""
        with self._lock:
            self._lock.wait_for(lambda: self._writes_in_flight == 0 and self._reads_in_flight == 0)
