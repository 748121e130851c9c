"""Admission and reads: the offloader's staging memory, the captures it writes to the store, and the
bytes it reads back for backward, each decision taken by the step's `SpillPolicy`; for saved tensors
of a device, also the device memory they hold and their copies to and from it.

All host memory comes from one [`StagingArea`][] of ``budget`` bytes: captures being written,
captures kept, and bytes read back ahead of backward or being used by it. A tensor rebuilt for
backward shares its staging memory, which returns when autograd lets go of the tensor. When the
policy can make no room (tensors rebuilt earlier are still held outside the offloader), a save stays
where autograd keeps it and a read goes to ordinary memory instead of waiting for ever;
``overflow_bytes`` counts those bytes.

Device memory the offloader holds is bounded by ``device_budget`` (`device_budget`); the lifetime of
every buffer and event of a saved tensor of a device is in `cuda`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import torch

from ..buffers import Lease
from ..device import DeviceCopies, Transfer
from ..errors import ConfigError, StoreClosedError
from ..namespaces import NamespaceClaim
from ..staging import StagingArea
from ..store import TierStore
from . import cuda
from .capture import Capture, copy_out
from .device_budget import DeviceBudget
from .entries import DeviceTimes, Entry, Step
from .spill_policy import Placement, Residence, Room

OUT_OF_ROOM_WAIT_S = 0.05
"""How long a save or a read waits for memory that nothing in flight will free (tensors rebuilt
earlier and still held) before it overflows to ordinary memory instead."""


class Transfers:
    """Captures into staging memory, their writes, the reads back, the copies to and from a
    device, and the room they need.

    It is the `SpilledTensors` of every step: the policy names entries, and this carries its
    decisions out.

    Args:
        store: where spilled captures go (as scratch objects).
        claim: the offloader's namespace: the spilled objects' keys.
        staging: the host memory of every capture and read (its budget is the offloader's).
        lock: the offloader's lock (reentrant), notified whenever memory or I/O in flight changes.
        stats: the offloader's counters (updated under ``lock``).
        background: runs deletions and waits for device copies, off the caller's thread.
        device: the copies between devices and staging memory (`cuda`).
        device_budget: the most device memory, in bytes, the offloader holds at once.
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
        device_budget: int,
    ) -> None:
        self._store = store
        self._claim = claim
        self._serials = itertools.count()
        self._staging = staging
        self._lock = lock
        self._stats = stats
        self._background = background
        self._device = device
        self._device_memory = DeviceBudget(device_budget, lock, stats, device)
        self._writes_in_flight = 0
        self._writing_bytes = 0
        self._reads_in_flight = 0
        self._advancing = False
        self._to_advance: deque[Step] = deque()
        """Steps whose reads and copies back to advance (a copy ending while they advance asks
        for another round)."""
        self._warned = False

    # -- forward: admission and writes ------------------------------------------------------------
    def admit(
        self,
        step: Step,
        tensor: torch.Tensor,
        capture: Capture,
        storage: torch.UntypedStorage,
        device: torch.device | None,
    ) -> Entry | None:
        """Take ``tensor`` (of ``device``; None for host memory) as the step's policy places it:
        captured into staging memory (and written to the store if spilled), or left on its
        device; None if no room can be made (it stays as autograd keeps it)."""
        if not self._staging.fits(capture.nbytes):
            raise ConfigError(
                f"budget: {self._staging.budget} bytes cannot hold one saved tensor of {capture.nbytes} "
                f"bytes ({tensor.type()} {list(tensor.shape)}); raise budget, or min_bytes above it"
            )
        if device is not None:
            self._device_memory.check_fits(capture.nbytes, tensor)
        with self._lock:
            placement = step.place(capture.nbytes, tensor.dtype, device=device is not None)
        if placement is Placement.DEVICE and capture.start is None:
            placement = Placement.HOST  # a view with gaps cannot be rebuilt from its storage's bytes
        stalled = time.perf_counter()
        lease: Lease | None = None
        if device is not None and not self._device_memory.reserve(capture.nbytes):
            return None  # tensors left on the device fill the budget: it stays as autograd keeps it
        if placement is not Placement.DEVICE:
            if device is not None:
                with self._device.runtime.using(device):  # where the pool's memory is pinned
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
            if lease is None and placement is not Placement.DEVICE:
                if device is not None:
                    self._device_memory.give_back(capture.nbytes)
                return None
        entry = Entry(
            step=step,
            index=len(step.entries),
            key=self._claim.key(str(next(self._serials))),
            capture=capture,
            dtype=tensor.dtype,
            device=device,
            storage=weakref.ref(storage),
            saved_at=step.now(),
            spill=placement is Placement.STORAGE,
        )
        if lease is not None:
            entry.data, entry.io = lease
        if device is None:  # nobody else sees the entry yet: copied outside the lock
            assert entry.data is not None
            copy_out(tensor, capture, entry.data)
        with self._lock:
            step.add(entry)
            self._stats["step_saved_bytes"] += capture.nbytes
            if device is not None:
                self._take_from_device(step, entry, tensor, device, placement)
            if placement is Placement.HOST and (device is None or step.policy.planned):
                self._stats["kept_bytes"] += capture.nbytes
            if entry.spill:
                self._start_write(entry)
            return entry

    def _take_from_device(
        self, step: Step, entry: Entry, tensor: torch.Tensor, device: torch.device, placement: Placement
    ) -> None:
        """Start the copy of a device tensor's capture to host memory, or leave it on the device
        (under the lock, on the thread that runs forward)."""
        entry.device_bytes = entry.capture.nbytes
        mark = self._mark(device)
        if step.device is None:
            step.device, step.times = device, DeviceTimes(origin=mark)
        entry.saved_event = mark
        saved = tensor.detach()  # its storage and version counter, without autograd's graph
        entry.tracked, entry.version = saved, saved._version
        if placement is Placement.DEVICE:
            entry.source = cuda.kept_bytes(tensor, entry.capture)
            entry.on_device = True
            self._stats["device_kept_bytes"] += entry.capture.nbytes
            return
        assert entry.data is not None
        snapshot = cuda.needs_snapshot(tensor)
        if snapshot:
            self._stats["snapshot_bytes"] += entry.capture.nbytes
        version = entry.version
        entry.copying = True
        entry.copied, entry.source = cuda.to_host(
            self._device,
            device,
            saved,
            entry.capture,
            entry.data,
            on_end=lambda: self._copied_out(entry, saved, version),
            snapshot=snapshot,
        )
        self._device_memory.copying_out(entry, entry.copied)
        self._stats["host_bytes"] += entry.capture.nbytes
        # Its memory back promptly: the background thread reaps the copy once it has ended.
        self._background.submit(self._device.wait, entry.copied)

    def _copied_out(self, entry: Entry, tensor: torch.Tensor, version: int) -> None:
        """A copy to host memory has ended: check that no tracked write reached the saved tensor
        before, and let go of its device memory unless the entry stays on the device."""
        with self._lock:
            entry.copying = False
            if tensor._version != version:
                entry.modified = tensor._version
            transfer = self._device_memory.copied_out(entry)
            traffic = entry.step.traffic
            traffic.to_host_bytes += entry.capture.nbytes
            if transfer is not None and transfer.seconds is not None:
                traffic.to_host_seconds += transfer.seconds
            if not entry.on_device or entry.dead:
                entry.source = entry.tracked = None
            elif not entry.spill:
                entry.drop()  # it stays on the device: the host copy is not needed
            self._device_memory.release(entry)
            self._lock.notify_all()

    def end_forward(self, step: Step) -> None:
        """Forward of ``step`` is over and did not fail (under the lock): a device tensor whose copy
        to host memory has not ended stays on the device (its copy back would come right after),
        and backward's reads and copies back start."""
        if step.times is not None and step.device is not None:
            step.times.forward_end = self._mark(step.device)
        for entry in step.entries:
            if entry.copying and entry.source is not None:
                entry.on_device = True
                self._stats["device_kept_bytes"] += entry.capture.nbytes
        self.read_ahead(step)

    def _start_write(self, entry: Entry) -> None:
        """Write the entry's capture to the store in the background (under the lock)."""
        data, copied = entry.io, entry.copied
        assert data is not None
        entry.writing = True
        self._writes_in_flight += 1
        self._writing_bytes += entry.capture.nbytes
        self._stats["spilled_bytes"] += entry.capture.nbytes
        self._stats["spilled_tensors"] += 1

        def put() -> Future[None]:
            if copied is not None:  # a device's: the bytes are in host memory once the copy has ended
                self._device.wait(copied)
            return self._store.put(entry.key, data, scratch=True)

        if copied is None:
            self._run(entry, put, self._write_done)
        else:
            self._background.submit(self._run, entry, put, self._write_done)

    def _write_done(self, entry: Entry, error: BaseException | None) -> None:
        with self._lock:
            entry.writing = False
            self._writes_in_flight -= 1
            self._writing_bytes -= entry.capture.nbytes
            if error is not None:  # the capture stays in memory: backward still gets it
                entry.error = error
                self._stats["write_errors"] += 1
            else:
                entry.written = True
                entry.step.traffic.written_bytes += entry.capture.nbytes
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
        for now, and copies back to the device for as many as the device budget has room for
        (under the lock). A copy ending calls it again, on the thread that sees it end, which may
        be inside a running call: that call then only asks the running one for another round."""
        if step not in self._to_advance:
            self._to_advance.append(step)
        if self._advancing:
            return
        self._advancing = True
        try:
            while self._to_advance:
                advancing = self._to_advance.popleft()
                advancing.reads.advance(self)
                self._restore_ahead(advancing)
        finally:
            self._advancing = False

    def _restore_ahead(self, step: Step) -> None:
        """Copy entries back to the device in the policy's order while their host bytes are there
        and the device budget has room (under the lock)."""
        if step.device is None or not step.forward_done:
            return
        while step.restore_cursor < len(step.restores):
            entry = step.restores[step.restore_cursor]
            if not (
                entry.dead
                or entry.used_at is not None
                or entry.on_device
                or entry.restored is not None
                or entry.error is not None
            ):
                if entry.data is None or entry.reading:
                    return  # its read brings its bytes, and calls this again
                if not self._device_memory.has_room(entry.capture.nbytes):
                    return  # a use hands a restored tensor over, and calls this again
                self._device_memory.take(entry.capture.nbytes)
                entry.restored, entry.restoring = self._copy_back(entry, ahead=True)
            step.restore_cursor += 1

    def _copy_back(self, entry: Entry, *, ahead: bool) -> tuple[torch.Tensor, Transfer]:
        """Start copying the entry's host bytes into new device memory (under the lock)."""
        assert entry.data is not None and entry.device is not None
        restored, transfer = self._device.fetch(
            entry.data, entry.device, on_end=lambda: self._copied_back(entry), timed=True
        )
        self._stats["restored_bytes"] += entry.capture.nbytes
        if ahead:  # its memory back promptly (a copy made at the use is waited for by its user)
            self._background.submit(self._device.wait, transfer)
        return restored, transfer

    def _copied_back(self, entry: Entry) -> None:
        """A copy back to the device has ended: a spilled entry's host bytes are let go of (the
        store still holds them), making room for the next read."""
        with self._lock:
            traffic = entry.step.traffic
            traffic.to_device_bytes += entry.capture.nbytes
            transfer = entry.restoring
            if transfer is not None and transfer.seconds is not None:
                traffic.to_device_seconds += transfer.seconds
            if entry.spill and entry.written and not entry.reading:
                entry.drop()
            self.read_ahead(entry.step)
            self._lock.notify_all()

    def restore(self, entry: Entry, what: str) -> torch.Tensor:
        """A device entry's captured bytes on its device, ready for the calling thread's current
        stream: left there, copied back ahead, or copied back now. ``what`` names the saved
        tensor in the error raised if its bytes are lost."""
        device = entry.device
        assert device is not None
        with self._lock:
            if entry.on_device and entry.source is not None:
                self._mark_use(entry, device, None, None)
                return entry.source
            restored, transfer = entry.restored, entry.restoring
        if restored is None or transfer is None:
            self.bytes_for(entry, what)
            with self._lock:
                if entry.restored is None:  # (another handle's use may have brought it meanwhile)
                    self._device_memory.take(entry.capture.nbytes)
                    entry.restored, entry.restoring = self._copy_back(entry, ahead=False)
                restored, transfer = entry.restored, entry.restoring
                assert restored is not None and transfer is not None
        with self._lock:
            self._mark_use(entry, device, restored, transfer)
        return restored

    def served(self, entry: Entry) -> None:
        """Every handle autograd holds on the entry has been unpacked (under the lock): the bytes
        copied back to its device are autograd's now (a retained graph's next backward copies
        them back again)."""
        if entry.restored is not None:
            entry.restored = None
            self._device_memory.give_back(entry.capture.nbytes)

    def _mark_use(
        self, entry: Entry, device: torch.device, restored: torch.Tensor | None, transfer: Transfer | None
    ) -> None:
        """The use of a device entry by the calling thread's current stream (under the lock): it
        waits for the copy back (``transfer``, if any) there, between two timed events that
        measure the stall."""
        step = entry.step
        before = self._mark(device)
        if entry.used_event is None:
            entry.used_event = before
        if restored is not None and transfer is not None:
            self._device.hand_over(restored, transfer, device)
            if step.times is not None:
                step.times.stalls.append((before, self._mark(device)))

    def bytes_for(self, entry: Entry, what: str) -> torch.Tensor:
        """The entry's captured bytes in host memory: still in memory (forwarded), read ahead, or
        read now. ``what`` names the saved tensor in the error raised if its bytes are lost."""
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
        entry.step.traffic.read_bytes += entry.capture.nbytes
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
            elif entry.device is not None:
                self.read_ahead(entry.step)  # its copy back to the device can start
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

    # -- the end of an entry (under the lock) -------------------------------------------------------
    def let_go(self, entry: Entry) -> None:
        """No handle will ask for the entry again: its memory, host and device, goes (held by
        copies in flight until they end)."""
        if not entry.reading:
            entry.drop()
        entry.source = entry.tracked = None
        if entry.restored is not None:
            entry.restored = None
            self._device_memory.give_back(entry.capture.nbytes)
        self._device_memory.release(entry)
        if not entry.writing:
            self.delete(entry)

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
                    if wanted is None:
                        spillable = (
                            step.device is not None
                            and self._writing_bytes < 2 * nbytes
                            and self._oldest_kept(step) is not None
                        )
                        room = step.policy.room_to_save(writing=writing, spillable=spillable)
                    else:
                        room = step.policy.room_to_read(
                            self, step.reads, wanted, writing=writing, reading=reading
                        )
                    if room is Room.DROPPED:
                        continue
                    if room is Room.SPILL:
                        kept = self._oldest_kept(step)
                        assert kept is not None
                        kept.spill = True
                        self._start_write(kept)
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

    @staticmethod
    def _oldest_kept(step: Step) -> Entry | None:
        """The oldest capture of a device the step keeps in host memory and could spill."""
        for entry in step.entries:
            if (
                entry.device is not None
                and not entry.spill
                and not entry.on_device
                and entry.data is not None
                and not entry.dead
                and entry.used_at is None
                and entry.error is None
            ):
                return entry
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

    @property
    def device_held(self) -> int:
        """Device memory the offloader holds now."""
        return self._device_memory.held

    def _mark(self, device: torch.device) -> object:
        """A timed event on the calling thread's current stream on ``device``."""
        runtime = self._device.runtime
        with runtime.using(device):
            return runtime.record_timed(runtime.current_stream(device))

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
