"""The CLI only maps flags onto frozen configs: the speed switches land where they should."""

from __future__ import annotations

import pytest

from meshnet.cli import build_parser, node_config, tracker_node_config


@pytest.mark.parametrize(
    ("flags", "fast_path", "compile"),
    [([], True, True), (["--no-compile"], True, False), (["--no-fast-path"], False, True)],
)
def test_speed_switches_map_onto_node_config(
    flags: list[str], fast_path: bool, compile: bool
) -> None:
    node = node_config(build_parser().parse_args(["node", "--quant", "int8", *flags]))
    tracker = tracker_node_config(
        build_parser().parse_args(["tracker", "--layers", "0:10", *flags])
    )
    for config in (node, tracker):
        assert (config.fast_path, config.compile) == (fast_path, compile)
    assert node.quant == "int8"


def test_flag_defaults_are_the_config_defaults() -> None:
    from meshnet.cli.configs import entry_config, tracker_config
    from meshnet.config import EntryConfig, NodeConfig, TrackerConfig

    node = build_parser().parse_args(["node"])
    assert node_config(node) == NodeConfig()
    assert entry_config(node) == EntryConfig()
    tracker = build_parser().parse_args(["tracker"])
    assert tracker_config(tracker) == TrackerConfig()
    assert entry_config(build_parser().parse_args(["tracker", "--hop-timeout", "4"])) == (
        EntryConfig(hop_timeout_s=4.0)
    )


def test_quant_choices_are_the_quant_type() -> None:
    from meshnet.types import QUANTS

    for quant in QUANTS:
        assert node_config(build_parser().parse_args(["node", "--quant", quant])).quant == quant
    with pytest.raises(SystemExit):
        build_parser().parse_args(["node", "--quant", "int4"])


def test_a_bad_compute_dtype_stops_any_command_with_its_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshnet.cli import main

    monkeypatch.setenv("MESHNET_COMPUTE_DTYPE", "fp16")
    assert main(["status", "--tracker", "http://127.0.0.1:9"]) == 2
    assert "$MESHNET_COMPUTE_DTYPE must be one of fp32, bf16, got 'fp16'" in capsys.readouterr().err


@pytest.mark.parametrize(("value", "expected"), [("fp32", "fp32"), ("bf16", "bf16"), ("", None)])
def test_the_switch_overrides_the_detection(
    value: str, expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshnet.models import quantize
    from meshnet.models.quant import compute

    monkeypatch.setenv("MESHNET_COMPUTE_DTYPE", value)
    detected = "bf16" if compute.hardware_bf16_is_fast() else "fp32"
    assert compute.preferred_compute() == (expected or detected)
    assert compute.default_quant() == compute.preferred_compute()
    int8 = quantize.compute_dtype("int8")
    assert str(int8) == {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[expected or detected]


def test_device_flag_maps_onto_node_config_and_refuses_bad_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in (["node"], ["tracker", "--layers", "0:10"]):
        args = build_parser().parse_args([*command, "--device", "CUDA:1"])
        config = node_config(args) if command == ["node"] else tracker_node_config(args)
        assert config.device == "cuda:1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["node", "--device", "gpu"])
    assert "device must be auto, cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has CUDA")
@pytest.mark.parametrize("command", [["node"], ["tracker", "--layers", "0:30"]])
def test_cuda_on_a_host_without_it_stops_before_loading(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    """`--device cuda` where PyTorch sees no CUDA device: exit 2 with the reason, before any
    weight is read or any port is bound."""
    from meshnet.cli import main
    from tests.e2e.procs import free_port

    assert main([*command, "--device", "cuda", "--port", str(free_port())]) == 2
    assert "--device cuda: " in capsys.readouterr().err


def test_q4_on_a_cuda_device_stops_before_loading(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """q4 weights run on CPU nodes only: a node that would put them on a GPU exits 2 saying
    so, before registering (the device check is faked: this host may have no GPU)."""
    from meshnet.assemble import node
    from meshnet.cli import main
    from tests.e2e.procs import free_port

    monkeypatch.setattr(node, "resolve_device", lambda device: "cuda:0")
    assert main(["node", "--quant", "q4", "--port", str(free_port())]) == 2
    assert "--quant q4 runs on CPU nodes only, not cuda:0" in capsys.readouterr().err


def test_the_auto_encoding_threshold_reaches_the_wire_config() -> None:
    from meshnet.assemble.node import node_service
    from meshnet.config import AccessConfig

    args = build_parser().parse_args(["node", "--auto-compress-below", "100"])
    config = node_config(args)
    assert config.auto_compress_below_mbit_s == 100.0
    service = node_service(config, "n", AccessConfig())
    assert service.wire.auto_compress_below_mbit_s == 100.0


def test_several_trackers_map_onto_the_configs_and_bad_lists_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from meshnet.cli.configs import tracker_config

    urls = "http://a:8000,https://b:8000/"
    assert node_config(build_parser().parse_args(["node", "--tracker", urls])).trackers == (
        "http://a:8000",
        "https://b:8000",
    )
    tracker = tracker_config(
        build_parser().parse_args(["tracker", "--peers", urls, "--public-address", "http://c:1"])
    )
    assert tracker.peers == ("http://a:8000", "https://b:8000")
    assert tracker.public_url == "http://c:1"
    client = build_parser().parse_args(["status", "--tracker", urls])
    assert client.tracker == ("http://a:8000", "https://b:8000")
    for bad in ("a:8000", "http://a:1,,ftp://b", ","):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["node", "--tracker", bad])
        assert "expected URL or URL1,URL2" in capsys.readouterr().err
