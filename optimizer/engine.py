"""The optimizer-agnostic half of an offloaded optimizer: one step's schedule over staged sub-groups.

An optimizer built on [`StagedOptimizer`][] says only what its per-sub-group state is (how many fp32
values, laid out how) and how one sub-group is updated. The engine does the rest, the same for every
optimizer:

1. measures the global gradient norm from the low-precision gradients (fp32 accumulation over
   cache-sized pieces, no full fp32 copy), detects overflow (a non-finite norm skips the step,
   leaving all state untouched, as loss scaling expects) and derives one coefficient for
   unscaling and clipping; each parameter counts its own steps, only those on which it has a
   gradient (bias correction, as in torch);
2. visits the sub-groups forward on odd steps and in reverse on even ones (MLP-Offload's
   cache-friendly `pass_order`) through a `SubGroupStager`: read-ahead ring, background write-back,
   and the kept set the I/O model chooses;
3. per sub-group, converts its gradients into one reused fp32 buffer (delayed, in place) and hands
   them to the optimizer's kernel, then copies the new master weights into the model's
   parameters: a cache-sized piece at a time for an element-wise kernel (AdamW), whole parameters
   for one that needs them (APOLLO's projections). No fp32 gradient is ever written to storage;
4. checkpoints the sub-group objects and the step counts into one HDF5 file.

Parameters on a GPU take the device path ([`tierstore.optimizer.device`][]), chosen at construction
by where the parameters are: the same schedule, the same layouts and kernels, with the state
streamed from the store through pinned host memory to the device a sub-group at a time (or kept
there within ``gpu_budget``), the gradient norm taken on the device (one wait of the host for it per
step), and each sub-group's gradients converted into a device buffer: no gradient leaves the device.
The CPU path is the loop above, untouched by it.

Master weights, and the checks that keep them consistent with the model, are
`tierstore.optimizer.masters`'s; state dicts and snapshots `tierstore.optimizer.saved_state`'s, the
base class's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from abc import abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Unpack

import torch

from ..buffers import aligned_tensor
from ..errors import BufferMismatchError, ConfigError
from ..store import TierStore
from .device import DEVICE_BLOCK, DeviceStager, device_bytes
from .gradients import (
    NO_GRADIENTS,
    DeviceBuffers,
    clip_coefficient,
    convert_gradients,
    device_squares,
    gradient_chunks,
    gradient_numel,
    host_step_tensor,
    squares,
)
from .masters import StaleMasterWeightsError as StaleMasterWeightsError
from .masters import check_dtypes, check_layouts
from .options import StagingKeywords, optimizer_options
from .partition import Piece, SubGroup, partition, partition_whole
from .saved_state import SavedState
from .subgroup_stager import FP32, SubGroupStager, pass_order


class StagedOptimizer(SavedState):
    """Base of the offloaded optimizers: one step's schedule over sub-groups staged through a store.

    The number of threads torch's CPU kernels use during a step is by default one fewer than
    torch's setting (at least one), so that a core stays free for the store's I/O threads, which
    move the state while the kernels run.

    The state lives in the store under ``namespace``, which the optimizer claims on the store for
    its lifetime (`SubGroupStager`): a second optimizer, or any workload, on the same store and
    namespace is refused with [`NamespaceInUseError`][]. The namespace is the optimizer's own
    choice, never generated, because persistent state (snapshots, a persistent store) is found again
    by it. [`close`][] (or garbage collection) gives the namespace back.

    Parameter groups may be added after construction ([`add_param_group`][], as in torch). A group's
    [`LAYOUT_KEYS`][] fix the layout of its state in the store, so they cannot change once the group
    is added.

    The parameters are all in host memory (the CPU path) or all on one GPU (the device path, see the
    module docstring and [`tierstore.optimizer.device`][]); whichever the first parameter's place
    is, every later one (added groups included) must share it.

    Args:
        params: the parameters (contiguous tensors, each listed once, all on the CPU or all on one
            GPU) or parameter groups (dicts with ``params`` and hyper-parameter keys), as for
            ``torch.optim.Optimizer``.
        store: the store holding the fp32 state; its device runtime
            ([`device_runtime`][tierstore.store.TierStore.device_runtime]) makes the device path's
            copies.
        defaults: the hyper-parameters a group takes for the keys it leaves out.
        namespace: the prefix of the state's store keys, claimed on the store.
        whole_params: keep every parameter whole in one sub-group (for kernels that need whole
            parameters) instead of cutting parameters at sub-group boundaries.
        **staging: the staging options ([`StagingKeywords`][]), each defined, with its default and
            meaning, by a field of
            [`OptimizerOptions`][tierstore.optimizer.options.OptimizerOptions] (on the device path,
            the memory of ``dram_budget`` is pinned and holds no gradient buffer).

    Raises:
        ConfigError: an argument or hyper-parameter of the wrong type or out of range, a parameter
            listed twice, a ``DTensor`` parameter where [`SHARDED_PARAMETERS`][] refuses them, a
            namespace that is not a valid key, or a ``gpu_budget`` for parameters in host memory;
            the message names it.
        BufferMismatchError: a parameter that is not a contiguous tensor in host memory or on a
            GPU, or one on another device than the first parameter (the message names it).
        CapacityError: ``dram_budget`` is below the working set (the ring and the gradient
            buffer), or does not fit beside the store's other reservations.
        PinnedMemoryError: parameters on a GPU, and the pinned ring could not be page-locked.
        NamespaceInUseError: ``namespace`` is already claimed on the store.
    """

    LAYOUT_KEYS: ClassVar[tuple[str, ...]] = ()
    """Group keys the layout of a group's state depends on."""

    SHARDED_PARAMETERS: ClassVar[str | None] = (
        "its state is laid out over whole parameters; for FSDP2's fully_shard use "
        "tierstore.integrations.fsdp.FSDPOffloadedAdamW, which stages each rank's local shards"
    )
    """Why ``DTensor`` parameters (FSDP2's shards) are refused (a [`ConfigError`][] saying so), or
    None for an optimizer that steps them."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        store: TierStore,
        defaults: dict[str, Any],
        *,
        namespace: str,
        whole_params: bool,
        **staging: Unpack[StagingKeywords],
    ) -> None:
        options = optimizer_options(type(self).__name__, staging)
        self.options = options
        """The staging options, as given or by default."""
        self._layouts: list[dict[str, Any]] = []
        """Per group, its [`LAYOUT_KEYS`][] as they were when it was added."""
        self._own_masters: list[bool] = []
        """Per parameter (in `params` order), whether it is fp32 and so its own master weights (none
        in the state), as it was when its group was added."""
        self.store = store
        self.device: torch.device | None = None
        """The GPU the parameters are on (the device path), or None for parameters in host memory;
        set by the first parameter."""
        self._placed = False
        """Whether the first parameter has set [`device`][]."""
        super().__init__(params, defaults)  # add_param_group per group
        self.compute_threads = options.compute_threads
        self.max_grad_norm = options.max_grad_norm
        self.sub_group_size = options.sub_group_size
        self.whole_params = whole_params
        self.params = [p for group in self.param_groups for p in group["params"]]
        self.subgroups: list[SubGroup] = []
        self.subgroups = self._partition(0)
        self._set_precision(options.state_precision)
        slot_elements = max((self._stored_numel(sg) for sg in self.subgroups), default=1)
        self.stager: SubGroupStager
        dram_budget = None if options.dram_budget is None else int(options.dram_budget)
        gpu_bytes = int(options.gpu_budget or 0)
        if self.device is None:
            if gpu_bytes:
                raise ConfigError(
                    f"gpu_budget: {staging['gpu_budget']!r} for parameters in host memory; it is GPU memory "
                    "for the state of parameters on a GPU: leave it None (or 0), or move the model to the "
                    "GPU first"
                )
            self.stager = SubGroupStager(
                store,
                namespace,
                slot_elements=slot_elements,
                dram_budget=dram_budget,
                prefetch_depth=options.prefetch_depth,
                cache_policy=options.cache_policy,
                reserved_bytes=FP32 * self._buffers_numel(self.subgroups),
                owner=type(self).__name__,
            )
        else:
            self.stager = DeviceStager(
                store,
                namespace,
                device=self.device,
                runtime=store.device_runtime,
                gpu_budget=gpu_bytes,
                slot_elements=slot_elements,
                dram_budget=dram_budget,
                prefetch_depth=options.prefetch_depth,
                cache_policy=options.cache_policy,
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
        `plan_pass`. On the device path, the host's part of that work (the norm and launching the
        kernels, which run on the device meanwhile)."""
        self._grad = (
            aligned_tensor(self._gradient_numel(self.subgroups)) if self.device is None else NO_GRADIENTS
        )
        """The fp32 gradient buffer: a whole sub-group's for ``whole_params`` optimizers (their
        kernels need whole parameters), else `GRADIENT_CHUNK` elements. On the device path, device
        memory (of `DEVICE_GRADIENT_CHUNK` elements there) made for each step and bound to it while
        its kernels run (`_update_on_device`)."""
        self._step_tensor: Callable[[int], torch.Tensor] = host_step_tensor
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
        """A [`ConfigError`][] naming the field for a bad hyper-parameter of a group."""

    @abstractmethod
    def _update(self, sg: SubGroup, state: torch.Tensor, coefficient: float) -> None:
        """Update the sub-group's state in place from its gradients times ``coefficient`` (from
        `_gradients` or `_gradient_chunks`) and copy the new master weights into the model."""

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

        The optimizer is unusable afterwards: its methods raise [`StoreClosedError`][]. Idempotent.
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
            ConfigError: ``grad_scale`` is not positive, a group's hyper-parameter is invalid (the
                message names it), a group's [`LAYOUT_KEYS`][] changed since it was added, or a
                parameter became fp32 or stopped being fp32 since then.
            BufferMismatchError: a sparse gradient (``nn.Embedding(sparse=True)``); the message
                names the parameter.
            StoreClosedError: the optimizer is closed.
        """
        self._check_open()
        if not grad_scale > 0.0:
            raise ConfigError(f"grad_scale must be a positive number, got {grad_scale}")
        for number, group in enumerate(self.param_groups):
            self._check_group(group, f"param_groups.{number}.")
        check_layouts(self.param_groups, self._layouts, "param_groups", ConfigError)
        check_dtypes([self._local(param) for param in self.params], self._own_masters)
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
        self.stager.begin_pass(order, {sg.index: self._stored_numel(sg) for sg in self.subgroups})
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
                    self._host_update(self.subgroups[index], state, coefficient)
                    compute += time.perf_counter() - started
                    self.stager.release(index)
                self.compute_seconds = compute
        finally:
            self.stager.end_pass()
        return loss

    def _host_update(self, sg: SubGroup, stored: torch.Tensor, coefficient: float) -> None:
        """One sub-group's update on the host: `_update` on its fp32 state (`_in_precision`)."""
        self._in_precision(sg, stored, self._update, coefficient)

    def _count_step(self) -> None:
        """A step is taken: counted, and for each parameter with a gradient (its bias correction)."""
        self.step_count += 1
        for number, param in enumerate(self.params):
            if param.grad is not None:
                self.param_steps[number] += 1

    def _step_on_device(self, stager: DeviceStager, grad_scale: float) -> None:
        """The update of a step on the device path (its pass begun): the gradient norm on the
        device, read once by the host (overflow and clipping), then every sub-group through
        [`DeviceStager.run_pass`][], its kernels queued on the caller's current stream."""
        started = time.perf_counter()
        coefficient = self._device_coefficient(stager, grad_scale)
        compute = time.perf_counter() - started
        if coefficient is None:
            self.skipped_steps += 1
            return
        self._count_step()
        device = self._local(self.params[0]).device  # torch's place of the parameters' memory
        buffers = DeviceBuffers(stager.empty(self._gradient_numel(self.subgroups)), device)
        stager.run_pass(functools.partial(self._update_on_device, buffers, coefficient))
        self.compute_seconds = compute + buffers.seconds

    def _update_on_device(
        self, buffers: DeviceBuffers, coefficient: float, index: Hashable, state: torch.Tensor
    ) -> None:
        """`_update` of sub-group ``index`` on the device, with the step's device buffers (bound
        while it runs: the runtime may run it after the pass has moved on, a simulated device when
        the test runs the stream)."""
        assert isinstance(index, int)
        started = time.perf_counter()
        self._grad, self._step_tensor = buffers.grad, buffers.step_tensor
        try:
            self._in_precision(self.subgroups[index], state, self._update, coefficient)
        finally:  # the step's device memory is not held past its kernels
            self._grad, self._step_tensor = NO_GRADIENTS, host_step_tensor
        buffers.seconds += time.perf_counter() - started

    def _device_coefficient(self, stager: DeviceStager, grad_scale: float) -> float | None:
        """`_gradient_coefficient` from the gradients' sum of squares taken on the device
        (`_device_squares`, queued on the caller's stream); the host waits for that one value."""
        total: list[torch.Tensor] = []
        stager.launch(lambda: total.append(self._device_squares()), "gradient norm")
        stager.synchronize()
        return clip_coefficient(math.sqrt(float(total[0])) / grad_scale, grad_scale, self.max_grad_norm)

    def _device_squares(self) -> torch.Tensor:
        """The gradients' sum of squares on the device (a 0-d fp32 tensor; torch's per-tensor fp32
        norms, as ``clip_grad_norm_`` takes them, of gradients of any dtype)."""
        return device_squares([self._local(param.grad) for param in self.params if param.grad is not None])

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
        scratch = (
            device_bytes(FP32 * self._scratch_numel(self.subgroups, whole=True))
            if self.precision.compressed
            else 0
        )
        return self.stager.slot_device_bytes + gradient + scalars + scratch

    # -- for the optimizers -------------------------------------------------------------------------
    def _check_place(self, param: torch.Tensor, where: str) -> None:
        """Refuse a parameter that is not a contiguous tensor in host memory or on a GPU, or one on
        another device than the first parameter (which sets [`device`][]), with a
        [`BufferMismatchError`][] naming it (``where``)."""
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

    def _is_own_master(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is fp32, so its own master weights."""
        return self._local(param).dtype == torch.float32

    def _param_groups_of(self) -> list[int]:
        """Per parameter (in `params` order), the number of its group."""
        return [number for number, group in enumerate(self.param_groups) for _ in group["params"]]

    def _group_params(self, group: int) -> range:
        """The numbers (in `params`) of the parameters of group ``group``."""
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

    def _buffers_numel(self, subgroups: list[SubGroup]) -> int:
        """fp32 values of the CPU path's own buffers for ``subgroups``: the gradient buffer and the
        scratch a compressed sub-group is unpacked into."""
        return self._gradient_numel(subgroups) + self._scratch_numel(subgroups)

    def _gradient_numel(self, subgroups: list[SubGroup]) -> int:
        """Elements of the fp32 gradient buffer ``subgroups`` need."""
        return gradient_numel(subgroups, whole_params=self.whole_params, on_device=self.device is not None)

    def _add_subgroups(self, group: int) -> None:
        """Stage the parameters of a group added after construction: new sub-groups, their fresh
        state written to the store before they join the step (if that fails, the group is gone)."""
        first = len(self.params)
        self.params.extend(self.param_groups[group]["params"])
        added = self._partition(group)
        try:
            self.stager.grow(
                max((self._stored_numel(sg) for sg in added), default=1),
                FP32 * self._buffers_numel(added),
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
        """``count`` parameters were appended to `params` (a group added after construction)."""

    def _gradients(self, sg: SubGroup, coefficient: float) -> list[tuple[Piece, torch.Tensor]]:
        """The sub-group's gradients converted into the fp32 buffer at the pieces' offsets
        (``whole_params`` optimizers only), times the coefficient (`convert_gradients`)."""
        return convert_gradients(self._grad, self._pieces_with_gradients(sg), sg.numel, coefficient)

    def _gradient_chunks(
        self, sg: SubGroup, coefficient: float
    ) -> Iterator[list[tuple[Piece, torch.Tensor]]]:
        """The same as `_gradients`, a buffer's worth at a time (`gradient_chunks`)."""
        return gradient_chunks(self._grad, self._pieces_with_gradients(sg), coefficient)

    def _pieces_with_gradients(self, sg: SubGroup) -> Iterator[tuple[Piece, torch.Tensor]]:
        """The sub-group's pieces whose parameter has a gradient, each with that gradient flat."""
        for piece in sg.pieces:
            grad = self.params[piece.param].grad
            if grad is not None:
                yield piece, self._local(grad).view(-1)

    def _gradient_coefficient(self, grad_scale: float) -> float | None:
        """1/grad_scale times the clipping factor, or None if the gradients overflowed."""
        total = sum(self._squares(param.grad) for param in self.params if param.grad is not None)
        return clip_coefficient(math.sqrt(total) / grad_scale, grad_scale, self.max_grad_norm)

    def _squares(self, grad: torch.Tensor) -> float:
        """A gradient's sum of squares (`squares`, through the fp32 buffer)."""
        return squares(grad, self._grad)


def _place(device: torch.device | None) -> str:
    """Where parameters are, in words."""
    return "in host memory" if device is None else f"on {device}"


def _is_dtensor(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ``torch.distributed.tensor.DTensor`` (without importing
    torch.distributed where it is absent)."""
    return type(param).__name__ == "DTensor" and type(param).__module__.startswith("torch.distributed")


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
