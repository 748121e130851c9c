"""The optimizer-agnostic half of an offloaded optimizer: one step's schedule over staged sub-groups.

An optimizer built on :class:`StagedOptimizer` says only what its per-sub-group state is (how many
fp32 values, laid out how) and how one sub-group is updated. The engine does the rest, the same
for every optimizer:

1. measures the global gradient norm from the low-precision gradients (fp32 accumulation over
   cache-sized pieces, no full fp32 copy), detects overflow (a non-finite norm skips the step,
   leaving all state untouched, as loss scaling expects) and derives one coefficient for
   unscaling and clipping; each parameter counts its own steps, only those on which it has a
   gradient (bias correction, as in torch);
2. visits the sub-groups forward on odd steps and in reverse on even ones (MLP-Offload's
   cache-friendly :func:`~tierstore.optimizer.staging.pass_order`) through a
   :class:`~tierstore.optimizer.staging.SubGroupStager`: read-ahead ring, background write-back,
   and the kept set the I/O model chooses;
3. per sub-group, converts its gradients into one reused fp32 buffer (delayed, in place) and hands
   them to the optimizer's kernel, then copies the new master weights into the model's
   parameters: a cache-sized piece at a time for an element-wise kernel (AdamW), whole parameters
   for one that needs them (APOLLO's projections). No fp32 gradient is ever written to storage;
4. checkpoints the sub-group objects and the step counts into one HDF5 file.

Parameters on a GPU take the device path (:mod:`tierstore.optimizer.device`), chosen at
construction by where the parameters are: the same schedule, the same layouts and kernels, with the
state streamed from the store through pinned host memory to the device a sub-group at a time (or
kept there within ``gpu_budget``), the gradient norm taken on the device (one wait of the host for
it per step), and each sub-group's gradients converted into a device buffer: no gradient leaves the
device. The CPU path is the loop above, untouched by it.

Master weights: a low-precision (bf16, fp16) parameter's fp32 master weights are part of its
sub-group's state, and the model receives them rounded after each update. An fp32 parameter is
its own master: the kernel updates the parameter in place and the state holds no copy of it, so
weights the model is given outside the optimizer (``model.load_state_dict``) are the ones the next
step updates, as with torch's optimizers. Whether a parameter is fp32 is read when its group is
added and lays out its state, so it cannot change afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from abc import abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from .._checks import SIZE_REQUIREMENT, byte_count, is_integer
from ..buffers import aligned_tensor
from ..errors import BufferMismatchError, ConfigError, StoreClosedError, TierStoreError
from ..snapshot import export_hdf5, open_snapshot
from ..store import TierStore
from .device import DEVICE_BLOCK, DeviceStager, device_bytes
from .options import CachePolicy
from .partition import KERNEL_ALIGNMENT, Piece, SubGroup, cut_length, partition, partition_whole
from .staging import FP32, SubGroupStager, pass_order

GRADIENT_CHUNK = 1 << 19
"""fp32 elements converted at a time for the norm and for element-wise kernels (2 MiB: sized so
that, with the state it is combined with, it stays in a CPU's cache)."""

DEVICE_GRADIENT_CHUNK = 1 << 24
"""fp32 elements converted at a time for element-wise kernels on a device (64 MiB: few kernel
launches per sub-group, little device memory beside the slots)."""


class StaleMasterWeightsError(BufferMismatchError):
    """A state dict's or checkpoint's fp32 master weights (``master_param``) that their
    low-precision parameter no longer rounds from: the model's weights changed after the master
    weights were saved (another optimizer trained on, carrying the entry along unchanged, or the
    model's weights were loaded after the optimizer's). Using them would silently revert the
    model's weights at the next step. The message names the parameters and what to do: load the
    model's weights that belong to the optimizer's state first, or drop ``master_param`` from the
    entries to take the parameters as master weights."""


def stale_masters_error(
    source: str, params: list[int], shapes: list[tuple[int, ...]]
) -> StaleMasterWeightsError:
    """The :class:`StaleMasterWeightsError` for ``params`` (their numbers and shapes), whose
    master weights in ``source`` their parameters do not round from."""
    named = ", ".join(
        f"{number} (shape {shape})" for number, shape in zip(params[:5], shapes[:5], strict=True)
    )
    more = f" and {len(params) - 5} more" if len(params) > 5 else ""
    return StaleMasterWeightsError(
        f"{source}: the master_param of parameter {named}{more} is stale: the model's weights do not "
        "round from it (they changed after it was saved, e.g. trained on by another optimizer that "
        "carried master_param along, or loaded after the optimizer's state), and the next step would "
        "revert them to it. Load the model's weights that belong to this state first, or drop "
        "'master_param' from the state entries to take the model's current weights as master weights"
    )


class StagedOptimizer(torch.optim.Optimizer):
    """Base of the offloaded optimizers: one step's schedule over sub-groups staged through a store.

    The number of threads torch's CPU kernels use during a step is by default one fewer than
    torch's setting (at least one), so that a core stays free for the store's I/O threads, which
    move the state while the kernels run.

    The state lives in the store under ``namespace``, which the optimizer claims on the store for
    its lifetime (:class:`~tierstore.optimizer.staging.SubGroupStager`): a second optimizer, or any
    workload, on the same store and namespace is refused with
    :class:`~tierstore.errors.NamespaceInUseError`. The namespace is the optimizer's own choice,
    never generated, because persistent state (snapshots, a persistent store) is found again by
    it. :meth:`close` (or garbage collection) gives the namespace back.

    Parameter groups may be added after construction (:meth:`add_param_group`, as in torch). A
    group's :attr:`LAYOUT_KEYS` fix the layout of its state in the store, so they cannot change
    once the group is added.

    The parameters are all in host memory (the CPU path) or all on one GPU (the device path, see
    the module docstring and :mod:`tierstore.optimizer.device`); whichever the first parameter's
    place is, every later one (added groups included) must share it.

    Args:
        params: the parameters (contiguous tensors, each listed once, all on the CPU or all on one
            GPU) or parameter groups (dicts with ``params`` and hyper-parameter keys), as for
            ``torch.optim.Optimizer``.
        store: the store holding the fp32 state; its device runtime
            (:attr:`~tierstore.TierStore.device_runtime`) makes the device path's copies.
        defaults: the hyper-parameters a group takes for the keys it leaves out.
        sub_group_size: parameter elements per sub-group, the unit staged through DRAM.
        max_grad_norm: clip the global gradient norm to this; None for no clipping.
        dram_budget: bytes of fp32 DRAM the optimizer holds (an int, or text such as ``"64MiB"``):
            read-ahead ring, gradient buffer (CPU path only) and sub-groups kept between steps
            (pinned on the device path); None for the ring and the gradient buffer only.
        prefetch_depth: sub-groups read ahead of the one being updated.
        cache_policy: which sub-groups stay in DRAM between steps: ``"model"`` (the I/O model's
            choice), ``"static"`` (the last that fit) or ``"none"``.
        namespace: the prefix of the state's store keys, claimed on the store.
        whole_params: keep every parameter whole in one sub-group (for kernels that need whole
            parameters) instead of cutting parameters at sub-group boundaries.
        compute_threads: threads torch's CPU kernels use during a step; None for one fewer than
            torch's setting (at least one).
        gpu_budget: bytes of GPU memory for sub-groups that stay on the GPU between steps (an int,
            or text such as ``"4GiB"``; parameters on a GPU only): no copy crosses the bus for
            those. None or 0 for none.

    Raises:
        ConfigError: an argument or hyper-parameter of the wrong type or out of range, a
            parameter listed twice, a ``DTensor`` parameter where :attr:`SHARDED_PARAMETERS`
            refuses them, a namespace that is not a valid key, or a ``gpu_budget`` for parameters
            in host memory; the message names it.
        BufferMismatchError: a parameter that is not a contiguous tensor in host memory or on a
            GPU, or one on another device than the first parameter (the message names it).
        CapacityError: ``dram_budget`` is below the working set (the ring and the gradient
            buffer), or does not fit beside the store's other reservations.
        PinnedMemoryError: parameters on a GPU, and the pinned ring could not be page-locked.
        NamespaceInUseError: ``namespace`` is already claimed on the store.
    """

    LAYOUT_KEYS: ClassVar[tuple[str, ...]] = ()
    """Group keys the layout of a group's state depends on."""

    IMPLEMENTATION_KEYS: ClassVar[tuple[str, ...]] = ()
    """Group keys that name the kernel rather than the training (torch's ``foreach``, ``fused``...):
    a loaded state dict or snapshot describes its saver's kernel with them, so their values are not
    taken from it; each group keeps this optimizer's own."""

    SHARDED_PARAMETERS: ClassVar[str | None] = (
        "its state is laid out over whole parameters; for FSDP2's fully_shard use "
        "tierstore.integrations.fsdp.FSDPOffloadedAdamW, which stages each rank's local shards"
    )
    """Why ``DTensor`` parameters (FSDP2's shards) are refused (a :class:`ConfigError` saying so), or
    None for an optimizer that steps them."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        store: TierStore,
        defaults: dict[str, Any],
        *,
        sub_group_size: int,
        max_grad_norm: float | None,
        dram_budget: int | str | None,
        prefetch_depth: int,
        cache_policy: CachePolicy,
        namespace: str,
        whole_params: bool,
        compute_threads: int | None = None,
        gpu_budget: int | str | None = None,
    ) -> None:
        if not is_integer(sub_group_size) or sub_group_size < 1:
            raise ConfigError(f"sub_group_size: must be a positive integer, got {sub_group_size!r}")
        if max_grad_norm is not None and not (is_real(max_grad_norm) and max_grad_norm > 0.0):
            raise ConfigError(f"max_grad_norm: must be None or a positive number, got {max_grad_norm!r}")
        if compute_threads is not None and (not is_integer(compute_threads) or compute_threads < 1):
            raise ConfigError(f"compute_threads: must be None or an integer >= 1, got {compute_threads!r}")
        self._layouts: list[dict[str, Any]] = []
        """Per group, its :attr:`LAYOUT_KEYS` as they were when it was added."""
        self._own_masters: list[bool] = []
        """Per parameter (in :attr:`params` order), whether it is fp32 and so its own master
        weights (none in the state), as it was when its group was added."""
        gpu_bytes = None if gpu_budget is None else byte_count(gpu_budget)
        if gpu_budget is not None and gpu_bytes is None:
            raise ConfigError(f"gpu_budget: must be {SIZE_REQUIREMENT}, not {gpu_budget!r}")
        self.store = store
        self.device: torch.device | None = None
        """The GPU the parameters are on (the device path), or None for parameters in host memory;
        set by the first parameter."""
        self._placed = False
        """Whether the first parameter has set :attr:`device`."""
        super().__init__(params, defaults)  # add_param_group per group
        self.compute_threads = compute_threads
        self.max_grad_norm = max_grad_norm
        self.sub_group_size = sub_group_size
        self.whole_params = whole_params
        self.params = [p for group in self.param_groups for p in group["params"]]
        self.subgroups: list[SubGroup] = []
        self.subgroups = self._partition(0)
        slot_elements = max((self.state_numel(sg) for sg in self.subgroups), default=1)
        self.stager: SubGroupStager
        if self.device is None:
            if gpu_bytes:
                raise ConfigError(
                    f"gpu_budget: {gpu_budget!r} for parameters in host memory; it is GPU memory for the "
                    "state of parameters on a GPU: leave it None (or 0), or move the model to the GPU first"
                )
            self.stager = SubGroupStager(
                store,
                namespace,
                slot_elements=slot_elements,
                dram_budget=dram_budget,
                prefetch_depth=prefetch_depth,
                cache_policy=cache_policy,
                reserved_bytes=FP32 * self._gradient_numel(self.subgroups),
                owner=type(self).__name__,
            )
        else:
            self.stager = DeviceStager(
                store,
                namespace,
                device=self.device,
                runtime=store.device_runtime,
                gpu_budget=gpu_bytes or 0,
                slot_elements=slot_elements,
                dram_budget=dram_budget,
                prefetch_depth=prefetch_depth,
                cache_policy=cache_policy,
                owner=type(self).__name__,
            )
        self.step_count = 0
        """Steps taken (overflow-skipped ones excluded); the sub-group order alternates with it."""
        self.param_steps = [0] * len(self.params)
        """Per parameter, the steps on which it had a gradient: its bias correction, as in torch."""
        self.skipped_steps = 0
        self.compute_seconds = 0.0
        """Wall seconds the last step spent in its own work (norm, conversion, kernels, copies into
        the model) rather than waiting on the store: the compute term of the I/O model's
        :func:`~tierstore.model.plan_pass`. On the device path, the host's part of that work (the
        norm and launching the kernels, which run on the device meanwhile)."""
        self._grad = (
            aligned_tensor(self._gradient_numel(self.subgroups)) if self.device is None else _NO_GRADIENTS
        )
        """The fp32 gradient buffer: a whole sub-group's for ``whole_params`` optimizers (their
        kernels need whole parameters), else :data:`GRADIENT_CHUNK` elements. On the device path,
        device memory (of :data:`DEVICE_GRADIENT_CHUNK` elements there) made for each step and bound
        to it while its kernels run (:meth:`_update_on_device`)."""
        self._step_tensor: Callable[[int], torch.Tensor] = _host_step_tensor
        """A parameter's step count as the fused kernels take it (a 0-d fp32 tensor where they run);
        bound to a step's device scalars on the device path."""
        try:
            self._write_all(None)
        except BaseException:
            self.stager.abandon()
            raise

    # -- what an optimizer supplies ---------------------------------------------------------------
    @abstractmethod
    def _check_group(self, group: dict[str, Any], where: str) -> None:
        """A :class:`ConfigError` naming the field for a bad hyper-parameter of a group."""

    @abstractmethod
    def state_numel(self, sg: SubGroup) -> int:
        """fp32 values of the sub-group's state object (master weights included)."""

    @abstractmethod
    def _update(self, sg: SubGroup, state: torch.Tensor, coefficient: float) -> None:
        """Update the sub-group's state in place from its gradients times ``coefficient`` (from
        :meth:`_gradients` or :meth:`_gradient_chunks`) and copy the new master weights into the
        model."""

    @abstractmethod
    def _fill(self, sg: SubGroup, state: torch.Tensor, *, saved: dict[Any, Any] | None) -> None:
        """Lay out a sub-group's state from ``saved`` (a state dict's per-parameter entries) or
        fresh (master weights = the parameters, everything else zero)."""

    @abstractmethod
    def _master_views(self, sg: SubGroup, state: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        """The master weights of each piece: views into ``state``, or into the parameter itself
        (:meth:`_window`) for a parameter that is its own master."""

    @abstractmethod
    def _state_entries(self) -> list[dict[str, Any]]:
        """Per parameter, its state as a state dict holds it (``step`` aside), read from DRAM or
        the store."""

    @abstractmethod
    def _check_entries(self, entries: list[dict[str, Any] | None]) -> None:
        """Refuse a state dict's per-parameter entries (None: the parameter has none) that do not
        fit this optimizer's parameters (their shapes), with a :class:`BufferMismatchError`, before
        anything is restored."""

    def _restore_entries(self, entries: list[dict[str, Any] | None]) -> None:
        """Take back what a state dict's entries hold beside the state objects and step counts."""

    # -- public -----------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, as ``torch.optim.Optimizer.add_param_group``.

        Once the optimizer is constructed, the group's parameters form new sub-groups whose fresh
        state (master weights = the parameters) is written to the store, the staging buffers
        growing if the new sub-groups are larger. If any of that fails, the group is not added.

        Args:
            param_group: ``params`` (contiguous tensors on the device of the optimizer's others,
                each listed once) and the group's hyper-parameters; keys it leaves out take the
                constructor's values.

        Raises:
            ConfigError: a parameter listed twice (torch warns and updates it twice), a refused
                ``DTensor`` parameter, or an invalid hyper-parameter; the message names the key.
            BufferMismatchError: a parameter that is not a contiguous tensor in host memory or on
                a GPU, or one on another device than the optimizer's other parameters.
            CapacityError: a given ``dram_budget`` cannot hold the new, larger sub-groups.
            StoreClosedError: the optimizer is closed.
        """
        staged = hasattr(self, "stager")  # False while torch's constructor adds the first groups
        if staged:
            self._check_open()
        number = len(self.param_groups)
        params = param_group["params"]
        if not isinstance(params, set):  # torch refuses a set (no order); read anything else once
            param_group["params"] = params = [params] if isinstance(params, torch.Tensor) else list(params)
            seen: set[int] = set()
            for param in params:
                if id(param) in seen:
                    raise ConfigError(
                        f"param_groups.{number}.params: a parameter of shape {tuple(param.shape)} is "
                        "listed twice (torch would update it twice); list each parameter once"
                    )
                seen.add(id(param))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        placed = self._placed
        try:
            for position, param in enumerate(group["params"]):
                if self.SHARDED_PARAMETERS is not None and _is_dtensor(param):
                    raise ConfigError(
                        f"param_groups.{number}.params: a DTensor parameter of shape {tuple(param.shape)} "
                        f"(sharded by FSDP2 or tensor parallelism); {type(self).__name__} cannot step it: "
                        f"{self.SHARDED_PARAMETERS}"
                    )
                self._check_place(param, f"param_groups.{number}.params.{position}")
            self._check_group(group, f"param_groups.{number}.")
        except BaseException:
            self.param_groups.pop()
            if not placed:
                self._placed, self.device = False, None
            raise
        self._layouts.append({key: group.get(key) for key in self.LAYOUT_KEYS})
        self._own_masters.extend(self._is_own_master(param) for param in group["params"])
        if staged:
            self._add_subgroups(number)

    def close(self) -> None:
        """Write the sub-groups kept in DRAM back (the store then holds the whole state) and give
        back the namespace and the DRAM budget.

        The optimizer is unusable afterwards: its methods raise :class:`StoreClosedError`.
        Idempotent.
        """
        self.stager.close()

    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_scale: float = 1.0) -> Any:
        """One optimizer step over every sub-group.

        A step whose gradients overflow (a non-finite norm) is skipped (``skipped_steps`` counts
        them) and changes nothing. Errors are raised before anything is updated.

        Args:
            closure: re-evaluates the model and returns the loss, as in ``torch.optim``; None for
                none.
            grad_scale: the loss scale: gradients are divided by it.

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            ConfigError: ``grad_scale`` is not positive, a group's hyper-parameter is invalid
                (the message names it), a group's :attr:`LAYOUT_KEYS` changed since it was added,
                or a parameter became fp32 or stopped being fp32 since then.
            BufferMismatchError: a sparse gradient (``nn.Embedding(sparse=True)``); the message
                names the parameter.
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        if not grad_scale > 0.0:
            raise ConfigError(f"grad_scale must be a positive number, got {grad_scale}")
        for number, group in enumerate(self.param_groups):
            self._check_group(group, f"param_groups.{number}.")
        self._check_layouts(self.param_groups, "param_groups", ConfigError)
        self._check_dtypes()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for number, param in enumerate(self.params):
            if param.grad is not None and param.grad.layout != torch.strided:
                raise BufferMismatchError(
                    f"{type(self).__name__}.step: parameter {number} (shape {tuple(param.shape)}) has a "
                    f"{param.grad.layout} gradient; only dense gradients are supported (e.g. "
                    "nn.Embedding(sparse=False)); nothing was updated"
                )
        order = pass_order(len(self.subgroups), self.step_count + 1)
        # The pass's first reads run while the gradient norm is taken: the norm is a full pass
        # over the gradients, time the disk would otherwise sit idle.
        self.stager.begin_pass(order, {sg.index: self.state_numel(sg) for sg in self.subgroups})
        try:
            if isinstance(self.stager, DeviceStager):
                self._step_on_device(self.stager, grad_scale)
                return loss
            with _torch_threads(self.compute_threads):
                started = time.perf_counter()
                coefficient = self._gradient_coefficient(grad_scale)
                compute = time.perf_counter() - started
                if coefficient is None:
                    self.skipped_steps += 1
                    return loss
                self._count_step()
                for index in order:
                    state = self.stager.acquire(index)
                    started = time.perf_counter()
                    self._update(self.subgroups[index], state, coefficient)
                    compute += time.perf_counter() - started
                    self.stager.release(index)
                self.compute_seconds = compute
        finally:
            self.stager.end_pass()
        return loss

    def _count_step(self) -> None:
        """A step is taken: counted, and for each parameter with a gradient (its bias correction)."""
        self.step_count += 1
        for number, param in enumerate(self.params):
            if param.grad is not None:
                self.param_steps[number] += 1

    def _step_on_device(self, stager: DeviceStager, grad_scale: float) -> None:
        """The update of a step on the device path (its pass begun): the gradient norm on the
        device, read once by the host (overflow and clipping), then every sub-group through
        :meth:`DeviceStager.run_pass`, its kernels queued on the caller's current stream."""
        started = time.perf_counter()
        coefficient = self._device_coefficient(stager, grad_scale)
        compute = time.perf_counter() - started
        if coefficient is None:
            self.skipped_steps += 1
            return
        self._count_step()
        device = self._local(self.params[0]).device  # torch's place of the parameters' memory
        buffers = _DeviceBuffers(stager.empty(self._gradient_numel(self.subgroups)), device)
        stager.run_pass(functools.partial(self._update_on_device, buffers, coefficient))
        self.compute_seconds = compute + buffers.seconds

    def _update_on_device(
        self, buffers: _DeviceBuffers, coefficient: float, index: Hashable, state: torch.Tensor
    ) -> None:
        """:meth:`_update` of sub-group ``index`` on the device, with the step's device buffers
        (bound while it runs: the runtime may run it after the pass has moved on, a simulated
        device when the test runs the stream)."""
        assert isinstance(index, int)
        started = time.perf_counter()
        self._grad, self._step_tensor = buffers.grad, buffers.step_tensor
        try:
            self._update(self.subgroups[index], state, coefficient)
        finally:  # the step's device memory is not held past its kernels
            self._grad, self._step_tensor = _NO_GRADIENTS, _host_step_tensor
        buffers.seconds += time.perf_counter() - started

    def _device_coefficient(self, stager: DeviceStager, grad_scale: float) -> float | None:
        """:meth:`_gradient_coefficient` from the gradients' sum of squares taken on the device
        (:meth:`_device_squares`, queued on the caller's stream); the host waits for that one
        value."""
        squares: list[torch.Tensor] = []
        stager.launch(lambda: squares.append(self._device_squares()), "gradient norm")
        stager.synchronize()
        return self._coefficient(math.sqrt(float(squares[0])) / grad_scale, grad_scale)

    def _device_squares(self) -> torch.Tensor:
        """The gradients' sum of squares on the device (a 0-d fp32 tensor; torch's per-tensor fp32
        norms, as ``clip_grad_norm_`` takes them, of gradients of any dtype)."""
        grads = [self._local(param.grad) for param in self.params if param.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        return torch.stack(norms).square().sum()

    @property
    def device_staging_bytes(self) -> int:
        """Device path: the device memory a step allocates beyond the sub-groups kept on the device
        (``gpu_budget``), at most, in the caching allocator's blocks: the stager's slots (three
        sub-groups' state), the fp32 gradient buffer, and the scalars, an allocator block (512
        bytes) per parameter (the norm's per-tensor values, or the step counts) and three vectors
        of a value per parameter (the norm's reductions). 0 on the CPU path."""
        if not isinstance(self.stager, DeviceStager):
            return 0
        gradient = device_bytes(FP32 * self._gradient_numel(self.subgroups))
        count = len(self.params)
        scalars = DEVICE_BLOCK * count + 3 * device_bytes(FP32 * count)
        return self.stager.slot_device_bytes + gradient + scalars

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, in ``torch.optim``'s format.

        Sub-groups kept in DRAM are written to the store first, so the store holds the same state
        as the dict.

        Returns:
            ``state``: per parameter index its ``step`` (its own count) and its state as whole
            fp32 tensors of its shape (``master_param`` only for a low-precision parameter: an fp32
            one is its own master); ``param_groups``: the groups' hyper-parameters with their
            parameters' indices; ``step_count`` and ``skipped_steps``: the optimizer's counts.

        Raises:
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        self.stager.flush()
        entries = self._state_entries()
        return {
            "state": {
                i: {"step": torch.tensor(float(steps)), **entry}
                for i, (steps, entry) in enumerate(zip(self.param_steps, entries, strict=True))
            },
            "param_groups": self._state_dict_groups(),
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the state in the store is rewritten.

        Each parameter's ``step`` is its own count (a parameter without an entry has taken none, as
        in torch); dicts saved before per-parameter counts hold the global count in every entry.
        The model's weights are the parameters' weights: an fp32 parameter is its own master (a
        ``master_param`` in its entry is not used), and a low-precision one takes its entry's
        ``master_param`` only if the parameter rounds from it (else a
        :class:`StaleMasterWeightsError`), or, without one, its own weights as master weights. So
        load the model's weights first, as for torch's optimizers. The groups take the dict's
        hyper-parameters, except the :attr:`IMPLEMENTATION_KEYS`.

        Args:
            state_dict: a state dict of an optimizer with the same parameters and state layout
                (this optimizer's, or torch's AdamW's).

        Raises:
            BufferMismatchError: the dict's groups, parameters or state shapes do not match this
                optimizer's, or a group's :attr:`LAYOUT_KEYS` differ; nothing is restored.
            StaleMasterWeightsError: a low-precision parameter does not round from its entry's
                ``master_param``; nothing is restored.
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        state = state_dict["state"]
        entries = [state.get(i, state.get(str(i))) for i in range(len(self.params))]
        self._check_groups(state_dict["param_groups"])
        self._check_entries(entries)
        self._check_masters(entries)
        self._take_groups(state_dict["param_groups"])
        self.param_steps = [0 if entry is None else int(entry.get("step", 0)) for entry in entries]
        self._restore_entries(entries)
        self.step_count = int(state_dict.get("step_count", max(self.param_steps, default=0)))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.stager.drop_resident()
        self._write_all(state)

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 master weights.

        Returns:
            One fp32 tensor per parameter, of its shape (read from DRAM or the store; a copy of
            the parameter for an fp32 one, its own master).

        Raises:
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        masters = [torch.empty(self._local(p).shape, dtype=torch.float32) for p in self.params]
        for sg in self.subgroups:
            for piece, values in self._master_views(sg, self.stager.read(sg.index)):
                masters[piece.param].view(-1)[piece.param_offset : piece.param_offset + piece.length].copy_(
                    values
                )
        return masters

    def save_snapshot(self, path: str | os.PathLike[str]) -> None:
        """Checkpoint the fp32 state (sub-groups kept in DRAM included) and step counts into one
        portable HDF5 file (:func:`tierstore.export_hdf5`), without gathering it in memory.

        Args:
            path: the HDF5 file to write.

        Raises:
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        self.stager.flush()
        metadata = {
            "step_count": self.step_count,
            "param_steps": self.param_steps,
            "skipped_steps": self.skipped_steps,
            "subgroups": [sg.numel for sg in self.subgroups],
            "own_masters": self._own_masters,
            "param_groups": self._saved_groups(),
            **self._snapshot_metadata(),
        }
        export_hdf5(self.store, path, [self.stager.key(sg.index) for sg in self.subgroups], metadata)

    def load_snapshot(self, path: str | os.PathLike[str]) -> None:
        """Restore a :meth:`save_snapshot`, and copy the restored master weights of low-precision
        parameters into the model. An fp32 parameter is its own master: the snapshot holds none of
        its weights, which are the model's to restore (``model.load_state_dict``).

        A snapshot from before per-parameter step counts gives every parameter the global count.

        Args:
            path: an HDF5 file written by :meth:`save_snapshot` of an optimizer with the same
                parameters (of the same dtypes), ``sub_group_size`` and namespace.

        Raises:
            BufferMismatchError: the snapshot's sub-groups, layout (fp32 master weights held for
                parameters that are fp32 here, or none for ones that are not), step counts or keys
                do not match this optimizer's; nothing is restored.
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        with open_snapshot(path) as snapshot:
            metadata = snapshot.metadata
            if metadata.get("subgroups") != [sg.numel for sg in self.subgroups]:
                raise BufferMismatchError(f"{path}: its sub-groups differ from this optimizer's")
            # A snapshot without the entry holds master weights for every parameter.
            self._check_own_masters(metadata.get("own_masters", [False] * len(self.params)), path)
            self._check_layouts(metadata["param_groups"], f"{path}: param_groups", BufferMismatchError)
            step_count = int(metadata["step_count"])
            param_steps = [int(n) for n in metadata.get("param_steps", [step_count] * len(self.params))]
            if len(param_steps) != len(self.params):
                raise BufferMismatchError(
                    f"{path}: it counts steps for {len(param_steps)} parameters, this optimizer has "
                    f"{len(self.params)}"
                )
            mine = {self.stager.key(sg.index) for sg in self.subgroups}
            foreign = sorted(set(snapshot.keys()) - mine)
            if foreign:  # keys another workload on the store may own
                raise BufferMismatchError(
                    f"{path}: holds {foreign[0]!r}, not a key of this optimizer's namespace "
                    f"{self.stager.namespace!r}: load a snapshot into an optimizer of the namespace that "
                    "saved it"
                )
            self.stager.drop_resident()
            for key, tensor in snapshot.items():
                self.store.put(key, tensor).result()
        self._take_groups(
            [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in metadata["param_groups"]]
        )
        self.step_count = step_count
        self.param_steps = param_steps
        self.skipped_steps = int(metadata["skipped_steps"])
        self._restore_snapshot_metadata(path, metadata)
        for sg in self.subgroups:  # the model follows the restored master weights
            for piece, values in self._master_views(sg, self.stager.read(sg.index)):
                if not self._own_masters[piece.param]:
                    self._copy_to_model(piece, values)

    # -- for the optimizers -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.stager.closed:
            raise StoreClosedError(f"this {type(self).__name__} is closed")

    def _check_layouts(self, groups: list[dict[str, Any]], source: str, error: type[TierStoreError]) -> None:
        """Refuse groups whose :attr:`LAYOUT_KEYS` differ from this optimizer's (``error`` naming
        the first such key): the state in the store is laid out by them."""
        for number, (group, layout) in enumerate(zip(groups, self._layouts, strict=False)):
            for key, value in layout.items():
                if group.get(key) != value:
                    raise error(
                        f"{source}.{number}.{key} is {group.get(key)!r}, but this optimizer's state is "
                        f"laid out for {value!r} (the layout depends on it: construct an optimizer "
                        "with the new value instead)"
                    )

    def _check_dtypes(self) -> None:
        """A :class:`ConfigError` for a parameter that became fp32, or stopped being fp32, since its
        group was added: whether it is its own master lays out its state."""
        for number, (param, own) in enumerate(zip(self.params, self._own_masters, strict=True)):
            if self._is_own_master(param) != own:
                raise ConfigError(
                    f"parameter {number} (shape {tuple(param.shape)}) is {self._local(param).dtype} now and "
                    f"was {'fp32' if own else 'of a lower precision'} when its group was added: its state is "
                    "laid out for that (an fp32 parameter is its own master weights, a low-precision one "
                    "has fp32 master weights in the state); build the optimizer after converting the model"
                )

    def _check_own_masters(self, saved: list[bool], source: str | os.PathLike[str]) -> None:
        """A :class:`BufferMismatchError` if a snapshot's parameters were their own masters (fp32)
        where this optimizer's are not, or the reverse: their states are laid out differently."""
        differ = [n for n, (was, now) in enumerate(zip(saved, self._own_masters, strict=False)) if was != now]
        if len(saved) != len(self.params) or differ:
            raise BufferMismatchError(
                f"{source}: its state is laid out for parameters of other dtypes: parameters {differ[:5]} "
                "were fp32 (their own master weights, none in the state) where they are low-precision "
                "here (fp32 master weights in the state), or the reverse; load it into an optimizer over "
                "parameters of the dtypes it was saved with"
            )

    def _check_masters(self, entries: list[dict[str, Any] | None]) -> None:
        """A :class:`StaleMasterWeightsError` for a low-precision parameter that does not round
        from its entry's ``master_param`` (an fp32 parameter's is not used, so not checked)."""
        stale = []
        for number, (param, entry) in enumerate(zip(self.params, entries, strict=True)):
            if entry is None or "master_param" not in entry or self._own_masters[number]:
                continue
            weights = self._local(param).detach()
            master = self._local(entry["master_param"]).detach()
            if not _same_bits(master.to(device=weights.device, dtype=weights.dtype), weights):
                stale.append(number)
        if stale:
            raise stale_masters_error("the state dict", stale, [tuple(self.params[n].shape) for n in stale])

    def _stale_masters(self) -> list[int]:
        """The low-precision parameters that do not round from their master weights in the state
        (read from DRAM or the store)."""
        stale: set[int] = set()
        for sg in self.subgroups:
            if all(self._own_masters[piece.param] for piece in sg.pieces):
                continue  # no master weights in its state: nothing to read
            for piece, values in self._master_views(sg, self.stager.read(sg.index)):
                window = self._window(piece)
                if not self._own_masters[piece.param] and not _same_bits(
                    values.to(device=window.device, dtype=window.dtype), window
                ):
                    stale.add(piece.param)
        return sorted(stale)

    def _check_place(self, param: torch.Tensor, where: str) -> None:
        """Refuse a parameter that is not a contiguous tensor in host memory or on a GPU, or one on
        another device than the first parameter (which sets :attr:`device`), with a
        :class:`BufferMismatchError` naming it (``where``)."""
        local = self._local(param)
        device = self.store.device_runtime.device_of(local)
        if not param.is_contiguous() or (device is None and local.device.type != "cpu"):
            raise BufferMismatchError(
                f"{where}: {type(self).__name__} needs contiguous parameters in host memory or on a GPU; "
                f"this one (shape {tuple(param.shape)}) is "
                + ("not contiguous" if not param.is_contiguous() else f"on {local.device}")
            )
        if not self._placed:
            self.device, self._placed = device, True
        elif device != self.device:
            raise BufferMismatchError(
                f"{where}: a parameter of shape {tuple(param.shape)} is {_place(device)}, the optimizer's "
                f"others {_place(self.device)}: an offloaded optimizer steps parameters all in host memory "
                "or all on one GPU (its state is staged for one of them); move the model to one device first"
            )

    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a parameter (or of a tensor shaped like one) the optimizer steps: the whole
        tensor here."""
        return tensor

    def _window(self, piece: Piece) -> torch.Tensor:
        """The piece's elements of its parameter, flat (a view: writes update the model)."""
        flat = self._local(self.params[piece.param].data).view(-1)
        return flat[piece.param_offset : piece.param_offset + piece.length]

    def _is_own_master(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is fp32, so its own master weights."""
        return self._local(param).dtype == torch.float32

    def _param_groups_of(self) -> list[int]:
        """Per parameter (in :attr:`params` order), the number of its group."""
        return [number for number, group in enumerate(self.param_groups) for _ in group["params"]]

    def _group_params(self, group: int) -> range:
        """The numbers (in :attr:`params`) of the parameters of group ``group``."""
        start = sum(len(g["params"]) for g in self.param_groups[:group])
        return range(start, start + len(self.param_groups[group]["params"]))

    def _partition(self, first_group: int) -> list[SubGroup]:
        """The sub-groups of the groups from ``first_group`` on, numbered after the existing ones."""
        index = {id(p): i for i, p in enumerate(self.params)}
        sizes = [
            [(index[id(p)], self._local(p).numel()) for p in group["params"]] if number >= first_group else []
            for number, group in enumerate(self.param_groups)
        ]
        cut = (partition_whole if self.whole_params else partition)(sizes, self.sub_group_size)
        start = len(self.subgroups)
        return [dataclasses.replace(sg, index=start + i) for i, sg in enumerate(cut)]

    def _gradient_numel(self, subgroups: list[SubGroup]) -> int:
        """Elements of the fp32 gradient buffer ``subgroups`` need."""
        largest = max((sg.numel for sg in subgroups), default=1)
        chunk = GRADIENT_CHUNK if self.device is None else DEVICE_GRADIENT_CHUNK
        return largest if self.whole_params else min(largest, chunk)

    def _add_subgroups(self, group: int) -> None:
        """Stage the parameters of a group added after construction: new sub-groups, their fresh
        state written to the store before they join the step (if that fails, the group is gone)."""
        first = len(self.params)
        self.params.extend(self.param_groups[group]["params"])
        added = self._partition(group)
        try:
            self.stager.grow(
                max((self.state_numel(sg) for sg in added), default=1),
                FP32 * self._gradient_numel(added),
            )
            self._write_all(None, added)
        except BaseException:
            del self.params[first:]
            del self._own_masters[first:]
            self.param_groups.pop()
            self._layouts.pop()
            raise
        if self.device is None and self._grad.numel() < self._gradient_numel(added):
            self._grad = aligned_tensor(self._gradient_numel(added))
        self.param_steps.extend([0] * (len(self.params) - first))
        self.subgroups.extend(added)
        self._params_added(len(self.params) - first)

    def _params_added(self, count: int) -> None:
        """``count`` parameters were appended to :attr:`params` (a group added after construction)."""

    def _snapshot_metadata(self) -> dict[str, Any]:
        """Optimizer-specific metadata a snapshot carries (JSON-serialisable)."""
        return {}

    def _restore_snapshot_metadata(self, path: str | os.PathLike[str], metadata: dict[str, Any]) -> None:
        """Take back what :meth:`_snapshot_metadata` saved."""

    def _gradients(self, sg: SubGroup, coefficient: float) -> list[tuple[Piece, torch.Tensor]]:
        """Delayed conversion: the sub-group's low-precision gradients into the one fp32 buffer (at
        the pieces' offsets; ``whole_params`` optimizers only), times the coefficient. A piece without
        a gradient is left out: as in torch, no gradient means no update and no weight decay."""
        grads = []
        for piece, flat in self._pieces_with_gradients(sg):
            converted = self._grad[piece.offset : piece.offset + piece.length]
            converted.copy_(flat[piece.param_offset : piece.param_offset + piece.length])
            grads.append((piece, converted))
        if grads and coefficient != 1.0:
            self._grad[: sg.numel].mul_(coefficient)
        return grads

    def _gradient_chunks(
        self, sg: SubGroup, coefficient: float
    ) -> Iterator[list[tuple[Piece, torch.Tensor]]]:
        """The same as :meth:`_gradients`, a buffer's worth at a time: each chunk lists pieces (parts
        of the sub-group's, cut near the buffer's end where :func:`~.partition.cut_length` allows)
        with their fp32 gradients. An element-wise
        kernel run on each chunk reads the converted gradient while it is still in cache: a whole
        sub-group's worth would go out to memory and come back, traffic that competes with the
        state I/O for the memory bus."""
        room = self._grad.numel()
        alignment = KERNEL_ALIGNMENT if room >= KERNEL_ALIGNMENT else 1
        chunk: list[tuple[Piece, torch.Tensor]] = []
        used = 0
        for piece, flat in self._pieces_with_gradients(sg):
            done = 0
            while done < piece.length:
                take = cut_length(piece.param_offset + done, piece.length - done, room - used, alignment)
                if take == 0:  # cut the parameter where the sub-group partition could have
                    yield self._scaled(chunk, used, coefficient)
                    chunk, used = [], 0
                    continue
                part = Piece(piece.param, piece.param_offset + done, piece.offset + done, take)
                converted = self._grad[used : used + take]
                converted.copy_(flat[part.param_offset : part.param_offset + take])
                chunk.append((part, converted))
                used += take
                done += take
                if used == room:
                    yield self._scaled(chunk, used, coefficient)
                    chunk, used = [], 0
        if chunk:
            yield self._scaled(chunk, used, coefficient)

    def _pieces_with_gradients(self, sg: SubGroup) -> Iterator[tuple[Piece, torch.Tensor]]:
        """The sub-group's pieces whose parameter has a gradient, each with that gradient flat."""
        for piece in sg.pieces:
            grad = self.params[piece.param].grad
            if grad is not None:
                yield piece, self._local(grad).view(-1)

    def _scaled(
        self, chunk: list[tuple[Piece, torch.Tensor]], used: int, coefficient: float
    ) -> list[tuple[Piece, torch.Tensor]]:
        if coefficient != 1.0:
            self._grad[:used].mul_(coefficient)
        return chunk

    def _copy_to_model(self, piece: Piece, master: torch.Tensor) -> None:
        """A piece's new master weights into the model's (low-precision) parameter."""
        self._window(piece).copy_(master)

    def _gradient_coefficient(self, grad_scale: float) -> float | None:
        """1/grad_scale times the clipping factor, or None if the gradients overflowed."""
        squares = sum(self._squares(param.grad) for param in self.params if param.grad is not None)
        return self._coefficient(math.sqrt(squares) / grad_scale, grad_scale)

    def _coefficient(self, total: float, grad_scale: float) -> float | None:
        """From the unscaled gradient norm ``total``: 1/grad_scale times the clipping factor, or None
        if it is not finite (the gradients overflowed)."""
        if not math.isfinite(total):
            return None
        coefficient = 1.0 / grad_scale
        if self.max_grad_norm is not None:
            coefficient *= min(1.0, self.max_grad_norm / (total + 1e-6))  # as clip_grad_norm_
        return coefficient

    def _squares(self, grad: torch.Tensor) -> float:
        """A gradient's sum of squares, in fp32 over cache-sized pieces summed in double. A
        low-precision gradient is converted piece by piece into the fp32 buffer and then reduced,
        rather than reduced with the conversion inside (``vector_norm(dtype=torch.float32)``),
        which is slower on a CPU; each piece stays in cache between the two."""
        flat, squares = grad.reshape(-1), 0.0
        size = min(self._grad.numel(), GRADIENT_CHUNK)
        for start in range(0, flat.numel(), size):
            part = flat[start : start + size]
            if part.dtype != torch.float32:
                part = self._grad[: part.numel()].copy_(part)
            squares += float(torch.dot(part, part))
        return squares

    def _write_all(self, saved: dict[Any, Any] | None, subgroups: list[SubGroup] | None = None) -> None:
        """Write the state of ``subgroups`` (default: every sub-group), from ``saved`` or fresh, to
        the store."""
        for sg in self.subgroups if subgroups is None else subgroups:
            self.stager.write(sg.index, self.state_numel(sg), functools.partial(self._fill, sg, saved=saved))
        self.stager.wait_writes()

    def _saved_groups(self) -> list[dict[str, Any]]:
        """The groups' hyper-parameters (no parameters), as checkpoints carry them."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def _check_groups(self, groups: list[dict[str, Any]]) -> None:
        """Refuse a state dict's groups that do not match this optimizer's (their number, their
        parameters' counts, their :attr:`LAYOUT_KEYS`) with a :class:`BufferMismatchError`."""
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.param_groups, strict=True)
        ):
            raise BufferMismatchError("the state dict's parameter groups do not match this optimizer's")
        self._check_layouts(groups, "the state dict's param_groups", BufferMismatchError)

    def _restore_groups(self, groups: list[dict[str, Any]]) -> None:
        """Take back a state dict's groups, which must match this optimizer's."""
        self._check_groups(groups)
        self._take_groups(groups)

    def _take_groups(self, groups: list[dict[str, Any]]) -> None:
        """The groups' hyper-parameters from saved ones (a state dict's or a snapshot's), except
        their ``params`` and :attr:`IMPLEMENTATION_KEYS`."""
        for group, saved in zip(self.param_groups, groups, strict=True):
            group.update(
                {k: v for k, v in saved.items() if k != "params" and k not in self.IMPLEMENTATION_KEYS}
            )

    def _state_dict_groups(self) -> list[dict[str, Any]]:
        """``torch.optim``'s ``param_groups`` entry: hyper-parameters and parameter indices."""
        groups, start = [], 0
        for group in self.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
            groups[-1]["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
        return groups


_NO_GRADIENTS = torch.empty(0, dtype=torch.float32)
"""The device path's gradient buffer between steps: none (each step makes its own)."""


class _DeviceBuffers:
    """What one step's kernels on the device share: the fp32 gradient buffer (device memory of the
    caller's stream) and the step counts as 0-d fp32 tensors on the device, made by the first
    kernel that needs each count.

    Args:
        grad: the gradient buffer.
        device: where torch places the parameters' memory (for the step counts).
    """

    def __init__(self, grad: torch.Tensor, device: torch.device) -> None:
        self.grad = grad
        self.device = device
        self.steps: dict[int, torch.Tensor] = {}
        self.seconds = 0.0
        """Host seconds spent queueing the step's kernels."""

    def step_tensor(self, count: int) -> torch.Tensor:
        """``count`` as a 0-d fp32 tensor on the device (filled by a kernel, no copy from the
        host)."""
        tensor = self.steps.get(count)
        if tensor is None:
            tensor = self.steps[count] = torch.full((), float(count), dtype=torch.float32, device=self.device)
        return tensor


def _place(device: torch.device | None) -> str:
    """Where parameters are, in words."""
    return "in host memory" if device is None else f"on {device}"


def _host_step_tensor(count: int) -> torch.Tensor:
    """A step count as torch's fused CPU kernels take it: a 0-d fp32 CPU tensor."""
    return torch.tensor(float(count))


def _is_dtensor(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ``torch.distributed.tensor.DTensor`` (without importing
    torch.distributed where it is absent)."""
    return type(param).__name__ == "DTensor" and type(param).__module__.startswith("torch.distributed")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bits (NaNs and signed zeros
    included)."""
    return a.shape == b.shape and torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
    )


def is_real(value: object) -> bool:
    """A finite int or float (bool excluded): what a kernel takes as a hyper-parameter."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@contextmanager
def _torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` (None: one fewer than now, at least one) for the
    duration, then restored."""
    before = torch.get_num_threads()
    wanted = max(1, before - 1) if count is None else count
    if wanted == before:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(before)
