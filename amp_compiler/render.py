"""Render compiled graphs coloured by precision: Graphviz DOT and a self-contained HTML page."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence

from .backend import CompileRecord
from .meta import dtype_name, info
from .plan import PrecisionPlan

COLORS = {"LOW": "#9be3b0", "FP32": "#a8c8f8", "PROMOTE": "#ffe08a", "PASSTHROUGH": "#e4e4e4",
          "CAST": "#ffffff"}


def _rows(record: CompileRecord):
    """(id, label lines, kind, node info, input ids) per node, in graph order."""
    for node in record.graph.graph.nodes:
        i = info(node)
        kind = "CAST" if i is not None and i.inserted else (i.precision.value if i else "PASSTHROUGH")
        nid = f"g{record.index}_{node.name}"
        if kind == "CAST":
            label = [f"cast -> {dtype_name(node.kwargs['dtype'])}"]
        else:
            label = [node.name, i.op if i and node.op == "call_function" else node.op]
            label.append(f"{kind} {dtype_name(i.planned) if i else ''}".strip())
            if i and i.module:
                label.append(i.module)
        yield nid, label, kind, i, [f"g{record.index}_{a.name}" for a in node.all_input_nodes], node


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_dot(records: Sequence[CompileRecord]) -> str:
    lines = ["digraph amp {", "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];']
    for rec in records:
        lines.append(f"  subgraph cluster_g{rec.index} {{")
        lines.append(f"    label={_q(f'graph {rec.index} ({rec.dtype})')};")
        for nid, label, kind, _, inputs, _node in _rows(rec):
            attrs = [f"label={_q(chr(10).join(label))}", f"fillcolor={_q(COLORS[kind])}"]
            if kind == "CAST":
                attrs += ['shape=ellipse', 'style="dashed,filled"', 'color="#e07000"']
            lines.append(f"    {_q(nid)} [{', '.join(attrs)}];")
            lines += [f"    {_q(src)} -> {_q(nid)};" for src in inputs]
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


_CSS = """
body{font-family:system-ui,Helvetica,Arial,sans-serif;margin:24px;color:#222}
h1{font-size:20px} table{border-collapse:collapse;font-size:13px;width:100%}
td,th{border:1px solid #ccc;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f4;position:sticky;top:0} .b{padding:1px 6px;border-radius:8px;font-weight:600}
tr.CAST td{background:#fff7ec;font-style:italic} code{font-size:12px}
.legend span{margin-right:12px} .graph{overflow:auto;max-height:70vh;border:1px solid #ddd;margin-bottom:16px} .in{color:#555} .in .cast{color:#e07000;font-weight:600}
"""


def to_svg(record: CompileRecord, box_w: int = 170, box_h: int = 34, gap_x: int = 14,
           gap_y: int = 34) -> str:
    """The graph drawn in layers, coloured by precision.

    Layers are networkx topological generations of the reversed graph (each node
    as late as possible), so a weight and its cast sit just above their reader.
    """
    import networkx as nx

    rows = {nid: (label, kind, inputs) for nid, label, kind, _, inputs, _ in _rows(record)}
    g = nx.DiGraph()
    g.add_nodes_from(rows)
    g.add_edges_from((src, nid) for nid, (_, _, inputs) in rows.items() for src in inputs if src in rows)
    layers = list(nx.topological_generations(g.reverse(copy=False)))[::-1]
    pos = {nid: (12 + i * (box_w + gap_x), 12 + depth * (box_h + gap_y))
           for depth, layer in enumerate(layers) for i, nid in enumerate(layer)}
    width = 24 + max(len(layer) for layer in layers) * (box_w + gap_x)
    height = 24 + len(layers) * (box_h + gap_y)
    esc = html.escape
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
           f"font-family='Helvetica,Arial,sans-serif' font-size='10'>"]
    for src, dst in g.edges:
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        out.append(f"<line x1='{x1 + box_w / 2}' y1='{y1 + box_h}' x2='{x2 + box_w / 2}' y2='{y2}' "
                   "stroke='#999' stroke-width='1'/>")
    for nid, (label, kind, _) in rows.items():
        x, y = pos[nid]
        dash = " stroke-dasharray='4 2' stroke='#e07000'" if kind == "CAST" else " stroke='#666'"
        out.append(f"<g><title>{esc(' | '.join(label))}</title><rect x='{x}' y='{y}' width='{box_w}' "
                   f"height='{box_h}' rx='6' fill='{COLORS[kind]}'{dash}/>")
        for k, line in enumerate(label[:2]):
            out.append(f"<text x='{x + 6}' y='{y + 14 + 12 * k}'>{esc(line[:28])}</text>")
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def to_html(records: Sequence[CompileRecord], plan: PrecisionPlan, title: str) -> str:
    s = plan.summary()
    esc = html.escape
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'>",
             f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{esc(title)}</h1>", f"<p>{esc(plan.format_summary())}</p>",
             "<p class='legend'>" + "".join(
                 f"<span><span class='b' style='background:{c}'>{k}</span></span>"
                 for k, c in COLORS.items()) + "</p>"]
    for rec in records:
        parts.append(f"<h2>graph {rec.index} &mdash; {esc(rec.dtype)} ({esc(rec.dtype_reason)})</h2>")
        parts.append(f"<div class='graph'>{to_svg(rec)}</div>")
        parts.append("<table><tr><th>node</th><th>op</th><th>module</th><th>precision</th>"
                     "<th>dtype</th><th>inputs</th><th>reason</th></tr>")
        casts = {f"g{rec.index}_{n.name}" for n in rec.graph.graph.nodes
                 if info(n) is not None and info(n).inserted}
        for nid, _label, kind, i, inputs, node in _rows(rec):
            ins = ", ".join(
                f"<span class='cast'>{esc(x.split('_', 1)[1])}</span>" if x in casts
                else esc(x.split("_", 1)[1]) for x in inputs)
            parts.append(
                f"<tr class='{kind}' id='{esc(nid)}'><td><code>{esc(node.name)}</code></td>"
                f"<td><code>{esc(i.op if i else node.op)}</code></td><td>{esc(i.module if i else '')}</td>"
                f"<td><span class='b' style='background:{COLORS[kind]}'>{kind}</span></td>"
                f"<td>{esc(dtype_name(i.planned) if i else '')}</td><td class='in'>{ins}</td>"
                f"<td>{esc(i.reason if i else '')}</td></tr>")
        parts.append("</table>")
    parts.append(f"<h2>summary</h2><pre>{esc(json.dumps(s, indent=2))}</pre>")
    parts.append(f"<details><summary>Graphviz source</summary><pre>{esc(to_dot(records))}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)
