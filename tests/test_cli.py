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
