"""The package's module graph: who imports whom, checked against the layers, drawn as Mermaid.

    python tools/module_graph.py            # Mermaid flowchart of the layers (docs/design.md)
    python tools/module_graph.py --check    # exit 1 on a cycle, an upward or a private import

A module may import modules of its own layer or below, never above; it never imports
another module's private (``_name``) helpers. Layers, bottom first, are ``LAYERS``.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = {
    "amp_compiler": ROOT / "amp_compiler",
    "amp_compiler.passes": ROOT / "passes",
}

# bottom first: each layer may use its own and those below it
LAYERS = [
    (
        "vocabulary",
        [
            "version",
            "upstream",
            "policy",
            "meta",
            "hops",
            "fused_layers",
            "loss_head",
            "device",
            "cpu_memory",
            "atomic",
            "policy_file",
            "monitor",
            "scaler",
            "optim",
            "model_spec",
        ],
    ),
    ("plan and capture", ["options", "plan", "capture"]),
    ("passes", ["passes"]),
    ("backend", ["backend", "plan_cache", "autocast_region", "coverage", "inductor", "ds_config"]),
    ("tools on the backend", ["explain", "compare", "distributed", "render"]),
    ("jobs", ["training_setup", "train", "doctor", "calibrate", "onnx_export"]),
    ("front ends", ["integrations", "cli", "demo", "__main__", ""]),
]


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
            if package == "amp_compiler" and parts[:1] == ["passes"]:
                continue
            found[".".join([package, *parts])] = path
    return found


def imports(mods: dict[str, pathlib.Path]) -> tuple[nx.DiGraph, list[str]]:
    """(module graph, private imports as 'importer: module._name')."""
    graph, private = nx.DiGraph(), []
    graph.add_nodes_from(mods)
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    hit = sub if sub in mods else target if target in mods else None
                    if hit and hit != name:
                        graph.add_edge(name, hit)
                        if alias.name.startswith("_") and hit == target and not alias.name.startswith("__"):
                            private.append(f"{name}: {target}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods and alias.name != name:
                        graph.add_edge(name, alias.name)
    return graph, private


def layer_of(module: str) -> int:
    top = module.removeprefix("amp_compiler").lstrip(".").split(".")[0]
    for i, (_, members) in enumerate(LAYERS):
        if top in members:
            return i
    raise KeyError(f"{module} is in no layer of tools/module_graph.py's LAYERS: add it")


def problems() -> list[str]:
    graph, private = imports(modules())
    found = [f"cycle: {' -> '.join(c)}" for c in nx.simple_cycles(graph)]
    for a, b in graph.edges:
        if layer_of(a) < layer_of(b):
            found.append(f"upward import: {a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})")
    return found + [f"private import: {p}" for p in private]


def mermaid() -> str:
    graph, _ = imports(modules())
    lines = ["flowchart BT"]
    for i, (title, members) in enumerate(LAYERS):
        shown = [m for m in members if m not in ("", "__main__", "version")]
        lines.append(f'  subgraph L{i}["{title}"]')
        lines += [f"    {m}" for m in shown]
        lines.append("  end")
    for i in range(len(LAYERS) - 1):
        lines.append(f"  L{i + 1} --> L{i}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--check" in argv:
        found = problems()
        print("\n".join(found) or "module graph: no cycles, no upward or private imports")
        return int(bool(found))
    print(mermaid())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
