"""One real mesh shared by the end-to-end tests of the entry node and of failover.

A tracker-as-entry-node (layers 0:10, fp32) and four nodes of ten fp32 layers each: the
planner covers 10:20 and 20:30 first, then adds replicas (the span with the fewest copies
first), so every span has two copies.
Every route is three hops, `0:10 -> 10:20 -> 20:30`. Besides, a second entry point started
with `meshnet node --entry`, whose API needs an API key, which logs JSON lines, and whose
hops push each frame on to the next (`--push`, ADR-0034). Tests that
kill nodes restart them and wait for the copies to come back, so later tests find the mesh
whole.

Membership as a user sets it up: the tracker starts with no key, creates its key file and
prints the join command; every node is started with the environment that command names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx

from meshnet.types import LayerSpan
from tests.e2e.procs import free_port, get_json, start, stop, stop_together, wait_for

BUDGET = "165MB"  # ten fp32 layers of the default model with the 10% KV reserve
NODES = ("a", "b", "c", "d")
COPIES = 2  # at least, of each span after the entry's
API_KEY = "e2e-client-key-0001"  # the `node --entry` process's API key
SUSPECT_S = 5.0  # the tracker's --suspect-for
HOP_TIMEOUT_S = 4.0  # both entries give up on a hung hop after this (--hop-timeout)
# the `node --entry` process's API limits, set by flag (tests/e2e/test_limits_mesh.py)
ENTRY_LIMITS = {"--max-prompt-tokens": "1000", "--max-tokens-limit": "100", "--max-body": "64KB"}
JOIN = re.compile(r"^\s*(MESHNET_SWARM_KEY)=(\S+) meshnet node --tracker (\S+)$", re.M)


class Mesh:
    """The processes of the mesh, by name, with what restarts them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.args: dict[str, list[str]] = {}
        self.addresses: dict[str, str] = {}  # the four plain nodes
        self.extra: dict[str, str] = {}  # nodes a test added with `launch_pinned`
        self.entry = ""  # the `node --entry` process's URL
        self.key_file = folder / "swarm.key"
        self.env = {k: v for k, v in os.environ.items() if k != "MESHNET_SWARM_KEY"}

    def launch(self, name: str, args: list[str]) -> None:
        self.args[name] = args
        self.procs[name] = start(args, self.folder / f"{name}.log", self.env)

    def start_all(self) -> None:
        self.launch(
            "tracker",
            ["tracker", "--port", str(self.port), "--layers", "0:10", "--quant", "fp32"]
            + ["--heartbeat-interval", "1", "--data-dir", str(self.folder / "tracker")]
            # a node an entry reported is out of routes 5 s, not 30: the next test's wait for
            # a whole mesh (every copy routable) took ~27 s after each failover test
            + ["--suspect-for", str(SUSPECT_S)]
            + ["--hop-timeout", str(HOP_TIMEOUT_S), "--spot-check-rate", "0"]
            + ["--swarm-key-file", str(self.key_file)],
        )
        self.env["MESHNET_SWARM_KEY"] = self.join_key()
        port = free_port()
        self.entry = f"http://127.0.0.1:{port}"
        # no spot checks: failover tests count each hop's sessions (test_entry_mesh.py has
        # an entry that checks every answer)
        keys = self.folder / "api.keys"  # a private file: keys never go on argv
        keys.write_text(API_KEY + "\n")
        keys.chmod(0o600)
        entry = ["--entry", "--layers", "0:10", "--api-keys-file", str(keys)]
        entry += ["--log-format", "json"]
        entry += ["--spot-check-rate", "0", "--push"]  # its hops push (ADR-0034)
        entry += ["--hop-timeout", str(HOP_TIMEOUT_S)]
        entry += [part for flag, value in ENTRY_LIMITS.items() for part in (flag, value)]
        self.launch("entry", self.node_args(port, "entry") + entry)

    def start_nodes(self) -> None:
        """The plain nodes, once both copies of 0:10 (the entries') are registered: the
        planner then gives all four nodes spans after 0:10, whatever order they join in."""
        wait_for(lambda: self.entry in self.registered(), 120, "the second entry node")
        for name in NODES:
            port = free_port()
            self.addresses[name] = f"http://127.0.0.1:{port}"
            self.launch(name, self.node_args(port, name) + ["--budget", BUDGET])

    def registered(self) -> set[str]:
        return {n["address"] for n in self.coverage()["nodes"]}

    def join_key(self) -> str:
        """The swarm key from the join command the tracker printed (checked against its URL)."""
        log = self.folder / "tracker.log"
        wait_for(lambda: JOIN.search(log.read_text()) is not None, 60, "the join command")
        match = JOIN.search(log.read_text())
        assert match is not None and match.group(3) == self.url
        return match.group(2)

    def node_args(self, port: int, name: str) -> list[str]:
        return ["node", "--tracker", self.url, "--port", str(port), "--quant", "fp32"] + [
            "--data-dir",
            str(self.folder / name),
        ]

    def restart(self, name: str) -> None:
        """Start `name` again: same port, same data folder, so the same node id."""
        self.launch(name, self.args[name])

    def launch_pinned(self, name: str, layers: str, *flags: str) -> None:
        """One more node, pinned to `layers` by hand (and `flags`), joining the tracker."""
        port = free_port()
        self.extra[name] = f"http://127.0.0.1:{port}"
        self.launch(name, self.node_args(port, name) + ["--layers", layers, *flags])

    def stop_extra(self, names: list[str]) -> None:
        """Stop nodes started by `launch_pinned` for good (`revive` leaves them alone)."""
        for name in names:
            stop(self.procs.pop(name))
            del self.args[name], self.extra[name]

    def loaded(self, names: list[str]) -> bool:
        """Every process in `names` registered with its span loaded."""
        nodes = self.coverage()["nodes"]
        up = {n["address"] for n in nodes if n["loaded"] and not n["loading"]}
        return {self.extra[name] for name in names} <= up

    def holders(self, span: LayerSpan) -> list[str]:
        """The plain nodes (`a`..`d`) that serve exactly `span`."""
        by_address = {a: n for n, a in self.addresses.items()}
        want = {"start": span.start, "end": span.end}
        return [
            by_address[n["address"]]
            for n in self.coverage()["nodes"]
            if n["address"] in by_address
            and self.procs[by_address[n["address"]]].poll() is None
            and any(s["span"] == want for s in n["loaded"])
        ]

    def last_entry_session(self) -> str:
        """The session id of the `node --entry` process's newest generation (its JSON log)."""
        lines = (self.folder / "entry.log").read_text().splitlines()
        opened = [json.loads(x) for x in lines if x.startswith("{") and "prompt tokens" in x]
        return str(opened[-1]["session"])

    def revive(self) -> None:
        """Restart every process of the mesh that has exited (killed or stopped by a test)."""
        for name, process in list(self.procs.items()):
            if process.poll() is not None and name in self.args:
                self.restart(name)

    def stop_all(self) -> None:
        stop_together(self.procs.values())

    def coverage(self) -> dict[str, Any]:
        result: dict[str, Any] = get_json(f"{self.url}/v1/coverage")
        return result

    def copies(self) -> int:
        """The fewest nodes serving any layer after the entry's span."""
        layers = self.coverage()["models"][0]["layers"][10:]
        return min(len(layer["serving"]) for layer in layers)

    def whole(self) -> bool:
        """Every node registered with a loaded span, and every span with spare copies."""
        coverage = self.coverage()
        loaded = {n["address"] for n in coverage["nodes"] if n["loaded"] and not n["suspect"]}
        wanted = {*self.addresses.values(), self.entry}
        return wanted <= loaded and self.copies() >= COPIES

    def settled(self) -> bool:
        """No node is loading a span (a load holds its node's compute thread, ADR-0047)."""
        return not any(n["loading"] for n in self.coverage()["nodes"])

    def wait_whole(self, timeout_s: float = 120) -> None:
        wait_for(self.whole, timeout_s, "every node serving and every span copied")

    def sessions(self, name: str) -> int:
        try:
            return int(get_json(f"{self.addresses[name]}/health")["sessions"])
        except httpx.HTTPError:
            return 0
