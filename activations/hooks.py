"""The saved-tensor hooks and the lifetimes of what autograd keeps.

``pack`` runs in forward for every tensor an operation saves and returns a `Handle`; ``unpack`` runs
in backward and returns the tensor. Parameters and views of them, tensors under ``min_bytes`` and
tensors without plain memory of their own stay as autograd keeps them, and so, with the
``checkpoint-inputs`` scope, does every tensor saved outside the inputs of a checkpointed region
(`SavedTensorHooks.region_inputs`); the others are captured (`capture`), two saves of the same bytes
sharing one capture. Each capture lives exactly as long as autograd's handles to it (a retained
graph reads it again): its memory and its store object go once the graph frees them, after backward
or when a failed step's graph is dropped.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from ..device_runtime import DeviceRuntime
from .capture import DEVICE_ALIGN, HOST_ALIGN, View, capture_of, rebuild, view_of
from .entries import Entry, Step
from .transfers import Transfers


class Handle:
    """What autograd keeps for one saved tensor: its entry, or the tensor itself (``alias``)."""

    __slots__ = ("__weakref__", "alias", "dtype", "entry", "size", "tensor", "type_name", "version", "view")

    def __init__(self, tensor: torch.Tensor, entry: Entry | None = None, view: View | None = None) -> None:
        self.entry = entry
        self.view = view
        self.dtype = tensor.dtype
        self.size = list(tensor.shape)
        self.version = tensor._version
        self.type_name = tensor.type()
        self.tensor = weakref.ref(tensor)
        """While the saved tensor lives, an in-place change to it must fail backward."""
        self.alias = tensor.detach() if entry is None else None
        """Tensors kept as they are (small ones, parameters) are held here."""

    def check_version(self) -> None:
        """Raise as autograd does when a saved tensor was modified in place (with hooks active,
        autograd no longer checks by itself): by now, or, for a device's, before its copy to
        host memory ended."""
        tensor = self.alias if self.alias is not None else self.tensor()
        current = self.version if tensor is None else tensor._version
        if current == self.version and self.entry is not None:
            current = self.entry.version_now() or current
        if current != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{self.type_name} {self.size}] is at version {current}; "
                f"expected version {self.version} instead (detected by tierstore.activations)"
            )


class SavedTensorHooks:
    """``pack`` and ``unpack`` for `torch.autograd.graph.saved_tensors_hooks`, and the end of each
    entry's life.

    Args:
        transfers: captures, writes and reads, and the copies to and from a saved tensor's
            device.
        lock: the offloader's lock.
        stats: the offloader's counters (updated under ``lock``).
        runtime: the device runtime, which tells device memory from host memory.
        min_bytes: smaller saved tensors stay as autograd keeps them.
        keep_all: every saved tensor stays as autograd keeps them (plan ``"none"``): only counted.
        checkpoint_inputs: only the inputs of checkpointed regions are taken (scope
            ``"checkpoint-inputs"``); every other saved tensor stays as autograd keeps it.
    """

    def __init__(
        self,
        transfers: Transfers,
        lock: threading.Condition,
        stats: dict[str, float],
        runtime: DeviceRuntime,
        *,
        min_bytes: int,
        keep_all: bool,
        checkpoint_inputs: bool,
    ) -> None:
        self._transfers = transfers
        self._lock = lock
        self._stats = stats
        self._runtime = runtime
        self._min_bytes = min_bytes
        self._keep_all = keep_all
        self._checkpoint_inputs = checkpoint_inputs
        self._regions = threading.local()
        """Per thread: how many checkpointed regions are being entered (their inputs saved)."""

    def for_step(self, step: Step) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks of one forward: what it saves goes to ``step``."""
        return torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, step), self._unpack)

    @contextlib.contextmanager
    def region_inputs(self) -> Iterator[None]:
        """What the calling thread saves inside the block are the inputs of a checkpointed region
        (``torch.utils.checkpoint`` saves them outside the region, through these hooks, and what
        the region itself saves through hooks of its own)."""
        self._regions.depth = getattr(self._regions, "depth", 0) + 1
        try:
            yield
        finally:
            self._regions.depth -= 1

    def kill(self, entry: Entry) -> None:
        """No handle will ask for the entry again: free its memory and object (under the lock)."""
        entry.dead = True
        self._transfers.let_go(entry)

    def _pack(self, step: Step, tensor: torch.Tensor) -> Handle:
        if not _spillable(tensor):
            if _is_parameter(tensor):
                self._count("parameter_bytes", tensor.untyped_storage().nbytes())
            return Handle(tensor)
        device = self._runtime.device_of(tensor)
        capture = capture_of(tensor, HOST_ALIGN if device is None else DEVICE_ALIGN)
        if self._checkpoint_inputs and not getattr(self._regions, "depth", 0):
            self._count("outside_checkpoint_bytes", capture.nbytes)
            return Handle(tensor)
        if self._keep_all or capture.nbytes < self._min_bytes:
            self._count("kept_bytes" if self._keep_all else "small_bytes", capture.nbytes)
            return Handle(tensor)
        storage = tensor.untyped_storage()
        identity = (storage._cdata, *capture.identity)
        with self._lock:
            entry = step.captures.get(identity)
            if entry is not None and not entry.dead and entry.storage() is storage:
                self._stats["deduplicated_bytes"] += capture.nbytes
                return self._handle(tensor, entry)
        entry = self._transfers.admit(step, tensor, capture, storage, device)
        if entry is None:  # no room: it stays as autograd keeps it
            self._count("overflow_bytes", capture.nbytes)
            return Handle(tensor)
        with self._lock:
            step.captures[identity] = entry
            return self._handle(tensor, entry)

    def _handle(self, tensor: torch.Tensor, entry: Entry) -> Handle:
        """A handle on ``entry`` for ``tensor`` (under the lock); freed by autograd in its time."""
        entry.handles += 1
        handle = Handle(tensor, entry, view_of(tensor, entry.capture))
        weakref.finalize(handle, self._handle_gone, entry, id(handle)).atexit = False
        return handle

    def _unpack(self, handle: Handle) -> torch.Tensor:
        handle.check_version()
        entry, view = handle.entry, handle.view
        if entry is None or view is None:
            assert handle.alias is not None
            return handle.alias
        what = f"{handle.type_name} {handle.size}"
        if entry.device is None:
            data = self._transfers.bytes_for(entry, what)
        else:
            data = self._transfers.restore(entry, what)
        restored = rebuild(data, handle.dtype, view)
        with self._lock:
            entry.unpacked.add(id(handle))
            if entry.served():
                self._transfers.served(entry)
                if entry.spill and entry.written:
                    entry.drop()  # every handle served; a retained graph reads it again
            step = entry.step
            if entry.used_at is None:
                entry.used_at = step.last_use = step.now()
            self._transfers.read_ahead(step)
        return restored

    def _handle_gone(self, entry: Entry, handle_id: int) -> None:
        """Autograd freed a handle; the last one takes the entry's memory and object with it."""
        with self._lock:
            entry.handles -= 1
            entry.unpacked.discard(handle_id)
            if entry.handles <= 0 and not entry.dead:
                self.kill(entry)

    def _count(self, counter: str, nbytes: int) -> None:
        with self._lock:
            self._stats[counter] += nbytes


def _is_parameter(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base, nn.Parameter)


def _spillable(tensor: torch.Tensor) -> bool:
    """Plain dense CPU or CUDA tensors with elements that are not parameters (nor views of them);
    lazily conjugated or negated views keep their memory unchanged behind a flag, and tensor
    subclasses (an FSDP2 DTensor among them) may have no memory of their own: those stay as they
    are."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and tensor.device.type in ("cpu", "cuda")
        and tensor.numel() > 0
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not _is_parameter(tensor)
    )
