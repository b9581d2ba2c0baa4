"""The loss head's variants on a decoder written as users write one, one training step each.

    python tools/head_decoder.py                      # CPU: 2 x 1024 tokens; CUDA: 8 x 1024
    python tools/head_decoder.py --variants autocast-inductor,fused,off
    python tools/head_decoder.py --returns-logits    # the model returns its logits too, as HF's do
    python tools/head_decoder.py --json bench/head-decoder-cpu.json   # the figures, with the machine
    python tools/head_decoder.py --reuse-memory      # freed CPU memory kept for reuse (all variants)
    python tools/head_decoder.py --batch 4 --ahead-rows 2048   # the one-pass head's row blocks, set
    python tools/head_decoder.py --variants autocast-inductor,exact,exact-split,exact-fp32  # AMX
    python tools/head_decoder.py --split-twin --variants exact,exact-split,exact-fp32  # no AMX

A 50257-entry ``nn.Embedding`` (default init, std 1) tied to the head as
``h @ emb.weight.t()``, two ``nn.TransformerEncoderLayer``s (d=256, causal), ``F.cross_entropy``
of FP32 logits: logits spread ~16, as at step 0 of a model trained from scratch. Variants,
interleaved in one process from the same weights, each forward + backward + AdamW: Inductor
+ autocast BF16, and ``torch.compile(backend=AmpBackend(loss_head=...))`` with the head
as amp chooses (``auto``, the default: the plan's choice is printed), ``fused``, unfused
(``off``) and ``exact``. Where oneDNN runs FP32 GEMMs' products in BF16 (AMX;
``machine.bf16_products`` in the JSON) ``exact`` splits its GEMMs into BF16 products where one
block times faster so (``machine.split_timings``); ``exact-split`` and ``exact-fp32`` (not in
the default list) always and never do (``split_onednn``, ``loss_head.tuned``); elsewhere they are left
out, saying why, unless ``--split-twin`` runs the split there anyway: its GEMMs then compute in
FP32, so it measures the split's structure (three GEMMs and a pass per block against one
GEMM), never AMX's speed.
Prints median step times, the ratio to
Inductor + autocast, the bytes autograd saves for backward, and on CUDA each step's peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from benchkit.measure import machine, reuse_memory, saved_bytes
from benchkit.variants import SAME_ALLOCATOR

from amp_compiler import AmpBackend, loss_head
from amp_compiler.atomic import write_text

VARIANTS = ("autocast-inductor", "auto", "fused", "off", "exact")
# only by --variants: the exact head with its GEMMs always split into BF16 products through
# oneDNN, or never (``split_onednn``, ``loss_head.tuned``); ``exact`` lets its timing choose
NAMED = {"exact-split": True, "exact-fp32": False}


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, seq: int, returns_logits: bool = False):
        super().__init__()
        self.returns_logits = returns_logits
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, ids, labels):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        h = self.norm(self.body(self.emb(ids) + self.pos[: ids.shape[1]], mask=mask, is_causal=True))
        logits = h @ self.emb.weight.t()
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))
        return (loss, logits) if self.returns_logits else loss


def make_step(kind: str, model: nn.Module, ids, labels, device: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    backend = None
    if kind == "autocast-inductor":
        compiled = torch.compile(model)

        def loss():
            with torch.autocast(device, dtype=torch.bfloat16):
                return _loss(compiled(ids, labels))
    else:
        backend = AmpBackend(loss_head="exact" if kind in NAMED else kind, **SAME_ALLOCATOR)
        compiled = backend.compile(model)

        def loss():
            return _loss(compiled(ids, labels))

    scope = functools.partial(loss_head.tuned, split_onednn=NAMED[kind]) if kind in NAMED else contextlib.nullcontext

    def step():
        with scope():
            value = loss()
            value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value

    def forward():
        with scope():
            return loss()

    return step, backend, forward


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


def choice(backend) -> str:
    """What ``loss_head="auto"`` chose, from the plan."""
    for node in backend.plan().nodes:
        if "auto: " in node.reason:
            return node.reason[node.reason.index("auto: ") :]
    return "no loss head in the plan"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--returns-logits", action="store_true", help="the model returns its logits beside the loss")
    p.add_argument("--json", help="also write the figures and the machine's facts to this file")
    p.add_argument("--reuse-memory", action="store_true", help="keep freed CPU memory for reuse in every variant")
    p.add_argument(
        "--ahead-rows",
        type=int,
        help="tokens per row block of the one-pass fused head (default: amp's choice, by bytes of logits)",
    )
    p.add_argument(
        "--split-twin",
        action="store_true",
        help="on a CPU without BF16 products, run the split anyway as FP32 GEMMs (its structure's cost)",
    )
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    native = loss_head.takes_bf16_products(torch.device(device))
    if args.split_twin and (device != "cpu" or native):
        raise SystemExit("--split-twin: only on a CPU whose oneDNN runs no BF16 products; here the split is real")
    with loss_head.tuned(**({"bf16_products": True} if args.split_twin else {})):
        return _main(args, device, native)


def _main(args, device: str, native: bool) -> int:
    reuse_memory(args.reuse_memory)
    if args.ahead_rows is not None:
        if args.ahead_rows < 1:
            raise SystemExit("--ahead-rows: a positive number of tokens")
    rows = {} if args.ahead_rows is None else {"ahead_min_rows": args.ahead_rows, "ahead_min_rows_amx": args.ahead_rows}
    with loss_head.tuned(**rows, **({"ahead_bytes": 0} if rows else {})):  # the rows are the floor alone
        return _variants(args, device, native)


def _variants(args, device: str, native: bool) -> int:
    kinds = [k for k in args.variants.split(",") if k]
    if bad := [k for k in kinds if k not in (*VARIANTS, *NAMED)]:
        raise SystemExit(f"--variants: unknown {bad}; choose from {', '.join((*VARIANTS, *NAMED))}")
    if not loss_head.takes_bf16_products(torch.device(device)):
        for k in [k for k in kinds if k in NAMED]:
            print(f"{k} left out: oneDNN runs no FP32 GEMM's products in BF16 here (it does with AMX)")
            kinds.remove(k)
    batch = args.batch or (8 if device == "cuda" else 2)
    torch.manual_seed(0)
    base = Decoder(args.vocab, args.d, args.layers, args.seq, args.returns_logits).to(device)
    ids = torch.randint(0, args.vocab, (batch, args.seq), device=device)
    labels = torch.randint(0, args.vocab, (batch, args.seq), device=device)
    steps, backends, losses, params = {}, {}, {}, {}
    for k in kinds:
        model = Decoder(args.vocab, args.d, args.layers, args.seq, args.returns_logits).to(device)
        model.load_state_dict(base.state_dict())
        steps[k], backends[k], losses[k] = make_step(k, model, ids, labels, device)
        params[k] = list(model.parameters())
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    peak, saved = {}, {}
    for k, step in steps.items():
        step()
        step()
        saved[k] = saved_bytes(losses[k], params[k])
        for p in params[k]:
            p.grad = None
        if device == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            sync()
            peak[k] = (torch.cuda.max_memory_allocated() - before) / 2**20
    times = {k: [] for k in kinds}
    for _ in range(args.reps):
        for k, step in steps.items():
            sync()
            t = time.perf_counter()
            step()
            sync()
            times[k].append(time.perf_counter() - t)
    ref = statistics.median(times["autocast-inductor"]) if "autocast-inductor" in times else None
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    exact = loss_head.exact_products(torch.device(device), args.d, measure=False)
    twin = " (split twin: its products computed in FP32 here)" if args.split_twin else ""
    print(f"{where}, torch {torch.__version__}, {batch} x {args.seq} tokens, vocabulary {args.vocab}", end="")
    print(f", exact: {exact}{twin}")
    results = {}
    for k in kinds:
        ms = statistics.median(times[k]) * 1e3
        ratio = ms / ref / 1e3 if ref else None
        results[k] = {"step_ms": ms, "saved_bytes": saved[k], "vs_autocast_inductor": ratio}
        if k in peak:
            results[k]["peak_mib"] = peak[k]
        if k == "auto":
            results[k]["choice"] = choice(backends[k])
        line = f"{k}: {ms:.1f} ms"
        if ratio:
            line += f"  {ratio:.2f}x autocast-inductor"
        line += f"  saved {saved[k] / 2**20:.0f} MiB"
        if "autocast-inductor" in saved:
            line += f" ({saved[k] / saved['autocast-inductor']:.2f}x)"
        if k in peak:
            line += f"  peak {peak[k]:.0f} MiB"
        if k == "auto":
            line += f"  ({choice(backends[k])})"
        print(line)
    if args.json:
        size = {"batch": batch, "seq": args.seq, "vocab": args.vocab, "d": args.d, "layers": args.layers}
        itemsize = loss_head.ahead_itemsize(torch.device(device), torch.bfloat16, exact=False)
        size["ahead_rows"] = loss_head.ahead_shape(batch * args.seq, args.vocab, itemsize, device)[0]
        report = {"machine": machine(device, "bf16", "the head's variants in BF16"), "size": size}
        report["machine"]["bf16_products"] = native  # not the twin's play
        report["machine"]["exact_products"] = exact  # at this head's width
        report["returns_logits"], report["variants"] = args.returns_logits, results
        report["split_twin"] = args.split_twin
        write_text(args.json, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
