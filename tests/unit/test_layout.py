"""The code's shape, as docs/design.md ("The layout") states it: no product module over 500 lines,
no function over 60, no import cycle between modules, and each room importing only what it may."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_STDLIB = set(sys.stdlib_module_names)
PACKAGES = ("specdec", "draft_service", "target_service", "orchestrator", "ui", "evaluation")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    """The product's Python and C sources, generated code (the gRPC stubs) left out."""
    files = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in (".py", ".c", ".h") and "_pb2" not in path.name and "__pycache__" not in path.parts:
                files.append(path)
    return files


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it is imported (module level, not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                else _class_level(node):
            if isinstance(sub, ast.Import):
                found.update(alias.name for alias in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                found.add(sub.module)
                found.update(f"{sub.module}.{alias.name}" for alias in sub.names)
    return found


def _class_level(node: ast.AST) -> list[ast.AST]:
    """A class body's own statements (imports inside functions run only when called)."""
    if isinstance(node, ast.ClassDef):
        return [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return []


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, long


def test_no_function_is_over_60_lines():
    long = {}
    for path in _sources():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = length
    assert long == {}, long


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in _sources() if p.suffix == ".py"}
    graph = {}
    for name, path in modules.items():
        # "from a.b import c" names module a.b.c when it exists, else a.b's attribute c
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def _third_party(path: Path) -> set[str]:
    return {m.split(".")[0] for m in _imports(path)} - set(PACKAGES)


def test_no_import_cycle():
    graph = _graph()
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], cycles


def test_the_rooms_import_only_what_they_may():
    """The model code never imports serving; the engine never imports a service, grpc or HTTP;
    no service imports another service."""
    graph = _graph()
    rules = {
        "specdec.model": ("specdec.engine", "draft_service", "target_service", "orchestrator", "ui", "evaluation"),
        "specdec.engine": ("draft_service", "target_service", "orchestrator", "ui", "evaluation", "specdec.server",
                           "specdec.v1", "specdec.wire"),
        "draft_service": ("target_service", "orchestrator", "ui", "evaluation"),
        "target_service": ("draft_service", "orchestrator", "ui", "evaluation"),
        "orchestrator": ("draft_service", "target_service", "ui", "evaluation", "specdec.engine", "specdec.model"),
    }
    broken = {}
    for module, imports in graph.items():
        for room, forbidden in rules.items():
            if module == room or module.startswith(room + "."):
                bad = sorted(m for m in imports if any(m == f or m.startswith(f + ".") for f in forbidden))
                if bad:
                    broken[module] = bad
    assert broken == {}, broken
    wire = {"grpc", "grpc_health", "google", "httpx", "fastapi", "starlette", "uvicorn"}
    speaking = {}
    for path in _sources():
        name = _module(path)
        if path.suffix == ".py" and (name.startswith("specdec.engine") or name.startswith("specdec.model")):
            if bad := sorted(_third_party(path) & wire):
                speaking[name] = bad
    assert speaking == {}, speaking
    # the planner, the KV manager and the compute thread need no model library at all
    for module in ("specdec.engine.planner", "specdec.engine.kv", "specdec.engine.compute"):
        assert _third_party(ROOT / (module.replace(".", "/") + ".py")) <= {"__future__", "prometheus_client"} | _STDLIB, module
