"""Render compiled graphs coloured by precision: Graphviz DOT and a self-contained HTML page."""

from __future__ import annotations

import html
import json
from collections import Counter, defaultdict
from collections.abc import Sequence

from .backend import CompileRecord
from .meta import dtype_name, info
from .plan import PrecisionPlan

COLORS = {"LOW": "#9be3b0", "FP32": "#a8c8f8", "PROMOTE": "#ffe08a", "PASSTHROUGH": "#e4e4e4", "CAST": "#ffffff"}


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
    lines = [
        "digraph amp {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
    ]
    for rec in records:
        lines.append(f"  subgraph cluster_g{rec.index} {{")
        lines.append(f"    label={_q(f'graph {rec.index} ({rec.dtype})')};")
        for nid, label, kind, _, inputs, _node in _rows(rec):
            attrs = [f"label={_q(chr(10).join(label))}", f"fillcolor={_q(COLORS[kind])}"]
            if kind == "CAST":
                attrs += ["shape=ellipse", 'style="dashed,filled"', 'color="#e07000"']
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


def to_svg(record: CompileRecord, box_w: int = 170, box_h: int = 34, gap_x: int = 14, gap_y: int = 34) -> str:
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
    pos = {
        nid: (12 + i * (box_w + gap_x), 12 + depth * (box_h + gap_y))
        for depth, layer in enumerate(layers)
        for i, nid in enumerate(layer)
    }
    width = 24 + max(len(layer) for layer in layers) * (box_w + gap_x)
    height = 24 + len(layers) * (box_h + gap_y)
    esc = html.escape
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"font-family='Helvetica,Arial,sans-serif' font-size='10'>"
    ]
    for src, dst in g.edges:
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        out.append(
            f"<line x1='{x1 + box_w / 2}' y1='{y1 + box_h}' x2='{x2 + box_w / 2}' y2='{y2}' "
            "stroke='#999' stroke-width='1'/>"
        )
    for nid, (label, kind, _) in rows.items():
        x, y = pos[nid]
        dash = " stroke-dasharray='4 2' stroke='#e07000'" if kind == "CAST" else " stroke='#666'"
        out.append(
            f"<g><title>{esc(' | '.join(label))}</title><rect x='{x}' y='{y}' width='{box_w}' "
            f"height='{box_h}' rx='6' fill='{COLORS[kind]}'{dash}/>"
        )
        for k, line in enumerate(label[:2]):
            out.append(f"<text x='{x + 6}' y='{y + 14 + 12 * k}'>{esc(line[:28])}</text>")
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


_TREE_CSS = """
details{margin-left:18px} summary{cursor:pointer;padding:2px 0;white-space:nowrap}
summary .bar{display:inline-flex;width:160px;height:10px;margin:0 8px;vertical-align:middle;border:1px solid #bbb}
summary .bar i{display:block;height:100%} .n{color:#555;font-size:12px} .r{color:#a33;font-size:12px}
.nodes{margin:4px 0 8px 18px} #q{font-size:14px;padding:4px;width:320px;margin-bottom:10px}
.hidden{display:none}
"""

_TREE_JS = """
const NODES = JSON.parse(document.getElementById('nodes').textContent);
function fill(d) {
  const box = d.querySelector(':scope > .nodes');
  if (!box || box.dataset.done) return;
  box.dataset.done = 1;
  const rows = NODES.filter(n => n[3] === box.dataset.m);
  let h = '<table><tr><th>node</th><th>op</th><th>precision</th><th>dtype</th><th>casts</th><th>reason</th></tr>';
  for (const [g, name, op, mod, prec, dt, casts, reason] of rows)
    h += `<tr><td><code>${name}</code></td><td><code>${op}</code></td><td><span class='b ${prec}'>${prec}</span></td>` +
         `<td>${dt}</td><td>${casts}</td><td>${reason}</td></tr>`;
  box.innerHTML = h + '</table>';
}
document.querySelectorAll('details').forEach(d => d.addEventListener('toggle', () => d.open && fill(d)));
function openPath(path) {  // #m=h.3.attn opens that module (a link to it)
  document.querySelectorAll('details').forEach(d => {
    const p = d.dataset.path;
    if (p !== undefined && (p === '' || path === p || path.startsWith(p + '.'))) { d.open = true; fill(d); }
  });
}
if (location.hash.startsWith('#m=')) openPath(decodeURIComponent(location.hash.slice(3)));
document.getElementById('q').addEventListener('input', e => {
  const q = e.target.value.toLowerCase();
  document.querySelectorAll('details').forEach(d => {
    const hit = !q || d.dataset.path.toLowerCase().includes(q) ||
      [...d.querySelectorAll('details')].some(c => c.dataset.path.toLowerCase().includes(q));
    d.classList.toggle('hidden', !hit);
    if (q && hit) d.open = true;
  });
});
"""

_SVG_LIMIT = 400  # nodes: larger graphs get the tree and node tables, not a drawing


def to_html(records: Sequence[CompileRecord], plan: PrecisionPlan, title: str) -> str:
    """A self-contained page: a collapsible module tree (search, precision bars per module,
    each module's node table built when it is opened), then small graphs drawn."""
    esc = html.escape
    mods = Modules(plan)

    def node(path, depth):
        counts, casts = mods.subtree(path)
        c = {k: counts[k] for k in PRECISIONS}
        total = max(sum(c.values()), 1)
        bar = "".join(f"<i style='width:{100 * v / total:.1f}%;background:{COLORS[k]}'></i>" for k, v in c.items() if v)
        text = " ".join(f"{k} {v}" for k, v in c.items() if v)
        fp32 = sorted(mods.fp32_reasons(path))
        reasons = f" <span class='r'>FP32: {esc('; '.join(fp32)[:160])}</span>" if fp32 else ""
        name = path.rsplit(".", 1)[-1] if path else "(top level)"
        out = [
            f"<details data-path='{esc(path)}'{' open' if depth == 0 else ''}><summary><b>{esc(name)}</b>"
            f"<span class='bar'>{bar}</span><span class='n'>{text}; casts {len(casts)}</span>{reasons}</summary>"
        ]
        out += [node(ch, depth + 1) for ch in mods.children(path)]
        if mods.own.get(path):
            out.append(f"<div class='nodes' data-m='{esc(path)}'></div>")
        out.append("</details>")
        return "".join(out)

    rows = [
        [n.graph, n.name, n.op, n.module, n.precision, n.dtype, ", ".join(n.casts) or "-", n.reason]
        for n in plan.nodes
        if floating(n)
    ]
    data = json.dumps(rows).replace("</", "<\\/")
    legend = "".join(f"<span><span class='b' style='background:{c}'>{k}</span></span>" for k, c in COLORS.items())
    badge = "".join(f".b.{k}{{background:{c}}}" for k, c in COLORS.items())
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{esc(title)}</title><style>{_CSS}{_TREE_CSS}{badge}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f"<p>{esc(plan.format_summary())}</p>",
        f"<p class='legend'>{legend}</p>",
        "<input id='q' placeholder='filter modules (e.g. attn, h.3)'>",
        node("", 0),
        f"<script type='application/json' id='nodes'>{data}</script>",
    ]
    small = [r for r in records if len(r.graph.graph.nodes) <= _SVG_LIMIT]
    for rec in small:
        parts.append(
            f"<details><summary>graph {rec.index} drawn ({esc(rec.dtype)}: "
            f"{esc(rec.dtype_reason)})</summary><div class='graph'>{to_svg(rec)}</div></details>"
        )
    if len(small) < len(records):
        parts.append(
            f"<p class='n'>{len(records) - len(small)} graph(s) over {_SVG_LIMIT} nodes are "
            "not drawn: open their modules above, or use --format dot.</p>"
        )
    parts.append(f"<script>{_TREE_JS}</script></body></html>")
    return "\n".join(parts)


# ---------------------------------------------------------------- module tree (terminal)

_COLOURS = {"LOW": "green", "FP32": "red", "PROMOTE": "yellow", "PASSTHROUGH": "bright_black"}
_FLOATS = ("fp32", "bf16", "fp16")


def floating(node) -> bool:
    """Whether a planned node touches a floating tensor (int64 index plumbing does not)."""
    return node.dtype in _FLOATS or node.compute_dtype in _FLOATS


class Modules:
    """A plan grouped by module path: each module's own nodes that touch a floating tensor,
    the casts inserted in front of them, and every ancestor module, for tree views."""

    def __init__(self, plan: PrecisionPlan):
        self.own: dict[str, list] = defaultdict(list)
        self.casts: dict[str, list] = defaultdict(list)
        by_name = {(n.graph, n.name): n for n in plan.nodes}
        for c in plan.casts:
            consumer = by_name.get((c.graph, c.consumer.split(", ")[0]))
            self.casts[consumer.module if consumer else ""].append(c)
        for n in plan.nodes:
            if floating(n):
                self.own[n.module].append(n)
        paths = set(self.own) | set(self.casts)
        for p in list(paths):  # every ancestor gets a row
            parts = p.split(".") if p else []
            paths.update(".".join(parts[:i]) for i in range(1, len(parts)))
        paths.discard("")
        self._children: dict[str, list[str]] = defaultdict(list)
        for p in sorted(paths, key=_path_key):
            self._children[p.rsplit(".", 1)[0] if "." in p else ""].append(p)
        self._subtree: dict[str, tuple] = {}
        self._signature: dict[str, tuple] = {}

    def children(self, path: str) -> list[str]:
        return self._children.get(path, [])

    def subtree(self, path: str) -> tuple:
        """(Counter of precisions, casts) over the module and everything it holds."""
        if path not in self._subtree:
            counts = Counter(n.precision for n in self.own.get(path, []))
            casts = list(self.casts.get(path, []))
            for child in self.children(path):
                c, k = self.subtree(child)
                counts.update(c)
                casts += k
            self._subtree[path] = (counts, casts)
        return self._subtree[path]

    def fp32_reasons(self, path: str):
        """The module's own FP32 nodes' reasons (without their parenthesised detail), counted."""
        return Counter(n.reason.split(" (")[0] for n in self.own.get(path, []) if n.precision == "FP32")

    def signature(self, path: str) -> tuple:
        """What a subtree shows, child names relative: equal for repeated blocks."""
        if path not in self._signature:
            own = tuple(sorted(Counter(n.precision for n in self.own.get(path, [])).items()))
            self._signature[path] = (
                own,
                len(self.casts.get(path, ())),
                tuple(sorted(self.fp32_reasons(path))),
                tuple((c.rsplit(".", 1)[-1], self.signature(c)) for c in self.children(path)),
            )
        return self._signature[path]


def _path_key(path: str) -> list:
    return [int(x) if x.isdigit() else x for x in path.split(".")]


PRECISIONS = ("LOW", "FP32", "PROMOTE", "PASSTHROUGH")


def module_tree(plan, title: str = "amp plan"):
    """A rich Tree: per module (nested by path) its nodes per precision, casts and bytes
    cast (subtree totals), and the reasons its own FP32 nodes give (pins included)."""
    from rich.text import Text
    from rich.tree import Tree

    mods = Modules(plan)

    def label(path: str) -> Text:
        counts, casts = mods.subtree(path)
        nbytes = sum(c.bytes or 0 for c in casts)
        text = Text(path.rsplit(".", 1)[-1] if path else title, style="bold")
        text.append("  ")
        for prec in PRECISIONS:
            if counts[prec]:
                text.append(f"{prec} {counts[prec]} ", style=_COLOURS[prec])
        if casts:
            text.append(f" casts {len(casts)} ({nbytes / 2**20:.2f} MiB)", style="cyan")
        for reason, k in mods.fp32_reasons(path).most_common(2):
            text.append(f"\n  FP32 x{k}: {reason[:100]}", style="red")
        return text

    def add(tree, path):
        kids = mods.children(path)
        i = 0
        while i < len(kids):  # a run of identical siblings (h.0 ... h.47) is shown once
            j = i + 1
            while j < len(kids) and mods.signature(kids[j]) == mods.signature(kids[i]):
                j += 1
            branch = tree.add(
                label(kids[i])
                if j - i == 1
                else Text(
                    f"{kids[i].rsplit('.', 1)[-1]} .. {kids[j - 1].rsplit('.', 1)[-1]}: {j - i} alike, each:\n",
                    style="bold magenta",
                )
                + label(kids[i])
            )
            add(branch, kids[i])
            i = j

    root = Tree(label(""))
    add(root, "")
    return root
