import json
import re
from pathlib import Path
from typing import Any

import pytest

from tierstore.cli import main

VIRTUAL = """
[[tiers]]
name = "virtual"

[[tiers.paths]]
name = "fast"
backend = {{ type = "throttle", inner = "dram://", read_bytes_per_s = "400MB", write_bytes_per_s = "400MB" }}

[[tiers.paths]]
name = "disk"
backend = "nvme://{root}"
"""


def test_train_offloads_optimizer_state_and_activations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = ["train", "--dir", str(tmp_path / "data"), "--layers", "2", "--width", "128", "--steps", "4"]
    budgets = ["--sub-group-size", "20000", "--dram-budget", "1MiB", "--activation-budget", "4MiB"]
    assert main([*arguments, *budgets]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state_over_budget"] > 1.5 and report["subgroups"] > 1
    assert report["loss_decreased"] and len(report["steps"]) == 4
    assert all(step["gb_per_s"]["nvme"] > 0 for step in report["steps"])
    for step in report["steps"]:
        assert 0 < step["peak_resident_activation_bytes"] <= 4 << 20
        assert step["keep_in_memory_activation_bytes"] > 2 * (4 << 20)
    assert report["steps"][-1]["activation_plan"] == "lifetime"
    assert report["activation_stats"]["spilled_bytes"] > 0
    assert report["memory"]["budget_bytes"] == 5 << 20  # one ledger: 1 MiB optimizer + 4 MiB activations
    assert sorted(report["memory"]["reserved_bytes"]) == [
        "activations activations",
        "cache",
        "optimizer adamw",
    ]
    assert not (tmp_path / "data").exists()  # no objects left, nor the directory the run made


def test_train_with_apollo_mini(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["train", "--dir", str(tmp_path / "data"), "--layers", "2", "--width", "128", "--steps", "4"]
    budgets = ["--sub-group-size", "20000", "--dram-budget", "2MiB", "--activation-budget", "4MiB"]
    assert main([*arguments, *budgets, "--optimizer", "apollo-mini"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["optimizer"] == "apollo-mini" and report["loss_decreased"]
    assert "optimizer apollo" in report["memory"]["reserved_bytes"]
    # the blocks' matrices keep rank-1 moments: well under AdamW's 12 bytes per parameter
    assert report["fp32_state_bytes"] < 8 * report["parameters"]
    assert not (tmp_path / "data").exists()


def test_spill_round_trips_and_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spill", "--dir", str(tmp_path / "data"), "--total", "8MiB", "--object", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "verified=True" in out
    assert not (tmp_path / "data").exists()  # the store removed its objects, the CLI the directory


def test_spill_reports_what_reached_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Within the DRAM budget no read reaches a tier, and the report says so instead of passing
    memory copies off as tier throughput; ``--budget`` makes it spill."""
    monkeypatch.chdir(tmp_path)  # the embedded config's ./tierstore-data
    assert main(["spill", "--total", "4MiB", "--object", "1MiB"]) == 0
    report, summary = _report_and_summary(capsys.readouterr().out)
    assert report["cache_budget_bytes"] == 256 << 20
    assert report["tier_bytes_written"] == 4 << 20 and report["tier_bytes_read"] == 0  # flush only
    assert "every read was served from DRAM" in summary and "verified=True" in summary
    assert main(["spill", "--total", "4MiB", "--object", "1MiB", "--budget", "1MiB"]) == 0
    report, summary = _report_and_summary(capsys.readouterr().out)
    assert report["cache_budget_bytes"] == 1 << 20 and report["tier_bytes_written"] >= 3 << 20
    assert report["tier_bytes_read"] >= 3 << 20 and "4.0x the DRAM budget" in summary
    assert main(["spill", "--total", "4MiB", "--object", "1MiB", "--budget", "0"]) == 0
    report, summary = _report_and_summary(capsys.readouterr().out)
    assert report["tier_bytes_written"] == report["tier_bytes_read"] == 4 << 20
    assert "no DRAM cache" in summary and "served from DRAM" not in summary
    assert list(tmp_path.iterdir()) == []  # ./tierstore-data was made by each run and removed


def _report_and_summary(out: str) -> tuple[dict[str, Any], str]:
    text, _, summary = out.rstrip("\n").rpartition("\n")
    return json.loads(text), summary


def test_spill_keeps_a_directory_it_did_not_create(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.txt").write_text("keep")
    assert main(["spill", "--dir", str(tmp_path / "data"), "--total", "1MiB", "--object", "1MiB"]) == 0
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["mine.txt"]
    nested = tmp_path / "made" / "for" / "it"
    assert main(["spill", "--dir", str(nested), "--total", "1MiB", "--object", "1MiB", "--budget", "0"]) == 0
    assert not (tmp_path / "made").exists()  # the parents it made go too


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["spill", "--object", "0"], "argument --object: must be a positive multiple of 4 bytes"),
        (["spill", "--object", "3", "--total", "12"], "argument --object: must be a positive multiple of 4"),
        (["spill", "--total", "1000"], "argument --total: 1000 bytes is not a multiple of --object"),
        (["spill", "--total", "0"], "argument --total: must be at least 1 byte"),
        (["spill", "--budget", "true"], "argument --budget: 'true' is not a size"),
        (["spill", "--budget", "-1"], "argument --budget: '-1' is not a size"),
        (["train", "--steps", "0"], "argument --steps: must be at least 1, not 0"),
        (["train", "--sub-group-size", "0"], "argument --sub-group-size: must be at least 1, not 0"),
        (["train", "--layers", "two"], "argument --layers: 'two' is not an integer"),
        (["train", "--width", "-8"], "argument --width: must be at least 1, not -8"),
        (["train", "--dram-budget", "0"], "argument --dram-budget: must be at least 1 byte"),
        (["probe", "c.toml", "--size", "0"], "argument --size: must be at least 1 byte"),
        (["bench", "c.toml", "--objects", "0"], "argument --objects: must be at least 1, not 0"),
        (["bench", "c.toml", "--size", "0B"], "argument --size: must be at least 1 byte"),
    ],
)
def test_bad_options_are_usage_errors_naming_the_option(
    arguments: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(arguments)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: tierstore {arguments[0]}" in err and message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing created


@pytest.mark.parametrize("command", [[], ["train"], ["spill"], ["probe"], ["bench"]])
def test_every_option_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "The ``tierstore`` command line" not in text and "``" not in text
    entries = [line for line in text.splitlines() if re.match(r"  \S", line)]  # options and positionals
    assert entries
    lines = text.splitlines()
    for line in entries:
        following = lines[lines.index(line) + 1] if lines.index(line) + 1 < len(lines) else ""
        described = re.search(r"\S  +\S", line) or re.match(r" {6,}\S", following)
        assert described, f"no help text for {line.strip()!r} in tierstore {' '.join(command)}"


def test_the_description_says_what_tierstore_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "Spill PyTorch tensors through a DRAM cache onto NVMe, Zarr and ADIOS2 tiers" in " ".join(
        capsys.readouterr().out.split()
    )


def test_probe_reports_and_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tmp_path / "c.toml"
    config.write_text(VIRTUAL.format(root=tmp_path / "disk"))
    assert main(["probe", str(config), "--size", "4MiB"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"fast", "disk"}
    assert 0 < report["fast"]["write_gb_per_s"] <= 0.41  # throttled to 0.4 GB/s; how far below is load
    assert (tmp_path / "cache" / "tierstore" / "bandwidth.json").exists()


def test_bench_writes_json_and_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    config.write_text(VIRTUAL.format(root=tmp_path / "disk"))
    output, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(
        [
            "bench",
            str(config),
            "--size",
            "4MiB",
            "--objects",
            "3",
            "--output",
            str(output),
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    report = json.loads(output.read_text())
    tier = report["tiers"]["virtual"]
    assert set(tier["paths_alone"]) == {"fast", "disk"}
    assert tier["tier"]["bytes"] == 3 * (4 << 20)
    assert set(report["timeline_gb_per_s"]) == {"fast", "disk"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(capsys.readouterr().out) == report


def test_bad_config_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.json"
    config.write_text('{"tiers": [{"name": "x", "backend": "warp://"}]}')
    assert main(["bench", str(config)]) == 2
    assert "unknown backend 'warp'" in capsys.readouterr().err
