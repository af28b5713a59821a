"""`meshnet status`: the tracker's coverage map and node table in the terminal.

It reads `GET /v1/coverage` like the web dashboard does, with an API key (bearer) or, on a
member's machine, a swarm-key proof; on the tracker's own machine neither is needed.
"""

from __future__ import annotations

import ssl
import sys
from typing import Any

import httpx
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from meshnet.security.signing import Signer
from meshnet.security.swarm import TRACKER
from meshnet.terminal import ApiError, check_response

STATE_STYLE = {"ready": "green", "loading": "blue", "idle": "dim", "late": "yellow"}


def fetch_coverage(
    url: str,
    api_key: str | None = None,
    swarm_key: str | None = None,
    timeout_s: float = 5.0,
    ca_file: str | None = None,
) -> dict[str, Any]:
    """The tracker's coverage answer; `ApiError` (the server's words) or `httpx.HTTPError`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    auth = Signer(swarm_key).auth(TRACKER) if swarm_key and not api_key else None
    verify = ssl.create_default_context(cafile=ca_file)  # https trackers: a mesh's own CA
    with httpx.Client(
        base_url=url, timeout=timeout_s, headers=headers, auth=auth, verify=verify
    ) as client:
        response = client.get("/v1/coverage")
    check_response(response)
    body: dict[str, Any] = response.json()
    return body


def layer_bar(model: dict[str, Any]) -> Text:
    """One character a layer: the copy count (1-9, + beyond) in green, `~` loading, `.` a gap."""
    bar = Text()
    for layer in model["layers"]:
        copies = len(layer["serving"])
        if copies:
            bar.append(str(copies) if copies < 10 else "+", style="bold green")
        elif layer["loading"]:
            bar.append("~", style="blue")
        else:
            bar.append(".", style="bold red")
    return bar


def model_lines(coverage: dict[str, Any]) -> Group:
    lines = []
    for model in coverage["models"]:
        served = sum(1 for layer in model["layers"] if layer["serving"])
        gaps = ", ".join(f"{g['start']}:{g['end']}" for g in model["gaps"])
        digest = f"@{model['digest'][:12]}" if model.get("digest") else ""
        line = Text(f"{model['model'] + digest:<12} ", style="bold")
        line.append_text(layer_bar(model))
        line.append(f"  {served}/{model['num_layers']} layers served")
        line.append(f"  gaps {gaps}" if gaps else "  no gaps", style="red" if gaps else "green")
        line.append("  routable" if model["routable"] else "  NOT routable")
        lines.append(line)
    return Group(*lines)


def loading_note(node: dict[str, Any], shard: dict[str, Any]) -> str:
    """`loading`, or how far the fetch of its weights has come (ADR-0054)."""
    fetch = next((f for f in node.get("fetching", []) if f["shard"] == shard), None)
    if fetch is None:
        return "loading"
    done, total, rate = fetch["done_bytes"], fetch["total_bytes"], fetch["rate_bytes_s"]
    eta = f", {(total - done) / rate:.0f} s left" if rate > 0 else ""
    return f"fetching {done / 1e6:,.0f}/{total / 1e6:,.0f} MB at {rate / 1e6:.1f} MB/s{eta}"


def node_table(coverage: dict[str, Any]) -> Table:
    table = Table(title="nodes", title_justify="left")
    for column in ("node", "address", "state", "budget", "quant", "spans", "sessions", "beat"):
        right = column in ("budget", "sessions", "beat")
        table.add_column(column, justify="right" if right else "left", no_wrap=column != "spans")
    for node in coverage["nodes"]:
        spans = [f"{s['model']} {s['span']['start']}:{s['span']['end']}" for s in node["loaded"]]
        spans += [
            f"{s['model']} {s['span']['start']}:{s['span']['end']} ({loading_note(node, s)})"
            for s in node["loading"]
        ]
        state = node["state"]
        table.add_row(
            node["node_id"],
            node["address"],
            Text(state, style=STATE_STYLE.get(state, "bold red")),
            f"{node['budget_bytes'] / 1e6:,.0f} MB",
            node["quant"],
            ", ".join(spans) or "-",
            str(node["sessions"]),
            f"{node['last_heartbeat_age_s']:.1f} s ago",
        )
    return table


def render(coverage: dict[str, Any], url: str) -> Group:
    head = Text(f"meshnet tracker {url}: {len(coverage['nodes'])} nodes, heartbeat every ")
    head.append(f"{coverage['heartbeat_interval_s']:g} s")
    if coverage.get("planner"):  # one of several trackers (ADR-0057)
        head.append(f"; planner {coverage['planner']}")
    legend = Text("layers: digit = live copies, ~ = loading, . = gap", style="dim")
    return Group(head, model_lines(coverage), legend, node_table(coverage))


def run_status(
    url: str,
    api_key: str | None,
    swarm_key: str | None,
    console: Console | None = None,
    ca_file: str | None = None,
) -> int:
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    try:
        coverage = fetch_coverage(url, api_key, swarm_key, ca_file=ca_file)
    except (ApiError, httpx.HTTPError) as exc:
        console.print(f"[red]meshnet status: {url}: {exc}[/red]")
        return 1
    console.print(render(coverage, url))
    return 0
