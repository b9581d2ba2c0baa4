"""The README's demo: a small built-in transformer trained with FP32 and with amp, side by side."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .backend import AmpBackend


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
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
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


def train(model, compiled, steps, batch_size, seq, vocab, seed, progress=None):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    timed, t0 = 0, 0.0
    for step in range(steps):
        ids, targets = batch(gen, batch_size, seq, vocab)
        if step == 2:  # compile and warm-up excluded from timing
            t0 = time.perf_counter()
        loss, acc = compiled(ids, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        timed += step >= 2
        if progress:
            progress(step, loss.item())
    seconds = (time.perf_counter() - t0) / max(timed, 1)
    return loss.item(), acc.item(), seconds


def run_demo(steps: int = 100, dtype: str = "bf16", inner: str = "inductor", batch_size: int = 8,
             seq: int = 128, vocab: int = 64, d: int = 384, seed: int = 0, progress=None) -> dict:
    """Train the same initial model in FP32 and under amp; return both results and the plan."""
    torch.manual_seed(seed)
    model = DemoLM(vocab=vocab, d=d, seq=seq)
    amp_model = copy.deepcopy(model)
    fp32_backend = inner if isinstance(inner, str) else "eager"
    amp_backend = AmpBackend(dtype=dtype, inner=inner)
    results = []
    for name, m, backend in (("fp32", model, fp32_backend), (f"amp-{dtype}", amp_model, amp_backend)):
        compiled = torch.compile(m, backend=backend)
        cb = (lambda s, loss, name=name: progress(name, s, loss)) if progress else None
        loss, acc, sec = train(m, compiled, steps, batch_size, seq, vocab, seed, cb)
        results.append(RunResult(name, loss, acc, sec))
    return {"results": results, "plan": amp_backend.plan(), "inner": inner,
            "speedup": results[0].seconds_per_step / results[1].seconds_per_step,
            "params_fp32": all(p.dtype == torch.float32 for p in amp_model.parameters())}
