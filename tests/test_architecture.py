"""Import-boundary rules: the package tree is the architecture."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from meshnet.types import QUANTS

SRC = Path(__file__).resolve().parents[1] / "src" / "meshnet"
HTTP_FRAMEWORKS = ("starlette", "fastapi", "httpx", "uvicorn", "aiohttp")


# Which parts of meshnet each part may import: a package (its first name under meshnet) or a
# top-level module. Roles sit above the shared base (types, errors, config, wire, observe,
# security); the composition roots (`assemble`) above the roles; the CLI above all.
BASE = {"types", "errors", "config"}
ALLOWED: dict[str, set[str]] = {
    "types": set(),
    "errors": set(),
    "config": {"types"},
    "wire": {*BASE},
    "http_errors": {"errors", "wire"},
    "observe": {*BASE},
    "security": {*BASE, "http_errors"},
    "text": {"types", "errors"},  # no torch either: see below
    "models": {*BASE, "observe"},
    "weights": {*BASE, "http_errors", "observe", "security", "models"},
    "tracker": {*BASE, "http_errors", "observe", "security", "models", "weights"},
    "node": {*BASE, "wire", "http_errors", "observe", "security", "models", "tracker", "weights"},
    "entry": {*BASE, "wire", "observe", "security", "models", "text", "node", "tracker"},
    "api": {*BASE, "http_errors", "security", "text"},
    "assemble": {
        *BASE,
        "wire",
        "observe",
        "security",
        "models",
        "api",
        "text",
        "entry",
        "node",
        "tracker",
        "weights",
    },
    "terminal": set(),
    "status": {"security", "terminal"},
    "demo": {"models", "observe", "security", "terminal"},
    "cli": {*BASE, "observe", "security", "assemble", "demo", "status", "terminal"},
}
# edges allowed only into these modules: the control-plane protocol, sizing from a config
ONLY: dict[tuple[str, str], set[str]] = {
    ("node", "tracker"): {"meshnet.tracker.messages"},
    ("entry", "tracker"): {"meshnet.tracker.messages"},  # never the tracker's internals
    # the node's compute seams only: the scheduler, the shard-runner seam and the shard table
    # and the member's frame poster (an HTTP client: not in wire/)
    ("entry", "node"): {
        "meshnet.node.scheduler",
        "meshnet.node.runner",
        "meshnet.node.shards",
        "meshnet.node.post",
    },
    ("tracker", "models"): {"meshnet.models.sizing", "meshnet.models.source"},
}


def part_of(path: Path) -> str:
    """The part of meshnet `path` belongs to: its package, or its own name at the top."""
    rel = path.relative_to(SRC).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def meshnet_imports(path: Path) -> set[str]:
    """Every meshnet module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative imports hide the direction"
            module = node.module or ""
            package = SRC.parent.joinpath(*module.split("."))
            for alias in node.names:  # `from meshnet.tracker import messages`: a module
                is_module = (package / f"{alias.name}.py").exists()
                found.add(f"{module}.{alias.name}" if is_module else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("meshnet.")}


def test_imports_between_parts_go_only_the_allowed_directions() -> None:
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "__init__.py":
            continue
        source = part_of(path)
        for module in meshnet_imports(path):
            target = module.split(".")[1]
            if target == source:
                continue
            only = ONLY.get((source, target))
            if target not in ALLOWED[source] or (only is not None and module not in only):
                wrong.append(f"{path.relative_to(SRC)} imports {module}")
    assert not wrong
    assert set(ALLOWED) == {part_of(p) for p in SRC.rglob("*.py")} - {"__init__"}


def module_name(path: Path) -> str:
    """`models/quant/int8.py` -> meshnet.models.quant.int8; a package's `__init__.py` is the
    package."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(part: str) -> list[list[str]]:
    """Cycles among the modules of `part`, counting every import (type-only ones too): each
    as the list of modules around it."""
    modules = {module_name(p): p for p in (SRC / part).rglob("*.py")}  # sub-packages too
    edges = {m: meshnet_imports(p) & modules.keys() for m, p in modules.items()}
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(edges[module]):
            if target in path:
                cycles.append(path[path.index(target) :])
            elif target not in done:
                visit(target, [*path, target])
        done.add(module)

    for module in sorted(modules):
        if module not in done:
            visit(module, [module])
    return cycles


@pytest.mark.parametrize("part", ["entry", "node", "tracker", "models", "weights", "wire"])
def test_no_import_cycles_inside_a_part(part: str) -> None:
    """Issue #49: failover, prefill and spot checks were Pipeline methods kept elsewhere,
    importing it back; they build on `entry/hops.py` now, and no part may grow a cycle."""
    assert not import_cycles(part)


def test_the_roles_do_not_import_each_other_backwards() -> None:
    """Spelled out, as the table above allows: nothing imports the entry role but the roots,
    the node never imports the entry or the API, the API never the entry or the node."""
    assert "entry" not in ALLOWED["node"] | ALLOWED["api"] | ALLOWED["tracker"]
    assert not {"node", "entry", "tracker"} & ALLOWED["api"]
    assert [p for p, deps in ALLOWED.items() if "assemble" in deps] == ["cli"]


def test_text_generation_and_the_api_schemas_need_no_torch() -> None:
    code = (
        "import sys; import meshnet.text.params, meshnet.text.events, meshnet.text.stops, "
        "meshnet.text.decoding, meshnet.text.codec, meshnet.text.sampling, meshnet.api.schemas, "
        "meshnet.api.app; "
        "print('torch' in sys.modules)"
    )
    assert python_says(code) == "False"


def modules_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return {name.split(".")[0] for name in out.stdout.split()}


@pytest.mark.parametrize("module", sorted(module_name(p) for p in (SRC / "wire").glob("*.py")))
def test_wire_imports_no_http_framework(module: str) -> None:
    """Each module, not the package's lazy face (issue #61: aiohttp in wire/post.py passed)."""
    loaded = modules_after_import(module)
    assert not loaded & set(HTTP_FRAMEWORKS), module


def python_says(code: str) -> str:
    """What a fresh interpreter prints after running `code`."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def test_tracker_never_imports_torch() -> None:
    code = (
        "import sys; from meshnet.tracker.offers import build_registry; "
        "from meshnet.config import TrackerConfig; build_registry(TrackerConfig()); "
        "print(sorted(m for m in ('torch', 'transformers', 'bitsandbytes') if m in sys.modules))"
    )
    assert python_says(code) == "[]"


def test_sizing_from_a_config_needs_no_torch() -> None:
    code = (
        "import sys; from meshnet.models.source import resolve; "
        "from meshnet.models.sizing import layer_bytes; "
        "layer_bytes(resolve('default').spec, 'nf4'); print('torch' in sys.modules)"
    )
    assert python_says(code) == "False"


@pytest.mark.parametrize("module", ["meshnet.types", "meshnet.errors", "meshnet.config"])
def test_base_modules_import_nothing_heavy(module: str) -> None:
    assert not modules_after_import(module) & {"torch", "numpy", *HTTP_FRAMEWORKS}


def quant_branches(path: Path) -> list[int]:
    """Lines of `path` that compare something with a quantization's name (`"int8"`, or a
    tuple of names); a source kind (`kind == "gguf"`) and a compute dtype (`compute ==
    "fp32"`) are not one."""
    names, only_quants = set(QUANTS), set(QUANTS) - {"fp32", "bf16", "gguf"}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        strings = {
            c.value
            for side in sides
            for c in ast.walk(side)
            if isinstance(c, ast.Constant) and isinstance(c.value, str)
        }
        text = ast.unparse(node)
        if (strings & only_quants or strings & names and "quant" in text) and "kind" not in text:
            found.append(node.lineno)
    return found


def test_nothing_outside_models_quant_branches_on_a_quantization() -> None:
    """Issue #49: a quantization's facts (bytes, compute dtype, swap, tolerance) live in its
    scheme (`models/quant/`); everything else asks the scheme."""
    home = SRC / "models" / "quant"
    offenders = {
        f"{p.relative_to(SRC)}:{lines}"
        for p in SRC.rglob("*.py")
        if home not in p.parents and p != SRC / "types.py" and (lines := quant_branches(p))
    }
    assert not offenders


def test_every_quantization_has_a_scheme() -> None:
    from meshnet.models.quant import SCHEMES

    assert set(SCHEMES) == set(QUANTS)
    assert all(name == scheme.name for name, scheme in SCHEMES.items())


def test_no_source_file_outgrows_400_lines() -> None:
    long = {p.name: n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long


def test_no_print_in_library_code() -> None:
    allowed = {"cli", "demo.py", "terminal.py", "status.py"}  # the terminal front ends
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p.relative_to(SRC).parts[0] not in allowed and "print(" in p.read_text()
    ]
    assert not offenders


def test_a_ggml_span_computes_without_torch() -> None:
    """The ggml backend's models part imports no torch (ADR-0051)."""
    code = (
        "import sys, numpy as np; from meshnet.models.source import resolve; "
        "from meshnet.models.ggml_span import GgmlSpan; from meshnet.types import LayerSpan; "
        "s = GgmlSpan(resolve('default').path, LayerSpan(0, 2)); "
        "s.forward(np.zeros((2, 576), np.float32), s.new_cache(), 0); "
        "print('torch' in sys.modules)"
    )
    assert python_says(code) == "False"


def test_a_node_that_serves_ggml_spans_alone_imports_no_torch() -> None:
    """What a `--no-entry` ggml node loads (ADR-0052): its assembly, the wire, the runner seam
    and a span loaded by `load_runner` (the process test, `tests/node/test_lean_node.py`,
    checks a real one's mapped libraries)."""
    code = (
        "import sys; import meshnet.cli, meshnet.cli.serve, meshnet.assemble.node; "
        "from meshnet.config import NodeConfig; from meshnet.node.startup import load_runner; "
        "from meshnet.types import LayerSpan; from meshnet.wire import decode_bits, encode; "
        "load_runner(NodeConfig(entry=False), 'default', 'default', LayerSpan(0, 2)); "
        "print('torch' in sys.modules)"
    )
    assert python_says(code) == "False"
