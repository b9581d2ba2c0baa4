"""The README's demo: a small built-in transformer trained with FP32 and with amp, side by side."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class DemoLM(nn.Module):
    """A pre-LN decoder: token + position embeddings, causal attention, LM head."""

    def __init__(self, vocab: int = 64, d: int = 128, heads: int = 4, layers: int = 2, seq: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, targets):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        accuracy = (logits.argmax(-1) == targets).float().mean()
        return loss, accuracy


def batch(gen: torch.Generator, size: int, seq: int, vocab: int):
    """Task: at every position, predict the token two places back (needs attention)."""
    ids = torch.randint(1, vocab, (size, seq), generator=gen)
    targets = torch.cat([torch.zeros(size, 2, dtype=torch.long), ids[:, :-2]], dim=1)
    return ids, targets


@dataclass
class RunResult:
    name: str
    loss: float
    accuracy: float
    seconds_per_step: float


def run_demo(
    steps: int = 100,
    dtype: str = "auto",
    inner: str = "inductor",
    batch_size: int = 8,
    seq: int = 128,
    vocab: int = 64,
    d: int = 384,
    seed: int = 0,
    progress=None,
) -> dict:
    """Train the same initial model with FP32 and with the amp training step; return both."""
    from .train import make_train_step

    torch.manual_seed(seed)
    model = DemoLM(vocab=vocab, d=d, seq=seq)
    amp_model = copy.deepcopy(model)

    fp32 = torch.compile(model, backend=inner)
    fp32_opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def fp32_step(ids, targets):
        loss, acc = fp32(ids, targets)
        fp32_opt.zero_grad(set_to_none=True)
        loss.backward()
        fp32_opt.step()
        return loss.detach(), acc

    step = make_train_step(
        amp_model,
        torch.optim.AdamW(amp_model.parameters(), lr=3e-3),
        lambda out: out[0],
        dtype=dtype,
        compile_options={"inner": inner},
    )

    def amp_step(ids, targets):
        return step((ids, targets)).loss, None

    # the two runs take turns step by step, so a shared machine's drift hits both alike
    runs = (("fp32", fp32_step, model), (f"amp-{step.dtype}", amp_step, amp_model))
    gens = [torch.Generator().manual_seed(seed) for _ in runs]
    spent, last = [0.0] * len(runs), [None] * len(runs)
    for i in range(steps):
        for k, (name, fn, _) in enumerate(runs):
            ids, targets = batch(gens[k], batch_size, seq, vocab)
            t0 = time.perf_counter()
            last[k], _ = fn(ids, targets)
            if i >= 2:  # compile and warm-up excluded from timing
                spent[k] += time.perf_counter() - t0
            if progress:
                progress(name, i, last[k])
    results = []
    ids, targets = batch(torch.Generator().manual_seed(seed + 1), batch_size, seq, vocab)
    for (name, _, m), loss, seconds in zip(runs, last, spent):
        with torch.no_grad():
            _, acc = m(ids, targets)
        results.append(RunResult(name, float(loss), acc.item(), seconds / max(steps - 2, 1)))
    return {
        "results": results,
        "plan": step.backend.plan(),
        "inner": inner,
        "dtype": step.dtype,
        "dtype_reason": step.dtype_reason,
        "speedup": results[0].seconds_per_step / results[1].seconds_per_step,
        "params_fp32": all(p.dtype == torch.float32 for p in amp_model.parameters()),
        "skipped_steps": step.skipped_steps,
    }


def print_demo(steps: int = 100, dtype: str = "auto", inner: str = "inductor") -> dict:
    """The README's main job: say which precision and why, train with a progress bar, compare."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .device import resolve_dtype

    console = Console()
    choice, reason = resolve_dtype(dtype, torch.device("cpu"))
    console.print(f"Precision: {choice} ({reason})")
    console.print(
        f"Training a small transformer for {steps} steps: FP32 vs amp ({choice}), "
        f"inner compiler {inner} (the first steps include compilation)"
    )
    columns = (
        TextColumn("{task.description:<9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:
        tasks = {}

        def progress(name, i, loss):
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=steps, loss=float("nan"))
            bar.update(tasks[name], advance=1, loss=float(loss))

        out = run_demo(steps=steps, dtype=dtype, inner=inner, progress=progress)
    console.print(f"\nPrecision plan: {out['plan'].format_summary()}")
    table = Table("run", "final train loss", "held-out accuracy", "ms/step")
    for r in out["results"]:
        table.add_row(r.name, f"{r.loss:.4f}", f"{r.accuracy:.3f}", f"{r.seconds_per_step * 1e3:.1f}")
    console.print(table)
    console.print(
        f"amp speed vs FP32: {out['speedup']:.2f}x (same process, steps taking turns); "
        f"parameters FP32: {out['params_fp32']}; skipped steps: {out['skipped_steps']}"
    )
    return out
