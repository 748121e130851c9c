"""Plain helpers shared by several test modules (the fixtures live in ``conftest.py``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tierstore.backends import open_backend
from tierstore.optimizer import StagedOptimizer

from tierstore import Tier, TierStore

TESTS = Path(__file__).parent


# -- stores ---------------------------------------------------------------------------------------
def make_store(tmp_path: Path, kind: str) -> TierStore:
    """A store for an offloaded optimizer's state: one tier named ``state``, no cache (the
    optimizer stages its own DRAM).

    Args:
        tmp_path: the test's directory; an NVMe tier keeps its files in ``state`` under it.
        kind: ``"dram"`` or ``"nvme"`` (64 KiB chunks, so sub-groups span several).
    """
    backend = open_backend("dram://" if kind == "dram" else f"nvme://{tmp_path / 'state'}?chunk_bytes=64KiB")
    return TierStore([Tier("state", backend)], cache_budget=0)


def persistent(
    tmp_path: Path,
    backend: str | None = None,
    *,
    tier: str = "nvme",
    budget: str | int = "1MiB",
    **cache: object,
) -> dict[str, Any]:
    """The config document of a persistent store with one tier, for ``TierStore.from_config``.

    Args:
        tmp_path: the test's directory; the manifest is ``manifest`` under it (a crash writer
            records its progress beside it, in ``manifest.started``).
        backend: the tier's backend URL; by default NVMe in ``tmp_path / "nvme"`` with 64 KiB
            chunks, so objects of a few hundred KiB already span several.
        tier: the tier's name, which :meth:`TierStore.info` reports for the objects on it.
        budget: the DRAM cache's byte budget; the default 1 MiB makes larger objects go straight
            to the tier and smaller ones get evicted early.
        cache: other ``[cache]`` settings, such as ``pack_below``.
    """
    url = backend if backend is not None else f"nvme://{tmp_path / 'nvme'}?chunk_bytes=64KiB"
    return {
        "cache": {"budget": budget, **cache},
        "manifest": str(tmp_path / "manifest"),
        "tiers": [{"name": tier, "backend": url}],
    }


def kill_a_crash_writer(
    config: dict[str, Any], first_version: int, seed: int, seconds: float, *mode: str
) -> int:
    """Run ``crash_writer.py`` on the persistent store ``config`` in a child process and kill it
    with SIGKILL ``seconds`` after it has opened the store: a crash at a moment the writer does
    not choose.

    Args:
        config: the store's config document (it must name a ``manifest``).
        first_version: the first version the writer puts.
        seed: seeds the writer's choice of keys.
        seconds: how long the writer runs before the kill.
        mode: the writer's optional mode (``"packs"``: rounds of small objects, each flushed).

    Returns:
        The highest version the writer started before it died.
    """
    arguments = [json.dumps(config), str(first_version), str(seed), *mode]
    writer = subprocess.Popen(
        [sys.executable, str(TESTS / "crash_writer.py"), *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    ready = writer.stdout.readline().strip() == "ready"
    if ready:
        time.sleep(seconds)
    writer.kill()
    _, errors = writer.communicate()
    assert ready, f"the crash writer did not open the store: {errors[-2000:]}"
    return int(Path(config["manifest"] + ".started").read_text())


def map_count() -> int:
    """How many memory maps this process has (``vm.max_map_count`` caps them, ~65k by default)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


# -- child processes ------------------------------------------------------------------------------
@contextmanager
def child_session(command: Sequence[str], **options: Any) -> Iterator[subprocess.Popen[str]]:
    """Start ``command`` (text mode) as the leader of a session of its own, and on leaving the
    block, however it is left (a timeout, a failed assertion, Ctrl-C), kill what is left of that
    session: the child and everything it started (DeepSpeed's workers, and the compilers of a
    build, which ninja runs in process groups of their own). Then remove the torch extension build
    locks that no process holds any more, so that a build killed half-way cannot make every later
    build of that op wait for ever (see :func:`remove_abandoned_build_locks`).

    Args:
        command: the program and its arguments.
        options: further :class:`subprocess.Popen` arguments (``stdout``, ``env``...); the
            child's environment (``env``, else this process's) names the extensions directory.
    """
    child = subprocess.Popen(command, start_new_session=True, text=True, **options)
    try:
        yield child
    finally:
        _kill_session(child)
        extensions = (options.get("env") or os.environ).get("TORCH_EXTENSIONS_DIR")
        if extensions:
            remove_abandoned_build_locks(Path(extensions))


def run_child(
    command: Sequence[str],
    *,
    timeout: float | None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in a session of its own (:func:`child_session`) and collect its output, as
    ``subprocess.run(command, capture_output=True, text=True)`` does.

    Args:
        command: the program and its arguments.
        timeout: seconds the child may run; None for no limit (Ctrl-C still ends it).
        env: the child's environment; None for this process's.
        cwd: the child's working directory; None for this process's.

    Returns:
        Its exit status, stdout and stderr.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout``; it and everything it started are
            killed by then, and the exception carries what the child wrote.
    """
    with child_session(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            _kill_session(child)  # then its output ends
            stdout, stderr = child.communicate()
            raise subprocess.TimeoutExpired(expired.cmd, expired.timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(list(command), child.returncode, stdout, stderr)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on: a process group's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_ranks(
    command: Sequence[str], world: int, *, timeout: float, env: Mapping[str, str] | None = None
) -> None:
    """Run ``command`` as every rank of a process group of ``world`` ranks on this machine, each in
    a session of its own (:func:`child_session`: all are killed when one fails or runs out of time),
    and fail unless each one exits 0 (the message is the end of its output).

    Args:
        command: the program and its arguments, the same for each rank.
        world: how many ranks.
        timeout: seconds each rank may run.
        env: variables the ranks get beside this process's environment and ``RANK``, ``WORLD_SIZE``,
            ``MASTER_ADDR`` and ``MASTER_PORT``.
    """
    group = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with ExitStack() as sessions:
        ranks = [
            sessions.enter_context(
                child_session(
                    command,
                    env={**os.environ, **(env or {}), **group, "RANK": str(rank)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
            for rank in range(world)
        ]
        logs = [rank.communicate(timeout=timeout)[0] for rank in ranks]
    for rank, log in zip(ranks, logs, strict=True):
        assert rank.returncode == 0, log[-4000:]


def _kill_session(leader: subprocess.Popen[str]) -> None:
    """SIGKILL every process of ``leader``'s session until none is left running (up to 60 s), and
    reap the leader. A Ctrl-C meanwhile (``timeout -s INT`` sends two, a user may press it twice)
    waits until this is done."""
    with interrupts_deferred():
        deadline = time.monotonic() + 60
        while (left := session_processes(leader.pid)) and time.monotonic() < deadline:
            for pid in left:
                with suppress(ProcessLookupError):  # ended meanwhile
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        leader.wait()


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT off in the block, then raise the KeyboardInterrupt it would have raised (only
    the main thread handles signals; elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def session_processes(session: int) -> list[int]:
    """The processes of session ``session`` that have not ended (zombies hold nothing open)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        state, session_id = fields[0], int(fields[3])
        if session_id == session and state != "Z":
            found.append(int(entry.name))
    return found


def remove_abandoned_build_locks(extensions: Path) -> None:
    """Remove the build locks under a torch extensions directory that no process holds.

    torch's JIT build (``torch.utils.cpp_extension.load``, which DeepSpeed's op builders call)
    takes ``<extensions>/<op>/lock`` by creating it and keeps it open until the build ends, then
    deletes it; every other build or load of that op waits while the file exists. A process
    killed half-way leaves the file behind, open in no process any more.

    Args:
        extensions: the directory (``TORCH_EXTENSIONS_DIR``).
    """
    locks = list(extensions.glob("*/lock"))
    if not locks:
        return
    held = set()
    for descriptor in Path("/proc").glob("[0-9]*/fd/*"):
        with suppress(OSError):  # closed meanwhile
            held.add(os.readlink(descriptor))
    for lock in locks:
        if os.path.realpath(lock) not in held:
            lock.unlink(missing_ok=True)


# -- optimizers against their references ----------------------------------------------------------
class LossScaledOptimizer(Protocol):
    """An offloaded optimizer: it unscales (and checks) the gradients itself."""

    def step(self, closure: Any = None, *, grad_scale: float = 1.0) -> Any: ...


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``|got - expected| / |expected|`` in the 2-norm (a zero ``expected`` counts as 1e-30)."""
    got, expected = got.detach(), expected.detach()
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))


def twin_parameters(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Seed torch's global generator with 0, then draw a model of ``shapes`` in ``dtype`` and
    return it with its fp32 reference twin (the same values). The gradients
    :func:`train_against_reference` draws next come from the same generator, so a run repeats."""
    torch.manual_seed(0)
    model = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in shapes]
    reference = [torch.nn.Parameter(p.detach().float().clone()) for p in model]
    return model, reference


@dataclass(frozen=True)
class TrainingLoop:
    """How :func:`train_against_reference` trains both optimizers.

    Attributes:
        steps: how many steps; the gradients are drawn from torch's global generator.
        max_grad_norm: the clipping norm, or None for no clipping (the optimizer under test is
            built with the same norm).
        grad_scale: the loss scale the gradients carry.
        overflow_at: a step whose gradients hold an inf, which the optimizer under test must skip
            (the reference skips it too), or None.
    """

    steps: int = 20
    max_grad_norm: float | None = None
    grad_scale: float = 1.0
    overflow_at: int | None = None


PLAIN_LOOP = TrainingLoop()
"""Twenty steps without clipping, loss scale or overflow."""


def train_against_reference(
    optimizer: LossScaledOptimizer,
    model: list[torch.nn.Parameter],
    expected: torch.optim.Optimizer,
    reference: list[torch.nn.Parameter],
    loop: TrainingLoop,
    *,
    overflow_element: tuple[int, ...] = (1, 3),
) -> None:
    """A mixed-precision training loop for ``optimizer`` over ``model``, and the same loop in fp32
    for the reference optimizer ``expected`` over ``reference``.

    Args:
        optimizer: the optimizer under test; it gets each gradient in its parameter's dtype,
            multiplied by ``loop.grad_scale``, and unscales (and clips) it itself.
        model: ``optimizer``'s parameters.
        expected: the reference optimizer; it gets the same gradients in fp32, unscaled and
            clipped to ``loop.max_grad_norm`` (if set) by ``torch.nn.utils.clip_grad_norm_``.
        reference: ``expected``'s parameters, twins of ``model`` (see :func:`twin_parameters`).
        loop: the steps, clipping, loss scale and overflowing step.
        overflow_element: where the inf of ``loop.overflow_at`` is: the gradient's index in
            ``model``, then the element's index in that gradient.
    """
    for step in range(loop.steps):
        grads = [torch.randn(param.shape).mul(loop.grad_scale).to(param.dtype) for param in model]
        if step == loop.overflow_at:
            grads[overflow_element[0]][overflow_element[1:]] = float("inf")
        for param, grad in zip(model, grads, strict=True):
            param.grad = grad
        optimizer.step(grad_scale=loop.grad_scale)
        if step == loop.overflow_at:
            continue
        for param, grad in zip(reference, grads, strict=True):
            param.grad = grad.float() / loop.grad_scale
        if loop.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference, loop.max_grad_norm)
        expected.step()


def train_side_by_side(
    optimizer: torch.optim.Optimizer,
    model: list[torch.nn.Parameter],
    expected: torch.optim.Optimizer,
    reference: list[torch.nn.Parameter],
    steps: range,
    *,
    exact: bool = False,
) -> None:
    """Step ``optimizer`` over ``model`` and ``expected`` over ``reference`` (its twin: the same
    shapes and values) with the same gradients, seeded by each of ``steps``; with ``exact``, the two
    models must then be equal to the bit."""
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for param, twin in zip(model, reference, strict=True):
            param.grad = torch.randn(param.shape, generator=generator)
            twin.grad = param.grad.clone()
        optimizer.step()
        expected.step()
    if exact:
        for got, want in zip(model, reference, strict=True):
            assert torch.equal(got.detach(), want.detach())


def train_seeded(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    """Step ``optimizer`` over ``params`` once for each of ``steps``, with gradients in each
    parameter's dtype drawn from a generator seeded by the step (so that a resumed run draws what an
    uninterrupted one does)."""
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        optimizer.step()


def assert_resume_equals_uninterrupted(
    tmp_path: Path,
    shapes: Sequence[tuple[int, ...]],
    make: Callable[[list[torch.nn.Parameter], TierStore, str], StagedOptimizer],
) -> dict[str, Any]:
    """Train bf16 parameters of ``shapes`` for 10 steps straight; train them 5 steps, save, then
    resume on another tier and train the other 5, from the state dict (with the parameters as saved)
    and from an HDF5 snapshot in ``tmp_path`` (whose master weights are copied into fresh
    parameters): both resumed runs must end equal to the bit to the uninterrupted one.

    Args:
        tmp_path: the test's folder, for the stores and the snapshot.
        shapes: the parameters' shapes.
        make: builds the optimizer under test over the parameters, on the store, with the
            namespace given (each run takes its own).

    Returns:
        The state dict saved after 5 steps, for the caller's checks of its entries.
    """

    def fresh() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in shapes]

    with make_store(tmp_path, "dram") as store:
        params = fresh()
        straight = make(params, store, "a")
        train_seeded(straight, params, range(10))
        expected = straight.master_params()

    with make_store(tmp_path, "dram") as store:
        params = fresh()
        first = make(params, store, "b")
        train_seeded(first, params, range(5))
        checkpoint = first.state_dict()
        saved_params = [p.detach().clone() for p in params]

    with make_store(tmp_path, "nvme") as store:  # resume on another tier
        params = fresh()
        for param, saved in zip(params, saved_params, strict=True):
            param.data.copy_(saved)
        resumed = make(params, store, "c")
        resumed.load_state_dict(checkpoint)
        train_seeded(resumed, params, range(5, 10))
        for got, want in zip(resumed.master_params(), expected, strict=True):
            assert torch.equal(got, want)

    with make_store(tmp_path, "dram") as store:  # the same through an HDF5 snapshot
        params = fresh()
        first = make(params, store, "snap")
        train_seeded(first, params, range(5))
        first.save_snapshot(tmp_path / "snapshot.h5")
    with make_store(tmp_path, "nvme") as store:
        params = fresh()  # the snapshot's master weights are copied into the model
        resumed = make(params, store, "snap")
        resumed.load_snapshot(tmp_path / "snapshot.h5")
        train_seeded(resumed, params, range(5, 10))
        for got, want in zip(resumed.master_params(), expected, strict=True):
            assert torch.equal(got, want)
    return checkpoint


# -- models trained with and without an activation offloader ---------------------------------------
def small_llama_config() -> Any:
    """The config of a Hugging Face Llama small enough for a test on a CPU: 2 layers 64 wide, a
    vocabulary of 128, eager attention (random weights from it, nothing downloaded). Needs
    ``transformers``."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",  # type: ignore[call-arg]  # a keyword of PretrainedConfig's
    )


Gradients = list[list[torch.Tensor]]
"""Each step's gradients, one per parameter that has one, in the model's order."""


def sgd_gradients(
    model: torch.nn.Module,
    inputs: Callable[[int], torch.Tensor],
    steps: int,
    *,
    forward: Callable[[], AbstractContextManager[object]] = nullcontext,
    backward: Callable[[torch.Tensor, torch.nn.Module], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> Gradients:
    """The gradients of ``steps`` SGD steps (learning rate 0.01) of ``model`` on ``inputs(step)``,
    the loss the mean square of its output, torch's seed ``100 + step`` for each step's forward.

    Args:
        model: the model, made under a fixed seed, so that two runs start alike.
        inputs: each step's batch, from ``step`` alone (its own generator: the seed may not matter).
        steps: how many steps.
        forward: the context each forward runs in (an offloader, a held device...).
        backward: how the loss is taken back through ``model``; None for ``loss.backward()``.
        after_step: a check run after each step (an offloader's budgets).
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gradients = []
    for step in range(steps):
        batch = inputs(step)
        torch.manual_seed(100 + step)
        optimizer.zero_grad(set_to_none=True)
        with forward():
            loss = model(batch).float().pow(2).mean()
        if backward is None:
            loss.backward()
        else:
            backward(loss, model)
        gradients.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        optimizer.step()
        if after_step is not None:
            after_step()
    return gradients


def assert_same_gradients(expected: Gradients, got: Gradients, message: str = "gradients differ") -> None:
    """Fail unless each step's gradients are equal to the bit; the message names the first step that
    differs and by how much."""
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert len(want) == len(have)
        for a, b in zip(want, have, strict=True):
            assert torch.equal(a, b), f"step {step + 1}: {message} by {(a - b).abs().max()}"
