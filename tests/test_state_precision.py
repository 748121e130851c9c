"""The compressed state formats' kernels against plain per-element references and their analytic
error bounds, on random and adversarial moments."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from tierstore.optimizer import state_kernels as kernels
from tierstore.optimizer.partition import KERNEL_ALIGNMENT, partition
from tierstore.optimizer.state_kernels import (
    BLOCK,
    QUANTISE_CHUNK,
    compensate,
    compensated_master,
    dequantise_blockwise,
    dynamic_map,
    quantise_blockwise,
    settled_master,
)
from tierstore.optimizer.state_precision import (
    PRESETS,
    PackedLayout,
    RowKind,
    StatePrecision,
    spans,
    state_precision,
)

from tierstore import ConfigError

from .helpers import run_child

TINY = 2.0**-140
"""A denormal fp32 value."""


def reference_map(signed: bool) -> list[float]:
    """The dynamic-tree map by its formula: 0, and 10^d (0.1 + 0.9 k / 2^i), k = 1..2^i, for the
    i-th decade d counted up from the smallest, both signs for the signed map."""
    decades = 7 if signed else 8
    values = {0.0}
    for i in range(decades):
        for k in range(1, 2**i + 1):
            value = 10.0 ** (i - decades + 1) * (0.1 + 0.9 * k / 2**i)
            values.add(value)
            if signed:
                values.add(-value)
    return sorted(values)


def reference_quantise(values: list[float], signed: bool) -> tuple[list[int], list[float]]:
    """Per block its largest magnitude, per element the index of the map entry nearest to the value
    over it (the one of smaller magnitude on a tie)."""
    table = [float(torch.tensor(v, dtype=torch.float32)) for v in reference_map(signed)]
    codes, peaks = [], []
    for start in range(0, len(values), BLOCK):
        block = values[start : start + BLOCK]
        peak = max(abs(v) for v in block)
        peaks.append(peak)
        for value in block:
            normalised = float(torch.tensor(value) / torch.tensor(peak)) if peak > 0 else 0.0  # in fp32
            codes.append(min(range(len(table)), key=lambda i: (abs(table[i] - normalised), abs(table[i]))))
    return codes, peaks


def half_gap(normalised: float, table: list[float]) -> float:
    """Half the gap between the map's entries around ``normalised``."""
    above = next((i for i, v in enumerate(table) if v >= normalised), len(table) - 1)
    above = min(max(above, 1), len(table) - 1)
    return (table[above] - table[above - 1]) / 2


def moments(case: str, signed: bool) -> torch.Tensor:
    """A row of 3 blocks and a partial one, random or adversarial."""
    generator = torch.Generator().manual_seed(7)
    n = 3 * BLOCK + 77
    values = (
        torch.randn(n, generator=generator) * torch.logspace(-8, 0, n)[torch.randperm(n, generator=generator)]
    )
    if case == "zeros":
        values = torch.zeros(n)
    elif case == "outliers":
        values[5], values[BLOCK + 9] = 3e18, -1e15  # squares within fp32
    elif case == "denormals":
        values = values * TINY
    elif case == "all-equal":
        values = torch.full((n,), -0.37)
    elif case == "mixed-zero-block":
        values[:BLOCK] = 0.0
    return values if signed else values.square()


CASES = ["random", "zeros", "outliers", "denormals", "all-equal", "mixed-zero-block"]


def test_the_dynamic_map_is_its_formula() -> None:
    for signed in (True, False):
        table = dynamic_map(signed)
        assert table.tolist() == [float(torch.tensor(v, dtype=torch.float32)) for v in reference_map(signed)]
        assert len(table) == (255 if signed else 256)
        assert table.max() == 1.0 and (table.min() == -1.0 if signed else table.min() == 0.0)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_int8_quantisation_matches_the_reference_and_its_bound(case: str, signed: bool) -> None:
    values = moments(case, signed)
    blocks = -(-values.numel() // BLOCK)
    codes = torch.empty(values.numel(), dtype=torch.uint8)
    absmax = torch.empty(blocks)
    quantise_blockwise(values, codes, absmax, signed)
    expected_codes, peaks = reference_quantise(values.tolist(), signed)
    assert absmax.tolist() == peaks
    assert codes.tolist() == expected_codes
    restored = torch.empty_like(values)
    dequantise_blockwise(codes, absmax, restored, signed)
    table = reference_map(signed)
    for i, (value, back) in enumerate(zip(values.tolist(), restored.tolist(), strict=True)):
        peak = peaks[i // BLOCK]
        normalised = value / peak if peak > 0 else 0.0
        bound = half_gap(normalised, table) * peak + 2.0**-22 * peak + 2.0**-149
        assert abs(value - back) <= bound, (i, value, back, bound)
    for i, peak in enumerate(peaks):  # a block's largest magnitude comes back exactly
        block = values[i * BLOCK : (i + 1) * BLOCK]
        largest = int(block.abs().argmax())
        assert abs(float(restored[i * BLOCK + largest])) == peak


def long_moments(case: str, signed: bool, tail: int) -> torch.Tensor:
    """:func:`moments` repeated past a quantisation chunk (the torch operations' unit), each copy
    scaled differently, ending in a partial block of ``tail`` elements."""
    short = moments(case, signed)
    copies = -(-(QUANTISE_CHUNK + 2 * BLOCK) // short.numel())
    scales = torch.logspace(-3, 3, copies).repeat_interleave(short.numel())
    values = short.repeat(copies) * scales
    if case == "nan-block":
        values[BLOCK + 3] = math.nan
    return values[: (QUANTISE_CHUNK // BLOCK + 1) * BLOCK + tail]


def kernel_results(values: torch.Tensor, signed: bool) -> list[torch.Tensor]:
    """Codes, block maxima, dequantised values, a bf16 compensation of ``values`` and the master
    weights it restores, as raw bits."""
    codes = torch.empty(values.numel(), dtype=torch.uint8)
    absmax = torch.empty(-(-values.numel() // BLOCK))
    quantise_blockwise(values, codes, absmax, signed)
    restored = torch.empty_like(values)
    dequantise_blockwise(codes, absmax, restored, signed)
    compensation = torch.empty(values.numel(), dtype=torch.bfloat16)
    compensate(values, torch.bfloat16, compensation)
    master = torch.empty_like(values)
    compensated_master(values.bfloat16(), compensation, master)
    return [
        codes,
        absmax.view(torch.int32),
        restored.view(torch.int32),
        compensation.view(torch.int16),
        master.view(torch.int32),
    ]


RESULTS = ["codes", "absmax", "dequantised", "compensation", "master"]


@pytest.mark.parametrize("tail", [3, 64], ids=["tail of 3", "tail of 64"])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("case", [*CASES, "nan-block"])
def test_the_cpu_kernels_give_the_torch_operations_bits(
    case: str, signed: bool, tail: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU runs the kernels in C++, the device path as torch operations: one format either way,
    on whole blocks of eight-element vectors and on short blocks with and without a partial one."""
    if shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip("no C++ compiler: the kernels run as torch operations")
    assert kernels._native() is not None, "the C++ kernels did not build"
    values = long_moments(case, signed, tail)
    native = kernel_results(values, signed)
    monkeypatch.setattr(kernels, "_native_for", lambda *tensors: None)
    for name, ours, theirs in zip(RESULTS, native, kernel_results(values, signed), strict=True):
        assert torch.equal(ours, theirs), name


def test_the_cpu_kernels_share_a_row_among_threads_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With several intra-op threads a row is cut at blocks into a part per thread: the same bits."""
    values = long_moments("outliers", True, 3)
    alone = kernel_results(values, True)
    monkeypatch.setattr(kernels, "PARALLEL_MIN_NUMEL", BLOCK)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        shared = kernel_results(values, True)
    finally:
        torch.set_num_threads(before)
    for name, ours, theirs in zip(RESULTS, shared, alone, strict=True):
        assert torch.equal(ours, theirs), name


FAILING_COMPILER = """
import json, warnings, torch
from tierstore.optimizer import state_kernels as kernels
values = torch.randn(4 * kernels.BLOCK + 5, generator=torch.Generator().manual_seed(0))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", RuntimeWarning)
    for _ in range(2):
        codes, absmax = torch.empty(values.numel(), dtype=torch.uint8), torch.empty(5)
        kernels.quantise_blockwise(values, codes, absmax, True)
ours = [str(w.message) for w in caught if "tierstore" in str(w.message)]
print(json.dumps({"warnings": ours, "codes": codes.tolist()}))
"""


def test_without_a_cxx_compiler_the_kernels_run_as_torch_operations_with_one_warning(
    tmp_path: Path,
) -> None:
    done = run_child(
        [sys.executable, "-c", FAILING_COMPILER],
        timeout=300,
        env={**os.environ, "CXX": "/nonexistent/c++", "XDG_CACHE_HOME": str(tmp_path)},  # nothing built yet
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert len(result["warnings"]) == 1  # once per process
    assert "torch operations" in result["warnings"][0] and "/nonexistent/c++" in result["warnings"][0]
    values = torch.randn(4 * BLOCK + 5, generator=torch.Generator().manual_seed(0))
    codes, absmax = torch.empty(values.numel(), dtype=torch.uint8), torch.empty(5)
    quantise_blockwise(values, codes, absmax, True)  # here, by the C++ kernels
    assert result["codes"] == codes.tolist()
    assert not list(tmp_path.rglob("*.so"))


def test_quantising_what_was_dequantised_gives_the_same_codes() -> None:
    """A compressed state saved and loaded through fp32 comes back bit for bit."""
    for signed in (True, False):
        values = moments("random", signed)
        codes = torch.empty(values.numel(), dtype=torch.uint8)
        absmax = torch.empty(-(-values.numel() // BLOCK))
        quantise_blockwise(values, codes, absmax, signed)
        restored = torch.empty_like(values)
        dequantise_blockwise(codes, absmax, restored, signed)
        again, again_max = torch.empty_like(codes), torch.empty_like(absmax)
        quantise_blockwise(restored, again, again_max, signed)
        assert torch.equal(again, codes) and torch.equal(again_max, absmax)


@pytest.mark.parametrize("case", CASES)
def test_bf16_moments_within_half_a_bf16_step(case: str) -> None:
    values = moments(case, True)
    layout = PackedLayout(("signed",), values.numel(), PRESETS["bf16"])
    packed = torch.empty(layout.words)
    layout.encode(values, packed)
    restored = torch.empty_like(values)
    layout.decode(packed, restored)
    for value, back in zip(values.tolist(), restored.tolist(), strict=True):
        if abs(value) >= 2.0**-126:
            assert abs(value - back) <= 2.0**-8 * abs(value)
        else:  # bf16's subnormals: its smallest step is 2^-133
            assert abs(value - back) <= 2.0**-134


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compensated_master_keeps_what_the_parameter_cannot_and_rounds_to_it(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    master = torch.randn(4096, generator=generator) * 3
    below_half = 1.0 + 2.0**-7 + 2.0**-8 * (1 - 2.0**-10)  # a residual bf16 rounds up to half a step
    master[:8] = torch.tensor([below_half, -below_half, 1.0 + 2.0**-8, 0.0, TINY, 1e-3, 2.0, -2.0])
    compensation = torch.empty(master.numel(), dtype=torch.bfloat16)
    compensate(master, dtype, compensation)
    param = master.to(dtype)
    restored = param.float() + compensation.float()
    settled_master(restored, param)
    assert torch.equal(restored.to(dtype), param)  # the parameter rounds from the master handed out
    residual = (master - param.float()).abs()
    # the compensation is the residual rounded to bf16 (8 significant bits), one fp32 step more
    # where the master was settled
    bound = 2.0**-8 * residual + 2.0**-133 + 2.0**-23 * master.abs()
    assert bool(((master - restored).abs() <= bound).all())


def test_compensated_updates_below_bf16_resolution_accumulate() -> None:
    """1000 updates of 1e-4 to a weight of 1.0: bf16 alone stays at 1.0 (its step there is 2^-7),
    the compensated pair moves by 0.1 (within 5%: each step rounds the compensation to bf16)."""
    param = torch.ones(1, dtype=torch.bfloat16)
    plain = param.clone()
    compensation = torch.zeros(1, dtype=torch.bfloat16)
    for _ in range(1000):
        master = param.float() + compensation.float() + 1e-4
        param = master.to(torch.bfloat16)
        compensate(master, torch.bfloat16, compensation)
        plain = (plain.float() + 1e-4).to(torch.bfloat16)
    assert float(plain) == 1.0
    assert math.isclose(float(param.float() + compensation.float()) - 1.0, 0.1, rel_tol=0.05)


@pytest.mark.parametrize("name", list(PRESETS))
def test_packed_layouts_round_trip_and_store_their_bytes(name: str) -> None:
    precision = PRESETS[name]
    numel = 3 * BLOCK + 5
    kinds: tuple[RowKind, ...] = ("master", "signed", "nonnegative")
    rows = torch.randn(3, numel)
    rows[2] = rows[2].square()
    params = rows[0].to(torch.bfloat16)
    rows[0] = params.float()  # master weights the parameter rounds from
    layout = PackedLayout(kinds, numel, precision)
    packed = torch.full((layout.words,), float("nan"))
    layout.encode(rows, packed, [(0, numel, torch.bfloat16)])
    restored = torch.empty_like(rows)
    layout.decode(packed, restored, [(0, params.float())])
    widths = {"fp32": 12, "bf16": 8, "int8": 6, "int8-compensated": 4}[name]
    blocks = 2 * 4 * -(-numel // BLOCK) if precision.moments == "int8" else 0
    assert widths * numel + blocks <= 4 * layout.words <= widths * numel + blocks + 64 * 5
    if name == "fp32":
        assert torch.equal(restored, rows)
    again = torch.full_like(packed, 7.0)  # the padding is written too
    layout.encode(restored, again, [(0, numel, torch.bfloat16)])
    assert torch.equal(
        again.view(torch.int32), packed.view(torch.int32)
    )  # what was decoded encodes to the same bytes


def test_state_precision_takes_presets_and_formats_and_refuses_the_rest() -> None:
    assert state_precision("fp32") == StatePrecision()
    assert state_precision("int8-compensated") == StatePrecision("int8", "bf16-compensated")
    assert state_precision({"moments": "bf16"}) == StatePrecision("bf16")
    assert state_precision(StatePrecision("int8")).name == "int8"
    wrong_master = StatePrecision("bf16", "fp16")  # type: ignore[arg-type]
    for bad in ("int4", 8, None, {"moments": "fp8"}, wrong_master, {"other": 1}):
        with pytest.raises(ConfigError, match=r"^state_precision: "):
            state_precision(bad)


@pytest.mark.parametrize("sizes", [[5000], [640, 4100, 3], [1000, 77, 2600, 1280, 64]])
def test_spans_cut_at_blocks_and_aligned_parameter_offsets_and_cover_the_sub_group(sizes: list[int]) -> None:
    """Each span starts on a block of the sub-group; a piece is cut only at an aligned offset of
    its parameter; the spans' pieces are the sub-group's, rebased to each span's start."""
    for sg in partition([list(enumerate(sizes))], 6000):
        parts = spans(sg, 2 * BLOCK)
        assert parts[0][0] == 0 and len(parts) > 1
        covered = []
        for (start, part), (stop, _) in zip(parts, [*parts[1:], (sg.numel, None)], strict=True):
            assert start % BLOCK == 0 and part.numel == stop - start and part.group == sg.group
            for piece in part.pieces:
                assert piece.offset >= 0 and piece.offset + piece.length <= part.numel
                covered.append((piece.param, piece.param_offset, start + piece.offset, piece.length))
        assert covered == sorted(covered, key=lambda c: c[2])
        merged: list[list[int]] = []
        for param, param_offset, offset, length in covered:
            if merged and merged[-1][0] == param and merged[-1][1] + merged[-1][3] == param_offset:
                assert param_offset % KERNEL_ALIGNMENT == 0  # a cut inside a piece
                merged[-1][3] += length
            else:
                merged.append([param, param_offset, offset, length])
        assert [tuple(m) for m in merged] == [
            (p.param, p.param_offset, p.offset, p.length) for p in sg.pieces
        ]
