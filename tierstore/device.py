"""Copies between host memory and a device, in order with the caller's streams.

The store (``put`` of a CUDA tensor, ``get`` into one or onto a device), activation offload and
checkpoint staging copy between host memory and GPUs through one kind of object, a
[`DeviceCopies`][]. What it guarantees:

**Ordering.** CUDA runs the work of one stream in order and the work of different streams in any
order. A tensor handed over may still be written by kernels queued on the caller's current stream
(a side stream of FSDP, DeepSpeed or the user's), and memory to be filled may still be read by
kernels queued before the call. So:

* at the call, on the caller's thread, an event is recorded on its current stream
  ([`DeviceCopies.caller`][] returns it as a [`CallerStream`][]);
* every copy runs on the device's copy stream (one per device, made at its first copy), which first
  waits for that event: it reads or writes the caller's memory only after the work the caller
  queued before the call;
* a copy to a device ends with an event that the caller's stream waits for: the work the caller
  queues once the copy is reported done (the store's future resolved) runs after it;
* a copy *ahead of* a use ([`DeviceCopies.fetch`][]: activation offload's read-ahead) fills new
  memory of the copy stream and waits for no other stream, whose work cannot touch memory the copy
  stream has just allocated; the stream that uses it waits for the copy's end event only at the use
  ([`hand_over`][tierstore.device.DeviceCopies.hand_over]), which also tells the caching allocator
  that this stream uses the memory (``record_stream``): freed, it is reused only after that stream's
  work.

The copy stream is not the caller's, so copies overlap its kernels. The host waits only in
[`DeviceCopies.wait`][], [`download`][tierstore.device.DeviceCopies.download],
[`upload`][tierstore.device.DeviceCopies.upload] and [`close`][tierstore.device.DeviceCopies.close],
on the thread that calls them (a store worker, a workload's background thread): a stream never waits
for the host.

**Lifetimes.** Each copy is a [`Transfer`][]: its end event and every tensor it reads or writes
(pinned host buffers, device temporaries, the caller's tensors), held until the event has completed,
so that no memory is freed, reused by torch's caching allocator or returned to its pool while a DMA
may still touch it; its ``on_end`` callbacks run then. [`DeviceCopies.reap`][] lets go of the
transfers that have ended without waiting (an event query); it runs at every new copy.

**Staging.** [`download`][tierstore.device.DeviceCopies.download] and
[`upload`][tierstore.device.DeviceCopies.upload] move a tensor of any size through a few pinned
pieces ([`PinnedPieces`][], `PIECE_BYTES` each, reserved from the store's memory ledger at its first
device copy): while one piece crosses the bus the other is copied to or from ordinary host memory. A
piece goes back to be lent again only once its copy has ended.

**Page-locked memory.** A DMA needs host memory the kernel cannot move: `buffers` page-locks its
maps with [`lock_pages`][] when (and only when) a workload asks for pinned memory, on the calling
thread's current device (a device copy's thread makes the copy's device current first, so no other
device's context is ever made), and never touches CUDA otherwise. A failed page-lock is a
[`PinnedMemoryError`][] naming the size and the limits (``ulimit -l``, ``vm.max_map_count``), and it
leaves no CUDA error behind for torch's next kernel launch to report. Each pinned map is unlocked
exactly once (a finalizer, whatever the order of release) and is not inherited by a forked child
(``MADV_DONTFORK``), so a fork (DataLoader workers) cannot move a page under a DMA.

The device runtime is a small protocol, [`DeviceRuntime`][]: CUDA's through torch
([`CudaRuntime`][], the default), or a simulation whose copies complete only when a test says so
([`tierstore.testing.device.SimulatedDevice`][]).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .buffers import AlignedBuffer
from .device_runtime import CUDA, CudaRuntime, DeviceRuntime, lock_pages
from .staging import StagingArea

__all__ = [
    "CUDA",
    "PIECES",
    "PIECE_BYTES",
    "CallerStream",
    "CudaRuntime",
    "DeviceCopies",
    "DeviceRuntime",
    "PinnedPieces",
    "Transfer",
    "lock_pages",
]

PIECE_BYTES = 4 << 20
"""Bytes of one pinned piece that device copies are staged through: large enough that a copy's
fixed cost is small beside its transfer, small enough that a few cost nothing."""
PIECES = 2
"""Pinned pieces of a store: one crosses the bus while the other is filled or emptied."""


@dataclass(frozen=True)
class CallerStream:
    """The caller's place on its stream at a call: copies made for the call start after
    ``event``, and a copy to the device makes ``stream`` wait for its end."""

    device: torch.device
    stream: object
    """The caller's current stream on ``device`` at the call."""
    event: object
    """Recorded on ``stream`` at the call; held until the call's copies are queued."""


class Transfer:
    """A copy queued on a copy stream, and the memory it touches, held until it has ended.

    Args:
        end: the event recorded on the copy stream after the copy.
        held: every tensor the copy reads or writes (and any other object to keep alive as long):
            let go of once ``end`` has completed, never before.
        on_end: called once ``end`` has completed (give a staging buffer back to its pool).
        start: for a timed copy, the timed event recorded on the copy stream just before it (the
            copy's own time, not its wait for the caller's work, lies between ``start`` and
            ``end``); None otherwise.
    """

    __slots__ = ("_held", "_on_end", "end", "seconds", "start")

    def __init__(
        self,
        end: object,
        held: tuple[object, ...],
        on_end: Callable[[], None] | None,
        start: object | None = None,
    ) -> None:
        self.end = end
        self.start = start
        self.seconds: float | None = None
        """A timed copy's duration on the device's clock, once it has ended and been reaped."""
        self._held = held
        self._on_end = on_end

    def _finish(self, runtime: DeviceRuntime) -> None:
        """Take a timed copy's duration, let go of the memory and run ``on_end`` (once the end
        event has completed; once)."""
        if self.start is not None and self.seconds is None:
            self.seconds = runtime.elapsed(self.start, self.end)
        self._held = ()
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()


class DeviceCopies:
    """One copy stream per device, the copies queued on it and the memory they hold (see the
    module docstring).

    Args:
        runtime: the device runtime; default CUDA's.
        staging: makes the pinned memory that [`download`][] and [`upload`][] stage through, from
            its size in bytes and the runtime that page-locks it: called at the first of them (with
            its device current); None for a user that copies only between memory it has.
    """

    def __init__(
        self,
        runtime: DeviceRuntime | None = None,
        *,
        staging: Callable[[int, DeviceRuntime], StagingArea] | None = None,
    ) -> None:
        self.runtime: DeviceRuntime = CUDA if runtime is None else runtime
        self._staging = staging
        self._pieces: PinnedPieces | None = None
        self._streams: dict[torch.device, object] = {}
        self._in_flight: list[Transfer] = []
        self._lock = threading.Lock()

    # -- at the call, on the caller's thread ---------------------------------------------------------
    def caller_of(self, tensor: torch.Tensor) -> CallerStream | None:
        """[`caller`][] on the device holding ``tensor``; None for a tensor in host memory."""
        device = self.runtime.device_of(tensor)
        return None if device is None else self.caller(device)

    def caller(self, device: torch.device) -> CallerStream:
        """Record an event on the calling thread's current stream on ``device``: call it on the
        caller's thread at the call, before returning to it.

        Args:
            device: the device of the tensor the call reads or fills.

        Returns:
            The caller's stream and the event; give it to every copy made for the call.
        """
        device = self.runtime.resolve(device)
        with self.runtime.using(device):
            stream = self.runtime.current_stream(device)
            return CallerStream(device, stream, self.runtime.record(stream))

    def empty(self, shape: Sequence[int], dtype: torch.dtype, caller: CallerStream) -> torch.Tensor:
        """Device memory to return to the caller, belonging to the caller's stream (which waits for
        the copies into it, so its later reuse there is ordered after them).

        Args:
            shape: its shape.
            dtype: its dtype.
            caller: from [`caller`][].

        Returns:
            An uninitialised tensor on ``caller.device``.
        """
        with self.runtime.using(caller.device):
            return self.runtime.empty(shape, dtype, caller.device, caller.stream)

    # -- copies ------------------------------------------------------------------------------------
    def copy(
        self,
        destination: torch.Tensor,
        source: torch.Tensor,
        caller: CallerStream,
        *,
        hold: tuple[object, ...] = (),
        on_end: Callable[[], None] | None = None,
        timed: bool = False,
    ) -> Transfer:
        """Queue ``destination.copy_(source)`` on the copy stream of ``caller.device``, after the
        work the caller had queued at the call. Returns at once.

        Args:
            destination: where the bytes go (host or device memory, any strides).
            source: where they come from.
            caller: from [`caller`][], at the call this copy serves.
            hold: more objects to keep alive until the copy has ended.
            on_end: called once the copy has ended (by [`reap`][], [`wait`][] or [`close`][]).
            timed: take the copy's duration on the device's clock (``Transfer.seconds``), for a
                workload that measures the bus.

        Returns:
            The transfer, which holds ``destination``, ``source`` and ``hold`` until it has ended.
        """
        self.reap()
        with self.runtime.using(caller.device):
            stream = self._stream(caller.device)
            self.runtime.wait(stream, caller.event)
            transfer = self._queue(stream, destination, source, (destination, source, *hold), on_end, timed)
        with self._lock:
            self._in_flight.append(transfer)
        return transfer

    def fetch(
        self,
        source: torch.Tensor,
        device: torch.device,
        *,
        on_end: Callable[[], None] | None = None,
        timed: bool = False,
    ) -> tuple[torch.Tensor, Transfer]:
        """Copy host memory into new device memory ahead of its use: memory of the copy stream,
        filled there at once, after no work of any other stream (no other stream's work can touch
        memory the copy stream has just allocated). Returns at once; give the tensor to the stream
        that uses it with [`hand_over`][].

        Args:
            source: host memory (pinned, for the copy to run asynchronously).
            device: where the copy goes.
            on_end: called once the copy has ended, as for [`copy`][].
            timed: as for [`copy`][].

        Returns:
            The new device tensor (``source``'s shape and dtype) and the transfer, which holds
            ``source`` until the copy has ended.
        """
        self.reap()
        device = self.runtime.resolve(device)
        with self.runtime.using(device):
            stream = self._stream(device)
            destination = self.runtime.empty(source.shape, source.dtype, device, stream)
            transfer = self._queue(stream, destination, source, (source,), on_end, timed)
        with self._lock:
            self._in_flight.append(transfer)
        return destination, transfer

    def hand_over(self, tensor: torch.Tensor, transfer: Transfer, device: torch.device) -> None:
        """Give a tensor of [`fetch`][] to the calling thread's current stream: that stream's work
        queued from now on runs after the copy, and the caching allocator reuses the tensor's
        memory, once it is freed, only after that work.

        Args:
            tensor: from [`fetch`][] (or a view of it).
            transfer: the copy that fills it.
            device: its device.
        """
        device = self.runtime.resolve(device)
        with self.runtime.using(device):
            stream = self.runtime.current_stream(device)
            self.runtime.wait(stream, transfer.end)
            self.runtime.record_stream(tensor, stream)

    def _queue(
        self,
        stream: object,
        destination: torch.Tensor,
        source: torch.Tensor,
        held: tuple[object, ...],
        on_end: Callable[[], None] | None,
        timed: bool,
    ) -> Transfer:
        """Queue the copy on ``stream`` (its device current) and its end event; its transfer."""
        start = self.runtime.record_timed(stream) if timed else None
        self.runtime.copy(stream, destination, source)
        end = self.runtime.record_timed(stream) if timed else self.runtime.record(stream)
        return Transfer(end, held, on_end, start)

    def to_device(
        self,
        destination: torch.Tensor,
        source: torch.Tensor,
        caller: CallerStream,
        *,
        on_end: Callable[[], None] | None = None,
    ) -> Transfer:
        """[`copy`][] into device memory that the caller's stream then waits for: its work queued
        from now on runs after the copy.

        Args:
            destination: device memory.
            source: host (or device) memory.
            caller: from [`caller`][]; its stream waits for the copy's end.
            on_end: as for [`copy`][].

        Returns:
            The transfer.
        """
        transfer = self.copy(destination, source, caller, on_end=on_end)
        self.runtime.wait(caller.stream, transfer.end)
        return transfer

    def reap(self) -> None:
        """Let go of every transfer that has ended (an event query each; never waits)."""
        ended: list[Transfer] = []
        with self._lock:
            if not self._in_flight:
                return
            in_flight: list[Transfer] = []
            for transfer in self._in_flight:
                (ended if self.runtime.query(transfer.end) else in_flight).append(transfer)
            self._in_flight = in_flight
        for transfer in ended:
            transfer._finish(self.runtime)

    def wait(self, transfer: Transfer) -> None:
        """Wait on this thread until ``transfer`` has ended, and let go of the transfers that have.

        Args:
            transfer: from [`copy`][] or [`to_device`][].
        """
        self.runtime.synchronize(transfer.end)
        self.reap()

    def synchronize(self) -> None:
        """Wait for every transfer in flight, and let go of them."""
        with self._lock:
            pending = list(self._in_flight)
        for transfer in pending:
            self.runtime.synchronize(transfer.end)
        self.reap()

    def close(self) -> None:
        """Wait for every transfer in flight, let go of them, and give the pinned pieces back (the
        object can still copy afterwards: it makes new ones)."""
        self.synchronize()
        pieces, self._pieces = self._pieces, None
        if pieces is not None:
            pieces.close()

    # -- whole tensors through pinned pieces ------------------------------------------------------
    def download(self, source: torch.Tensor, into: memoryview, caller: CallerStream) -> None:
        """Copy a device tensor's values into host memory through the pinned pieces; returns once
        every byte is in ``into`` (the calling thread waits, never a stream).

        Args:
            source: device memory of any strides; conjugate and negative views give their values.
            into: host memory of the tensor's size: its values laid out contiguous.
            caller: from [`caller`][] at the call: the copies read ``source`` after the work the
                caller queued before it.
        """
        nbytes = into.nbytes
        if nbytes == 0:
            return
        with self.runtime.using(caller.device):
            flat = self._dense_bytes(source, caller)
            target = np.frombuffer(into, dtype=np.uint8)
            with self._lend(nbytes) as (pieces, size):
                in_flight: deque[tuple[Transfer, AlignedBuffer, int, int]] = deque()
                try:
                    for index, offset in enumerate(range(0, nbytes, size)):
                        if len(in_flight) == len(pieces):
                            self._empty_piece(in_flight.popleft(), target)
                        length = min(size, nbytes - offset)
                        piece = pieces[index % len(pieces)]
                        transfer = self.copy(piece.view(length), flat[offset : offset + length], caller)
                        in_flight.append((transfer, piece, offset, length))
                    while in_flight:
                        self._empty_piece(in_flight.popleft(), target)
                finally:  # a piece is lent again only once its copy has ended
                    for transfer, *_ in in_flight:
                        self.runtime.synchronize(transfer.end)
                    self.reap()

    def upload(self, source: memoryview, destination: torch.Tensor, caller: CallerStream) -> None:
        """Copy host bytes into a device tensor through the pinned pieces, and make the caller's
        stream wait for them; returns once the copies have ended.

        Args:
            source: host memory: the tensor's values laid out contiguous.
            destination: device memory of any strides (a conjugate or negative view gets the
                values).
            caller: from [`caller`][] at the call: the copies write ``destination`` after the work
                the caller queued before it, and the caller's stream waits for their end.
        """
        nbytes = source.nbytes
        if nbytes == 0:
            return
        with self.runtime.using(caller.device):
            direct = _dense(destination)
            dense = destination if direct else self._temporary(destination, caller.device)
            flat = dense.reshape(-1).view(torch.uint8)
            host = np.frombuffer(source, dtype=np.uint8)
            with self._lend(nbytes) as (pieces, size):
                in_flight: deque[Transfer] = deque()
                try:
                    for index, offset in enumerate(range(0, nbytes, size)):
                        if len(in_flight) == len(pieces):  # the piece's previous copy first
                            self.wait(in_flight.popleft())
                        length = min(size, nbytes - offset)
                        piece = pieces[index % len(pieces)]
                        np.copyto(piece.array(length), host[offset : offset + length])
                        piece_copy = self.copy(flat[offset : offset + length], piece.view(length), caller)
                        in_flight.append(piece_copy)
                    if not direct:
                        in_flight.append(self.copy(destination, dense, caller))
                    self.runtime.wait(caller.stream, in_flight[-1].end)
                finally:
                    for transfer in in_flight:
                        self.runtime.synchronize(transfer.end)
                    self.reap()

    def _dense_bytes(self, tensor: torch.Tensor, caller: CallerStream) -> torch.Tensor:
        """``tensor``'s values as contiguous bytes on its device: the tensor itself, or a copy made
        on the copy stream (after the caller's work) for strided, conjugate and negative views."""
        if _dense(tensor):
            return tensor.reshape(-1).view(torch.uint8)
        dense = self._temporary(tensor, caller.device)
        self.copy(dense, tensor, caller)
        return dense.reshape(-1).view(torch.uint8)

    def _temporary(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Contiguous device memory of ``like``'s shape and dtype, belonging to the copy stream
        (every copy that touches it is held by a transfer until it has ended)."""
        return self.runtime.empty(like.shape, like.dtype, device, self._stream(device))

    def _empty_piece(self, copied: tuple[Transfer, AlignedBuffer, int, int], target: np.ndarray) -> None:
        """Wait for a piece's copy from the device, then copy the piece to its place in ``target``."""
        transfer, piece, offset, length = copied
        self.wait(transfer)
        np.copyto(target[offset : offset + length], piece.array(length))

    @contextlib.contextmanager
    def _lend(self, nbytes: int) -> Iterator[tuple[list[AlignedBuffer], int]]:
        """Pinned pieces for one copy of ``nbytes`` (made at the first, on the device current
        then), and their size."""
        with self._lock:
            if self._pieces is None:
                assert self._staging is not None, "made without staging memory"
                self._pieces = PinnedPieces(self._staging(PIECES * PIECE_BYTES, self.runtime), PIECE_BYTES)
            pieces = self._pieces
        with pieces.lend(nbytes) as lent:
            yield lent, pieces.piece_bytes

    def _stream(self, device: torch.device) -> object:
        """The copy stream of ``device`` (made at its first copy; ``device`` is current)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams.setdefault(device, self.runtime.new_stream(device))
        return stream


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is its values laid out contiguous (lazily conjugated or negated
    views keep their memory unchanged behind a flag)."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


class PinnedPieces:
    """Equal pinned buffers that copies between host and device memory are staged through, each
    lent to one copy at a time.

    Args:
        staging: pinned memory for ``staging.capacity // piece_bytes`` pieces (its budget reserved
            from the store's ledger); taken whole at once, and closed by [`close`][].
        piece_bytes: the size of each piece.

    Raises:
        PinnedMemoryError: the memory could not be page-locked.
    """

    def __init__(self, staging: StagingArea, piece_bytes: int) -> None:
        self._staging = staging
        self.piece_bytes = piece_bytes
        self._free: list[AlignedBuffer] = []
        self._closed = False
        self._ready = threading.Condition()
        try:
            for _ in range(staging.capacity // piece_bytes):
                piece = staging.try_acquire(piece_bytes)
                assert piece is not None  # the staging area holds exactly these
                self._free.append(piece)
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def lend(self, nbytes: int) -> Iterator[list[AlignedBuffer]]:
        """Pieces for one copy of ``nbytes``: one (waiting until one is free) and, for a copy of more
        than one piece, a second if one is free, so that one crosses the bus while the other is
        filled or emptied. The caller gives each back only once every copy of it has ended."""
        with self._ready:
            self._ready.wait_for(lambda: bool(self._free))
            lent = [self._free.pop()]
            if nbytes > self.piece_bytes and self._free:
                lent.append(self._free.pop())
        try:
            yield lent
        finally:
            with self._ready:
                self._free.extend(lent)
                if self._closed:
                    self._give_back()
                self._ready.notify_all()

    def close(self) -> None:
        """Close the staging area: the free pieces are freed now, a piece still lent once it comes
        back."""
        with self._ready:
            self._closed = True
            self._give_back()
        self._staging.close()

    def _give_back(self) -> None:
        """Release the free pieces to the staging area (under the lock)."""
        for piece in self._free:
            self._staging.release(piece)
        self._free.clear()
