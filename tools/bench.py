"""Side-by-side benchmark: FP32, torch.autocast and amp, one process, interleaved repetitions.

    python tools/bench.py                                  # CPU: every workload, a table
    python tools/bench.py --json bench.json --plot bench.png
    python tools/bench.py --table bench.json               # the README table from a JSON
    python tools/bench.py --device cuda --size gpt2-small  # adds TFLOP/s and MFU

Variants (each from the same initial weights, AdamW):
  fp32-eager, fp32-inductor, autocast-eager, autocast-inductor (GradScaler under FP16),
  amp (torch.compile(backend=AmpBackend)), amp-step (make_train_step: fused update).
Workloads: lm-explicit (decoder, matmul-softmax-matmul attention), lm-sdpa (decoder,
scaled_dot_product_attention), encoder (nn.TransformerEncoder), encoder-dropout (the same
at PyTorch's default dropout 0.1), cnn (conv + BatchNorm). Model code nobody here wrote,
lm-head-32k and lm-head-128k (a 2-layer d=256 decoder over a real vocabulary, 4 x 512 tokens,
the loss as Hugging Face writes it: where the loss head dominates memory; variants
fp32-eager, autocast-inductor and make_train_step with the loss head unfused, fused and
exact; not in the default list). Model code nobody here wrote,
Hugging Face transformers built from configs of the same size (optional, not in the
default list): hf-gpt2, hf-llama, hf-bert (GPT-2 and BERT at their default dropout 0.1),
and decoders with other attention and MLP layouts, dropout off: hf-qwen2 (grouped KV
heads, biased QKV), hf-neox (parallel residual, rotary on a quarter of each head), hf-opt
(learned positions, ReLU), hf-gemma (one KV head, GeGLU), hf-phi (partial rotary, parallel
block).
Metrics: median training-step and inference time over interleaved repetitions, first-call
time (compile included, caches off, each variant into an empty kernel cache, after every
variant has run once on a tiny model: no one-time process cost lands on one), activation
bytes saved for backward (parameters excluded; 16-bit weight copies count), peak memory
of a training step above what was held before it (CUDA: the allocator's peak; CPU: the
profiler's allocation events summed in time order), achieved matmul TFLOP/s of a step and
its fraction of the 16-bit GEMM peak measured on this machine at the start of the run
(the roofline column; workloads whose FLOPs are counted), floating casts in the training
graphs Inductor compiled (forward + backward), the
kernels Inductor generated for the first call (what it compiles, the same on every machine),
on CPU where one step's time goes by kind of op (profiler self time: GEMM, attention,
Inductor-generated kernels, optimizer, casts/copies, other; kinds under 3% left out),
loss and gradient error vs FP32 eager.

These machines are shared and noisy: compare the ratios of one run, never absolute times
across runs. Do not run beside another torch process.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor import metrics as inductor_metrics

from amp_compiler import AmpBackend, make_train_step
from amp_compiler.atomic import write_text
from amp_compiler.device import native_dtypes, resolve_dtype

VARIANTS = ("fp32-eager", "fp32-inductor", "autocast-eager", "autocast-inductor", "amp", "amp-step")
# run only when named: make_train_step under an explicit memory budget, which lets the
# partitioner recast the 16-bit weight copies in backward instead of saving them
EXTRA_VARIANTS = ("amp-step-lowmem", "amp-step-unfused", "amp-step-fused", "amp-step-exact")
# make_train_step's loss_head option per variant (unfused: the head as written)
LOSS_HEAD = {"amp-step-unfused": "off", "amp-step-fused": "fused", "amp-step-exact": "exact"}
LOWMEM_BUDGET = 0.8
LOW_VARIANTS = ("autocast-eager", "autocast-inductor")
WORKLOADS = ("lm-explicit", "lm-sdpa", "encoder", "encoder-dropout", "cnn")
HEAD_WORKLOADS = {"lm-head-32k": 32768, "lm-head-128k": 131072}  # vocabulary
HEAD_VARIANTS = ("fp32-eager", "autocast-inductor", "amp-step-unfused", "amp-step-fused", "amp-step-exact")
HF_WORKLOADS = ("hf-gpt2", "hf-llama", "hf-bert", "hf-qwen2", "hf-neox", "hf-opt", "hf-gemma", "hf-phi")
# dense BF16/FP16 tensor-core peak, TFLOP/s, by device name fragment
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 125.0,
    "V100": 125.0,
    "T4": 65.0,
}
SIZES = {  # LM dimensions: d, layers, heads, batch, seq, vocab
    "cpu": dict(d=512, layers=4, heads=8, batch=8, seq=128, vocab=2048),
    "tiny": dict(d=64, layers=1, heads=2, batch=2, seq=16, vocab=64),
    "gpt2-small": dict(d=768, layers=12, heads=12, batch=8, seq=1024, vocab=50304),
    "gpt2-medium": dict(d=1024, layers=24, heads=16, batch=4, seq=1024, vocab=50304),
}
HEAD_SIZE = dict(d=256, layers=2, heads=4, batch=4, seq=512)  # the loss-head workloads' model


# ----------------------------------------------------------------------------- workloads


class Block(nn.Module):
    def __init__(self, d: int, heads: int, explicit: bool):
        super().__init__()
        self.heads, self.explicit = heads, explicit
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.explicit:
            scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            a = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, d, layers, heads, seq, vocab, explicit, **_):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, explicit) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Encoder(nn.Module):
    def __init__(self, d, layers, heads, vocab, classes=10, dropout=0.0, **_):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        return self.head(self.encoder(self.tok(ids)).mean(1))


class CNN(nn.Module):
    def __init__(self, width=32, classes=10, **_):
        super().__init__()
        layers, c = [], 3
        for w in (width, 2 * width, 4 * width):
            layers += [
                nn.Conv2d(c, w, 3, padding=1, bias=False),
                nn.BatchNorm2d(w),
                nn.ReLU(),
                nn.Conv2d(w, w, 3, padding=1, bias=False),
                nn.BatchNorm2d(w),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            c = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def cls_loss(logits, targets):
    return F.cross_entropy(logits.float(), targets)


def build(workload: str, size: dict, device: str):
    """(model, inputs, targets, loss_fn, flops per training step or None)."""
    g = torch.Generator().manual_seed(0)
    if workload in HEAD_WORKLOADS:
        size = {**size, "vocab": HEAD_WORKLOADS[workload]}
    b, t, v = size["batch"], size["seq"], size["vocab"]
    if workload.startswith("lm"):
        model = LM(explicit=workload == "lm-explicit", **size)
        ids = torch.randint(0, v, (b, t), generator=g)
        targets = torch.roll(ids, -1, 1)
        n = sum(p.numel() for n_, p in model.named_parameters() if not n_.startswith(("tok", "pos")))
        flops = 6 * n * b * t + 12 * size["layers"] * size["d"] * t * b * t
        return model, ids.to(device), targets.to(device), lm_loss, flops
    if workload.startswith("encoder"):  # encoder-dropout: PyTorch's default rate, 0.1
        model = Encoder(dropout=0.1 if workload == "encoder-dropout" else 0.0, **size)
        ids = torch.randint(0, v, (b, t), generator=g)
        return model, ids.to(device), torch.randint(0, 10, (b,), generator=g).to(device), cls_loss, None
    if workload == "cnn":
        model = CNN(width=max(16, size["d"] // 16))
        x = torch.randn(2 * b, 3, 64, 64, generator=g)
        return model, x.to(device), torch.randint(0, 10, (2 * b,), generator=g).to(device), cls_loss, None
    if workload in HF_WORKLOADS:
        model = hf_model(workload, size)
        ids = torch.randint(0, v, (b, t), generator=g)
        return model, ids.to(device), torch.roll(ids, -1, 1).to(device), hf_loss, None
    raise SystemExit(f"unknown workload {workload!r}; choose from {WORKLOADS + HF_WORKLOADS}")


def hf_model(workload: str, size: dict) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise SystemExit(f"{workload} needs transformers: pip install -e '.[hf]'") from None
    d, n, h, v, t = size["d"], size["layers"], size["heads"], size["vocab"], size["seq"]
    torch.manual_seed(0)
    if workload == "hf-gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_embd=d, n_layer=n, n_head=h, vocab_size=v, n_positions=t)
        )
    if workload == "hf-llama":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=d,
                intermediate_size=8 * d // 3,
                num_hidden_layers=n,
                num_attention_heads=h,
                num_key_value_heads=h,
                vocab_size=v,
                max_position_embeddings=t,
            )
        )
    if workload == "hf-bert":
        return transformers.BertForMaskedLM(
            transformers.BertConfig(
                hidden_size=d,
                num_hidden_layers=n,
                num_attention_heads=h,
                intermediate_size=4 * d,
                vocab_size=v,
                max_position_embeddings=t,
            )
        )
    if workload == "hf-qwen2":
        return transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                hidden_size=d,
                intermediate_size=8 * d // 3,
                num_hidden_layers=n,
                num_attention_heads=h,
                num_key_value_heads=max(1, h // 4),
                vocab_size=v,
                max_position_embeddings=t,
            )
        )
    if workload == "hf-neox":
        return transformers.GPTNeoXForCausalLM(
            transformers.GPTNeoXConfig(
                hidden_size=d,
                intermediate_size=4 * d,
                num_hidden_layers=n,
                num_attention_heads=h,
                vocab_size=v,
                max_position_embeddings=t,
                rotary_pct=0.25,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            )
        )
    if workload == "hf-opt":
        return transformers.OPTForCausalLM(
            transformers.OPTConfig(
                hidden_size=d,
                ffn_dim=4 * d,
                num_hidden_layers=n,
                num_attention_heads=h,
                vocab_size=v,
                max_position_embeddings=t,
                word_embed_proj_dim=d,
                dropout=0.0,
                attention_dropout=0.0,
            )
        )
    if workload == "hf-gemma":
        return transformers.GemmaForCausalLM(
            transformers.GemmaConfig(
                hidden_size=d,
                intermediate_size=4 * d,
                num_hidden_layers=n,
                num_attention_heads=h,
                num_key_value_heads=1,
                head_dim=d // h,
                vocab_size=v,
                max_position_embeddings=t,
            )
        )
    return transformers.PhiForCausalLM(
        transformers.PhiConfig(
            hidden_size=d,
            intermediate_size=4 * d,
            num_hidden_layers=n,
            num_attention_heads=h,
            vocab_size=v,
            max_position_embeddings=t,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
        )
    )


def hf_loss(output, targets):
    return lm_loss(output.logits, targets)


# ----------------------------------------------------------------------------- variants


class CastCounter:
    """Counts floating-point casts in every graph Inductor compiles (forward and backward,
    after decomposition) for the variant being compiled: a post-grad pass of Inductor's."""

    def __init__(self):
        self.current: Variant | None = None

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.current is not None:
            self.current.casts += sum(1 for n in graph.nodes if _is_float_cast(n))

    @contextlib.contextmanager
    def installed(self):
        # caches off: a cache hit skips the passes and would also hide the first-call cost
        with (
            torch._inductor.config.patch(post_grad_custom_post_pass=self, fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            yield


def _is_float_cast(node) -> bool:
    if node.op != "call_function" or node.target not in (
        torch.ops.prims.convert_element_type.default,
        torch.ops.aten._to_copy.default,
    ):
        return False
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    return (
        isinstance(src, torch.Tensor)
        and isinstance(out, torch.Tensor)
        and src.is_floating_point()
        and out.is_floating_point()
        and src.dtype != out.dtype
    )


@dataclass
class Variant:
    name: str
    model: nn.Module
    forward: object  # callable(inputs) -> logits
    step: object  # callable(inputs, targets) -> loss tensor
    low: bool  # runs under torch.autocast
    compiled: bool = False
    backend: AmpBackend | None = None
    train_step: object = None  # amp-step: the TrainStep
    loss: object = None  # callable(inputs, targets) -> loss, the way the step computes it
    casts: int = 0
    first: dict = field(default_factory=dict)  # loss and gradients of the first step
    result: dict = field(default_factory=dict)


def make_variant(name, base, loss_fn, dtype, device) -> Variant:
    model = copy.deepcopy(base)
    low = name in LOW_VARIANTS
    ac_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.bfloat16)
    autocast = (lambda: torch.autocast(device, dtype=ac_dtype)) if low else contextlib.nullcontext
    if name.startswith("amp-step"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        options = {"memory_budget": LOWMEM_BUDGET} if name == "amp-step-lowmem" else None
        if name in LOSS_HEAD:
            options = {"loss_head": LOSS_HEAD[name]}
        ts = make_train_step(model, opt, loss_fn, dtype=dtype, compile_options=options)

        def train(x, y, grab=None):
            fused = ts.fused

            def update(scale):  # read the gradients the fused update receives
                grab["grads"] = [p.grad / scale for p in model.parameters()]
                return fused(scale)

            if grab is not None and fused is not None:
                ts.fused = update
            try:
                return ts(x, y).loss
            finally:
                ts.fused = fused

        return Variant(name, model, ts.compiled, train, False, True, ts.backend, ts, loss=ts.loss)
    backend = None
    if name in ("fp32-inductor", "autocast-inductor"):
        fwd = torch.compile(model)
    elif name == "amp":
        backend = AmpBackend(dtype=dtype)
        fwd = torch.compile(model, backend=backend)
    else:
        fwd = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device) if low and dtype == "fp16" else None

    def loss_of(x, y):
        with autocast():
            return loss_fn(fwd(x), y)

    def step(x, y, grab=None):
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if grab is not None:
            grab["grads"] = [p.grad.clone() for p in model.parameters()]
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        return loss.detach()

    def forward(x):
        with autocast():
            return fwd(x)

    return Variant(name, model, forward, step, low, fwd is not model, backend, loss=loss_of)


# ----------------------------------------------------------------------------- measurements


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def saved_bytes(run, params, then=lambda result: result) -> int:
    """Bytes of the tensors autograd saves for backward while ``run()`` executes (storages
    of ``params`` excluded; 16-bit copies of them count); then ``then(result).backward()``."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    then(result).backward()
    return sum(seen.values())


# Where a step's time goes, by kind of op (profiler self time). On CPU Inductor's generated
# kernels run inside the compiled graph's call, so that call's self time is theirs.
BREAKDOWN_KINDS = (
    ("gemm", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::", "aten::linear")),
    ("attention", ("flash_attention", "scaled_dot_product", "efficient_attention")),
    ("generated", ("compiledfxgraph", "cpp_fused", "triton_")),
    ("optimizer", ("fused_adam", "_foreach", "adam")),
    ("casts", ("aten::copy_", "aten::_to_copy", "aten::clone")),
)
BREAKDOWN_SHORT = {"gemm": "GEMM", "attention": "attn", "generated": "gen", "optimizer": "opt", "casts": "cast"}


def breakdown_kind(name: str) -> str:
    n = name.lower().replace(" ", "")
    return next((kind for kind, keys in BREAKDOWN_KINDS if any(k in n for k in keys)), "other")


def step_breakdown(v: Variant, x, y, device: str) -> dict[str, float] | None:
    """Shares of one training step's op self time by kind (GEMM, attention, generated kernels,
    optimizer, casts/copies, other). CPU only: on CUDA the work is the GPU's, not these
    events' CPU time."""
    if device != "cpu":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        v.step(x, y)
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        totals[breakdown_kind(e.key)] = totals.get(breakdown_kind(e.key), 0.0) + e.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    return {k: t / whole for k, t in sorted(totals.items(), key=lambda kv: -kv[1])}


def format_breakdown(parts: dict[str, float] | None) -> str:
    """The kinds above 3% of the step, largest first: ``GEMM 53 gen 34 opt 7``."""
    if not parts:
        return "-"
    return " ".join(f"{BREAKDOWN_SHORT.get(k, k)} {f:.0%}".replace("%", "") for k, f in parts.items() if f >= 0.03)


def step_peak_bytes(v: Variant, x, y, device: str) -> int:
    """Peak memory of one training step above what was allocated before it. CUDA: the
    caching allocator's peak. CPU: the profiler's allocation events (``profile_memory``;
    Inductor's kernels allocate through the same allocator), summed in time order."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        v.step(x, y)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v.step(x, y)
    allocations, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:  # every allocation and free (negative size) the CPU allocator reported
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            allocations.append((e.start_time_ns, e.extra_fields.alloc_size))
    now = peak = 0
    for _, size in sorted(allocations):
        now += size
        peak = max(peak, now)
    return peak


def gemm_peak_tflops(device: str, dtype: str) -> float:
    """The best GEMM rate of this machine in ``dtype`` (TFLOP/s), the roofline's ceiling:
    square GEMMs of a few sizes, best of three each."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    best = 0.0
    for n in (256, 512) if _emulated(device, dtype) else (1024, 2048, 4096):
        a, b = (torch.randn(n, n, device=device).to(dt) for _ in range(2))
        a @ b
        for _ in range(3):
            best = max(best, 2 * n**3 / timed(lambda a=a, b=b: a @ b, device) / 1e12)
    return best


def _emulated(device: str, dtype: str) -> bool:
    return device == "cpu" and dtype != "fp32" and dtype not in native_dtypes(torch.device("cpu"))[0]


def saved_activation_bytes(v: Variant, x, y) -> int:
    """Bytes saved for backward by one forward and loss of a variant, computed as its step does."""
    n = saved_bytes(lambda: v.loss(x, y), v.model.parameters())
    v.model.zero_grad(set_to_none=True)
    return n


def first_step(v: Variant, x, y) -> None:
    v.first["loss"] = v.step(x, y, v.first).item()


def errors_vs_fp32(base, x, y, loss_fn, variants) -> None:
    """Loss and gradient error of each variant's first step vs FP32 eager's, same weights
    (not with dropout: each run draws its own masks)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in base.modules()):
        return
    ref = copy.deepcopy(base)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    ref_g = torch.cat([p.grad.flatten().double() for p in ref.parameters()])
    for v in variants:
        grab = v.first
        r = v.result
        r["loss_rel_err"] = abs(grab["loss"] - ref_loss.item()) / abs(ref_loss.item())
        if "grads" not in grab:  # a training step without the fused update exposes none
            continue
        g = torch.cat([t.flatten().double() for t in grab["grads"]])
        r["grad_rel_err"] = ((g - ref_g).norm() / ref_g.norm()).item()
        r["grad_cos"] = F.cosine_similarity(g, ref_g, dim=0).item()


def warm_up(workload, dtype, device, variants) -> None:
    """One step of each compiled variant on the tiny size of ``workload``, into a kernel cache
    nobody reads again. What a process pays once (imports, the compiler's workers, headers,
    the first use of a code path) then lands on no measured first call; otherwise it falls
    on whichever compiled variant comes first (fp32-inductor: 36 s against 23 s for
    autocast-inductor on the same LM). Once per run, before the first workload."""
    base, x, y, loss_fn, _ = build(workload, SIZES["tiny"], device)
    base.to(device)
    for name in variants:
        torch._dynamo.reset()
        v = make_variant(name, base, loss_fn, dtype, device)
        if v.compiled:
            with torch._inductor.utils.fresh_cache(dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"), delete=False):
                v.step(x, y)


def gemm_flops_by_dtype(name: str, workload: str, size: dict, flops: float, dtype: str) -> dict[str, float]:
    """A step's GEMM FLOPs by the dtype they run in: FP32 variants all FP32; the exact loss
    head's projection (6 x tokens x d x vocabulary, forward and backward) FP32 beside a
    16-bit body; every other variant all in ``dtype``."""
    if name.startswith("fp32"):
        return {"fp32": flops}
    if LOSS_HEAD.get(name) == "exact" and workload.startswith("lm"):
        v = HEAD_WORKLOADS.get(workload, size["vocab"])
        head = 6 * size["batch"] * size["seq"] * size["d"] * v
        return {"fp32": head, dtype: flops - head}
    return {dtype: flops}


def roofline(name, workload, size, flops, step_ms, dtype, peak_tflops) -> float | None:
    """The step's ideal time (each dtype's GEMM FLOPs at that dtype's measured peak) over its
    measured time: a fraction of what the GEMMs alone would allow, never above 1 by
    dividing FP32 work by a 16-bit peak."""
    parts = gemm_flops_by_dtype(name, workload, size, flops, dtype)
    if any(not peak_tflops.get(d) for d in parts):
        return None
    ideal_s = sum(f / (peak_tflops[d] * 1e12) for d, f in parts.items())
    return ideal_s / (step_ms / 1e3)


def run_workload(workload, size, dtype, device, reps, steps, variants, log, peak_tflops=None) -> dict:
    base, x, y, loss_fn, flops = build(workload, size, device)
    base.to(device)
    vs, counter = [], CastCounter()
    for name in variants:
        torch._dynamo.reset()
        v = make_variant(name, base, loss_fn, dtype, device)
        counter.current = v
        with counter.installed():
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            # each variant compiles into an empty kernel cache, in memory and on disk: kernels
            # an earlier variant compiled must not make a later one's first call look cheap
            with torch._inductor.utils.fresh_cache(dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"), delete=False):
                kernels = inductor_metrics.generated_kernel_count
                v.result["first_call_s"] = timed(lambda v=v: first_step(v, x, y), device)
                # what the first call compiles (C++/Triton kernels Inductor generated): on few
                # cores the compiler's time, and unlike seconds the same on every machine
                v.result["kernels"] = inductor_metrics.generated_kernel_count - kernels if v.compiled else None
            v.step(x, y)
            v.result["peak_bytes"] = step_peak_bytes(v, x, y, device)
            v.result["saved_bytes"] = saved_activation_bytes(v, x, y)
            v.result["breakdown"] = step_breakdown(v, x, y, device)
            counter.current = None  # casts are counted in the training graphs only
            with torch.no_grad():
                v.forward(x), v.forward(x)  # compile the inference graph, warm up
        vs.append(v)
        log(f"  {workload}: {name} ready (first call {v.result['first_call_s']:.1f} s)")
    # torch._dynamo.reset() above dropped the earlier variants' compiled frames: recompile
    # them (from the caches) before anything is timed
    for v in vs:
        v.step(x, y)
        with torch.no_grad():
            v.forward(x)
    samples = {v.name: [] for v in vs}
    infer = {v.name: [] for v in vs}
    for _ in range(reps):  # interleaved: every variant once per repetition
        for v in vs:
            samples[v.name].append(timed(lambda v=v: [v.step(x, y) for _ in range(steps)], device) / steps)
        for v in vs:
            with torch.no_grad():
                infer[v.name].append(timed(lambda v=v: v.forward(x), device))
    for v in vs:
        r = v.result
        r["step_ms"] = statistics.median(samples[v.name]) * 1e3
        r["step_ms_samples"] = [s * 1e3 for s in samples[v.name]]
        r["infer_ms"] = statistics.median(infer[v.name]) * 1e3
        r["casts"] = v.casts if v.compiled else None
        if v.backend is not None:
            s = v.backend.plan().summary()
            r["plan"] = {"nodes": s["nodes"], "casts": s["casts"], "cast_bytes": s["cast_bytes"]}
        if flops:
            r["tflops"] = flops / (r["step_ms"] / 1e3) / 1e12
            r["roofline"] = roofline(v.name, workload, size, flops, r["step_ms"], dtype, peak_tflops or {})
        if flops and device == "cuda":
            peak = next((p for k, p in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name()), None)
            r["mfu"] = r["tflops"] / peak if peak else None
    errors_vs_fp32(base, x, y, loss_fn, vs)
    ref = {v.name: v.result["step_ms"] for v in vs}
    for v in vs:
        if "fp32-eager" in ref:
            v.result["vs_fp32_eager"] = ref["fp32-eager"] / v.result["step_ms"]
        if "autocast-inductor" in ref:
            v.result["vs_autocast_inductor"] = v.result["step_ms"] / ref["autocast-inductor"]
        if "fp32-inductor" in ref:
            v.result["vs_fp32_inductor"] = v.result["step_ms"] / ref["fp32-inductor"]
    return {"size": size, "flops_per_step": flops, "variants": {v.name: v.result for v in vs}}


def machine(device: str, dtype: str, reason: str) -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    info = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "cpu_kind": native_dtypes(torch.device("cpu"))[1],
        "device": device,
        "dtype": dtype,
        "dtype_reason": reason,
        "command": " ".join(["python"] + sys.argv),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


# ----------------------------------------------------------------------------- output

COLUMNS = (
    "step ms",
    "vs fp32 eager",
    "vs {base}",
    "paired",
    "infer ms",
    "saved MiB",
    "peak MiB",
    "first call s",
    "casts",
    "grad cos",
)


def baseline(workload: dict) -> str | None:
    """The variant the ratio columns divide by: Inductor + autocast, or Inductor FP32 in a run
    without 16-bit variants (``auto`` where 16 bit is emulated: the target there is FP32's)."""
    return next((n for n in ("autocast-inductor", "fp32-inductor") if n in workload["variants"]), None)


def paired_ratio(samples: list[float], base: list[float]) -> float:
    """Median over repetitions of a variant's step time over the baseline's in the same
    repetition: each repetition runs every variant back to back, so a shared machine's
    drift between repetitions cancels (the ratio of medians does not cancel it)."""
    return statistics.median(s / b for s, b in zip(samples, base))


def _has_kernels(workload: dict) -> bool:
    """Whether the run counted kernels (runs before the column have none: shown as they were)."""
    return any("kernels" in r for r in workload["variants"].values())


def _has_breakdown(workload: dict) -> bool:
    return any(r.get("breakdown") for r in workload["variants"].values())


def rows(workload: dict) -> list[tuple[str, ...]]:
    out = []
    base = workload["variants"].get(baseline(workload))
    kernels = _has_kernels(workload)
    breakdown = _has_breakdown(workload)
    for name, r in workload["variants"].items():
        paired = f"{paired_ratio(r['step_ms_samples'], base['step_ms_samples']):.2f}" if base else "-"
        ratio = f"{r['step_ms'] / base['step_ms']:.2f}" if base else "-"
        out.append(
            (
                name,
                f"{r['step_ms']:.1f}",
                f"{r['vs_fp32_eager']:.2f}x" if "vs_fp32_eager" in r else "-",
                ratio,
                paired,
                f"{r['infer_ms']:.1f}",
                f"{r['saved_bytes'] / 2**20:.1f}",
                f"{r['peak_bytes'] / 2**20:.1f}" if r.get("peak_bytes") is not None else "-",
                f"{r['first_call_s']:.1f}",
                "-" if r["casts"] is None else str(r["casts"]),
                f"{r['grad_cos']:.5f}" if "grad_cos" in r else "-",
            )
            + (("-" if r.get("kernels") is None else str(r["kernels"]),) if kernels else ())
            + ((format_breakdown(r.get("breakdown")),) if breakdown else ())
            + (
                (
                    f"{r['tflops']:.3g}",
                    "-" if r.get("roofline") is None else f"{r['roofline']:.1%}",
                    "-" if r.get("mfu") is None else f"{r['mfu']:.1%}",
                )
                if "tflops" in r
                else ()
            )
        )
    return out


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"Measured {m['date']} on {m['cpu']} ({m['cpu_kind']}, {m['threads']} threads)"
        + (f", {m['gpu']}" if "gpu" in m else "")
        + f", torch {m['torch']}, dtype {m['dtype']}"
        f" ({m['dtype_reason']}); `{m['command']}`. Medians of interleaved repetitions; "
        "`vs autocast+inductor` (`vs fp32-inductor` in a run without 16-bit variants) is the ratio "
        "of median step times (below 1 is faster); `paired` the median of the ratios within each "
        "repetition, which a busy machine moves less.",
        "",
    ]
    for name, w in results["workloads"].items():
        extra = (
            (("kernels",) if _has_kernels(w) else ())
            + (("time by kind %",) if _has_breakdown(w) else ())
            + (("TFLOP/s", "of GEMM peak", "MFU") if any("tflops" in r for r in w["variants"].values()) else ())
        )
        base = "fp32-inductor" if baseline(w) == "fp32-inductor" else "autocast+inductor"
        head = ("variant",) + tuple(c.format(base=base) for c in COLUMNS) + extra
        lines += [f"**{name}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows(w)]
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results["workloads"])
    names = [n for n in VARIANTS + EXTRA_VARIANTS if any(n in w["variants"] for w in results["workloads"].values())]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(workloads), 4))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ys = [results["workloads"][w]["variants"].get(n, {}).get("vs_fp32_eager", 0) for w in workloads]
        ax.bar([j + i * width for j in range(len(workloads))], ys, width, label=n)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("training-step speed vs FP32 eager (x)")
    m = results["machine"]
    ax.set_title(f"{m.get('gpu', m['cpu'])} - {m['dtype']}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--size", choices=list(SIZES), default=None, help="LM dimensions (default: cpu on CPU, gpt2-small on CUDA)"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="fp32: what auto runs where 16 bit is emulated (amp on its FP32 path)",
    )
    p.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated, from {','.join(WORKLOADS)} (default: all), {','.join(HEAD_WORKLOADS)} "
        f"(the loss head) and {','.join(HF_WORKLOADS)} (transformers)",
    )
    p.add_argument("--batch", type=int, help="batch size instead of the size's (loss-head workloads: 4)")
    p.add_argument("--seq", type=int, help="sequence length instead of the size's (loss-head workloads: 512)")
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated subset of {','.join(VARIANTS)} (default: all), "
        f"and {','.join(EXTRA_VARIANTS)} (only when named)",
    )
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median)")
    p.add_argument("--steps", type=int, default=3, help="training steps per repetition")
    p.add_argument("--json", help="write every measurement to this file")
    p.add_argument("--plot", help="write a PNG of step-time ratios (matplotlib)")
    p.add_argument("--table", metavar="JSON", help="print the markdown table of a saved run and exit")
    a = p.parse_args(argv)
    if a.table:
        with open(a.table) as f:
            print(markdown(json.load(f)))
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    size = SIZES[a.size or ("gpt2-small" if a.device == "cuda" else "cpu")]
    workloads = (
        a.workloads.split(",")
        if a.workloads
        else (["lm-sdpa", "lm-explicit"] if a.device == "cuda" else list(WORKLOADS))
    )
    heads = [w for w in workloads if w in HEAD_WORKLOADS]
    if heads and len(heads) != len(workloads):
        p.error("run the loss-head workloads on their own (their model size is their own)")
    if heads:
        size = {**HEAD_SIZE, "vocab": 0} if a.size is None else size
    size = {**size, **({"batch": a.batch} if a.batch else {}), **({"seq": a.seq} if a.seq else {})}
    variants = a.variants.split(",") if a.variants else list(HEAD_VARIANTS if heads else VARIANTS)
    all_workloads = set(WORKLOADS + HF_WORKLOADS) | set(HEAD_WORKLOADS)
    for bad in set(workloads) - all_workloads | set(variants) - set(VARIANTS + EXTRA_VARIANTS):
        p.error(f"unknown workload or variant {bad!r}")
    dtype, reason = resolve_dtype(a.dtype, torch.device(a.device))
    if dtype == "fp32":
        variants = [v for v in variants if v not in LOW_VARIANTS]
        why = "asked for" if a.dtype == "fp32" else "16 bit is emulated here; pass --dtype bf16 to time it anyway"
        print(f"{reason}: autocast variants left out ({why})", flush=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    results = {"machine": machine(a.device, dtype, reason), "workloads": {}}
    peak = {d: gemm_peak_tflops(a.device, d) for d in {dtype, "fp32"}}
    results["machine"]["gemm_peak_tflops"] = peak
    log("GEMM peak measured here (TFLOP/s): " + ", ".join(f"{d} {t:.3g}" for d, t in peak.items()))
    # an emulated dtype's GEMM rate is no ceiling (other shapes emulate faster): no roofline for it
    peak = {d: t for d, t in peak.items() if not _emulated(a.device, d)}
    # A fresh kernel cache for the run (each variant's first call gets its own inside it):
    # compiled C++/Triton kernels of an earlier run would hide the first-call cost (the FX
    # and AOT caches are switched off per variant as well).
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    run_cache = tempfile.mkdtemp(prefix="amp-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = run_cache
    try:
        if size != SIZES["tiny"] and not heads:  # a tiny run is a smoke test: it would warm up on itself
            log("warming up (one-time costs of the process)")
            warm_up(workloads[0], dtype, a.device, variants)
        for w in workloads:
            results["workloads"][w] = run_workload(w, size, dtype, a.device, a.reps, a.steps, variants, log, peak)
            if a.json:  # a long run keeps what it has measured so far
                write_text(a.json, json.dumps(results, indent=1))
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
        shutil.rmtree(run_cache, ignore_errors=True)  # loaded kernels stay mapped; the files go
    print(markdown(results))
    if a.plot:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
