"""Helpers the tests share: a recording inner backend, small models, numeric helpers.

A plain module (``from helpers import ...``); fixtures and pytest hooks live in conftest.
"""

from __future__ import annotations

import copy
import os
import socket

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from amp_compiler import AmpBackend


class OpRecorder(TorchDispatchMode):
    """Records (op packet, floating input dtypes) of every ATen op executed, and their shapes."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[object, list[torch.dtype]]] = []
        self.shapes: list[list[tuple[int, ...]]] = []  # the floating inputs' shapes, call by call
        self.casts: list[tuple[torch.dtype, torch.dtype]] = []  # (from, to) of each dtype cast run

    # higher-order ops (the RNG-state wrappers AOTAutograd puts around random ops under
    # activation checkpointing) run through as they are, their own ops unrecorded
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        self.record(func.overloadpacket, args, kwargs)
        return func(*args, **kwargs)

    def record(self, op, args, kwargs) -> None:
        if op is torch.ops.aten._to_copy and kwargs.get("dtype") not in (None, args[0].dtype):
            self.casts.append((args[0].dtype, kwargs["dtype"]))
        floats = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        self.calls.append((op, [a.dtype for a in floats]))
        self.shapes.append([tuple(a.shape) for a in floats])

    def dtypes_of(self, *packets) -> list[list[torch.dtype]]:
        return [call[1] for call in self.calls if call[0] in packets]  # subclasses may add fields

    def dtypes_where(self, packets, shape_test) -> list[list[torch.dtype]]:
        """Input dtypes of the calls to ``packets`` whose input shapes pass ``shape_test``:
        tells one module's GEMM from the rest by its weight's shape."""
        return [c[1] for c, s in zip(self.calls, self.shapes) if c[0] in packets and shape_test(s)]


class RecordingBackend:
    """aot_eager, with forward and backward executed under ``recorder``; picklable, so a
    spawned rank (Lightning's ddp_spawn) records into its own copy. ``graphs`` keeps the
    graphs the amp backend handed over; ``partition_fn`` replaces AOTAutograd's partitioner."""

    def __init__(self, recorder: OpRecorder, graphs: list | None = None, partition_fn=None):
        self.recorder, self.graphs, self.partition_fn = recorder, graphs, partition_fn

    def _recorded(self, gm, example_inputs):
        def run(args):
            with self.recorder:
                return gm(*args)

        run._boxed_call = True
        return run

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        if self.graphs is not None:
            self.graphs.append(gm)
        partition = {"partition_fn": self.partition_fn} if self.partition_fn else {}
        return aot_autograd(fw_compiler=self._recorded, bw_compiler=self._recorded, **partition)(gm, example_inputs)


class FakeGlibc:
    """Stands in for glibc's ``mallopt`` (``cpu_memory._libc``): records what amp asked and
    answers ``answer``; the real setting is process-wide and would stay with the test worker."""

    def __init__(self, answer: int = 1):
        self.answer, self.calls = answer, []

    def mallopt(self, option, value):
        self.calls.append((option, value.value))
        return self.answer


def recording_backend(recorder: OpRecorder, graphs: list | None = None, partition_fn=None) -> RecordingBackend:
    return RecordingBackend(recorder, graphs, partition_fn)


class MLP(nn.Module):
    def __init__(self, d=16, hidden=32, out=4):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class NormHead(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear: torch.autocast sends the LayerNorm to FP32 too."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)


class Attention(nn.Module):
    """Pre-LN transformer block; explicit softmax attention or SDPA."""

    def __init__(self, d=32, heads=4, sdpa=False):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            a = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=32, layers=2, sdpa=False, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Attention(d, sdpa=sdpa) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids, labels=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class ConvNet(nn.Module):
    def __init__(self, classes=4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.features(x))


# -- the tiny Hugging Face models the tests build from configs (no download), in one place


def tiny_llama(attn: str | None = None, *, seed: int | None = None, **config) -> nn.Module:
    """transformers' Llama from a small config (2 layers, d=32, one KV head, 100 tokens);
    ``config`` overrides any field, ``seed`` seeds the initialisation."""
    import pytest

    transformers = pytest.importorskip("transformers")
    base = dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        vocab_size=100,
    )  # fmt: skip
    if attn:
        base["attn_implementation"] = attn
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**base, **config}))


def tiny_gpt2(*, seed: int | None = None, **config) -> nn.Module:
    """transformers' GPT-2 LM from a small config (2 layers, d=32, 96 tokens, 32 positions);
    ``config`` overrides any field, ``seed`` seeds the initialisation."""
    import pytest

    transformers = pytest.importorskip("transformers")
    base = dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**base, **config}))


# -- a decoder that computes its own loss, as a Hugging Face model given labels does


def hf_causal_loss(logits, labels):
    """transformers' ForCausalLMLoss: FP32 logits, labels padded and shifted, -100 ignored."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), shift.view(-1), ignore_index=-100)


class TinyDecoder(nn.Module):
    """Embedding -> Linear+GELU -> a vocabulary projection; given labels it returns its loss,
    ``losses[loss]`` (a subclass adds the ways models write one)."""

    losses = {"hf": hf_causal_loss}

    def __init__(self, loss="hf", vocab=8192, d=32, tied=False, bias=False, returns_logits=False):
        super().__init__()
        self.loss, self.returns_logits = loss, returns_logits
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, vocab, bias=bias)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids, labels=None):
        logits = self.head(self.body(self.emb(ids)))
        if labels is None:  # the loss is the caller's
            return logits
        loss = self.losses[self.loss](logits, labels)
        return (loss, logits) if self.returns_logits else loss


def causal_batch(seed=1, vocab=8192, seq=32):
    """Token ids and labels (2 x ``seq``), the first row's first 5 labels masked (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


def grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double(), b.double(), dim=0).item()


def cli_here(capsys, *args) -> tuple[int, str, str]:
    """A CLI command in this process: (exit code, stdout, stderr). For a test's further
    commands once a subprocess has shown the entry point (start-up and imports are most of
    a small command's time)."""
    from amp_compiler.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


aten = torch.ops.aten
MATMULS = (aten.mm, aten.addmm, aten.bmm)


LOW_EXEC = (
    aten.mm,
    aten.bmm,
    aten.addmm,
    aten.baddbmm,
    aten.convolution,
    aten._scaled_dot_product_flash_attention_for_cpu,
)


FP32_EXEC = (
    aten._softmax,
    aten._log_softmax,
    aten.native_layer_norm,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten.native_batch_norm,
    aten.nll_loss_forward,
    aten.mean,
    aten.exp,
    aten.pow,
    aten.rsqrt,
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
    aten.native_layer_norm_backward,
)


def train_step(model, inputs, backend, dynamic=None):
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    loss = compiled(*inputs)
    loss.backward()
    return loss


def assert_executed_dtypes(rec: OpRecorder, low=torch.bfloat16):
    low_calls = rec.dtypes_of(*LOW_EXEC)
    assert low_calls, "no matmul/conv/attention executed"
    for dtypes in low_calls:
        assert dtypes[:2] == [low, low], dtypes
    fp32_calls = rec.dtypes_of(*FP32_EXEC)
    assert fp32_calls
    for dtypes in fp32_calls:
        assert all(d == torch.float32 for d in dtypes), dtypes


def assert_near(out: torch.Tensor, ref: torch.Tensor, share: float) -> None:
    """``out`` within ``share`` of ``ref``'s largest magnitude, everywhere: BF16 rounding of a
    small model's matmuls lands at 0.3-0.7% of it (measured), a wrong graph at tens of %."""
    worst = (out.float() - ref.float()).abs().max().item()
    assert worst <= share * ref.abs().max().item(), f"off by {worst:.4g}, limit {share} x {ref.abs().max().item():.4g}"


def check_against_fp32(model, inputs, low="bf16", loss_tol=0.02, cos_min=0.99):
    """One training step: amp vs FP32 eager. Returns the recorder and backend."""
    ref = copy.deepcopy(model)
    ref_loss = ref(*inputs)
    ref_loss.backward()
    rec = OpRecorder()
    graphs = []
    backend = AmpBackend(dtype=low, inner=recording_backend(rec, graphs))
    loss = train_step(model, inputs, backend)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) <= loss_tol * abs(ref_loss.item())
    g = grads(model)
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
    assert cosine(g, grads(ref)) >= cos_min
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    assert graphs and any(n.meta["amp"].inserted for gm in graphs for n in gm.graph.nodes if "amp" in n.meta)
    return rec, backend, ref


# -- training: a small regression and gradient poisoning


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def data(seed=0, n=64, noise=0.1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + noise * torch.randn(n, 1, generator=g)
    return x, y


def inject(model, bad_steps, kind="inf"):
    """A gradient hook that poisons the first weight's gradient on chosen calls."""
    calls = {"n": 0}
    w = next(model.parameters())

    def hook(grad):
        calls["n"] += 1
        if calls["n"] in bad_steps:
            grad = grad.clone()
            grad[0, 0] = float(kind)
        return grad

    w.register_hook(hook)


# -- a small LM with a loss as Hugging Face models write it


class ShiftLM(nn.Module):
    """Embedding -> Linear+GELU -> LM head; ``shift`` adds a keyword input to the hidden state."""

    def __init__(self, vocab=64, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, shift=None):
        h = self.body(self.emb(ids))
        return self.head(h if shift is None else h + shift)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_torchrun(rank: int, port: int, fn, args, results) -> None:
    # the environment torchrun gives each process; the framework under test initialises the group
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
        WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="amp-test",
    )  # fmt: skip
    try:
        results[rank] = fn(rank, *args)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def two_ranks(fn, *args) -> list:
    """``fn(rank, *args)`` in two processes launched as torchrun launches them (gloo on CPU);
    returns what each returned, by rank. ``fn`` must be a module-level function."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_as_torchrun, args=(free_port(), fn, args, results), nprocs=2, join=True)
    return [results[0], results[1]]


# -- what Inductor's code ran: the profiler's record (a dispatch mode sees nothing inside it)

GEMMS = {"aten::mm": slice(0, 2), "aten::bmm": slice(0, 2), "aten::addmm": slice(1, 3), "aten::baddbmm": slice(1, 3)}


def gemm_operands(prof) -> list[list[str]]:
    """The operand dtypes of every GEMM the compiled code handed the BLAS, by the profiler
    (Inductor's code calls the BLAS for them: what executed, not what the plan says)."""
    name = {"bfloat16": "bf16", "float": "fp32", "half": "fp16"}  # c10::BFloat16, float, ...
    return [
        [name[d.split("::")[-1].lower()] for d in e.input_dtypes[GEMMS[e.name]]]
        for e in prof.events()
        if e.name in GEMMS
    ]


def profiled_gemms(run):
    """(``run()``, the operand dtypes of the GEMMs it ran: ``gemm_operands``)."""
    import pytest

    from amp_compiler.upstream import torch_minor

    if torch_minor() < (2, 13):
        pytest.skip("torch < 2.13's profiler records no operand dtypes")
    with torch.profiler.profile(record_shapes=True) as prof:
        out = run()
    return out, gemm_operands(prof)
