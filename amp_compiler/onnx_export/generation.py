"""Decoders exported for generation: the KV cache as the graph's inputs and outputs.

One graph serves the prompt (an empty cache in, the prompt's keys and values out) and every
later token (the cache so far in, one token's longer cache out), with the names the
ecosystem uses (``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.{i}.key/value`` in; ``logits``, ``present.{i}.key/value`` out) and
batch, prompt and cache lengths dynamic. On OpenVINO the cache can live inside the compiled
model (``stateful=True``: OpenVINO's MakeStateful, with a ``beam_idx`` input that reorders
it, as optimum-intel serves decoders).

For OpenVINO (which reads ONNX's Attention, opset 23) attention stays one op, laid out so
OpenVINO's CPU plugin fuses it with the stateful cache (``openvino.fusable_attention``); a
16-bit export stores the cache in 16 bit and the settings beside the file hold OpenVINO's
cache in that precision; it is served as the stateful model written beside it
(``openvino.write_served``: under OpenVINO's BF16 hint, the plan's FP32 nodes pinned). For
ONNX Runtime attention is written out (MatMul, Softmax, MatMul).

The export is checked by generating: greedy tokens from the file against PyTorch's FP32
greedy tokens on the same prompts (left-padded batches included). An FP32 export must give
the same tokens; a 16-bit one reports where it first leaves them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..policy import LOW_DTYPES
from .base import ExportError
from .export import ExportReport, export_checked, preflight
from .openvino import (
    as_float32,
    attention_fuses_here,
    compile_stateful,
    fusable_attention,
    native_bf16,
    openvino_feeds,
    remove_served,
    served_path,
    write_served,
)
from .parity import ort_cuda

INPUTS = ("input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class CacheLayout:
    """Where a decoder keeps its cache: ``layers`` pairs of [batch, kv_heads, length, head_dim]."""

    layers: int
    kv_heads: int
    head_dim: int

    @property
    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")]

    @property
    def present_names(self) -> list[str]:
        return [f"present.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")]

    def empty(self, batch: int, length: int = 0) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, length, self.head_dim), np.float32) for _ in self.past_names]


class CachedDecoder(torch.nn.Module):
    """A causal LM's forward over a cache given as tensors: (input_ids, attention_mask,
    position_ids, [(key, value) per layer]) -> (logits, [(key, value) per layer])."""

    def __init__(self, model: torch.nn.Module, cache_dtype: torch.dtype | None = None):
        super().__init__()
        self.model, self.cache_dtype = model, cache_dtype
        self.train(model.training)  # export restores the wrapper's mode, which is the model's
        params = inspect.signature(model.forward).parameters
        # transformers 5.25 names the argument ``cache``; 5.0 ``past_key_values``
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def forward(self, input_ids, attention_mask, position_ids, past):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[tuple(kv) for kv in past], config=self.model.config)
        if self.cache_dtype is not None:
            _store_as(cache, self.cache_dtype)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{self.cache_arg: cache},
        )
        return out.logits, [(layer.keys, layer.values) for layer in _cache_of(out).layers]


def _store_as(cache, dtype: torch.dtype) -> None:
    """The cache keeps each new key and value in ``dtype`` (the plan's 16-bit cache: half the
    bytes); attention reads them back widened to the model's dtype, which the planned 16-bit
    attention narrows again: ``openvino.fold_round_trips`` removes that exact round trip
    from the ONNX graph, so the cache feeds attention as it is."""
    update = cache.update

    def stored(keys, values, *args, **kwargs):
        full_keys, full_values = update(keys.to(dtype), values.to(dtype), *args, **kwargs)
        return full_keys.to(keys.dtype), full_values.to(values.dtype)

    cache.update = stored


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cache_layout(model: torch.nn.Module) -> CacheLayout:
    """The cache's shape, read from one forward of one token (every family lays it out alike)."""
    try:
        with torch.no_grad():
            out = CachedDecoder(model)(
                torch.zeros(1, 1, dtype=torch.long),
                torch.ones(1, 1, dtype=torch.long),
                torch.zeros(1, 1, dtype=torch.long),
                [],
            )
    except Exception as e:
        raise ExportError(
            f"{type(model).__name__} does not run as a decoder with a transformers cache "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); export_decoder takes a "
            "transformers causal LM (AutoModelForCausalLM); export other models with export_onnx"
        ) from e
    layers = out[1]
    if not layers or any(k.dim() != 4 for kv in layers for k in kv):
        raise ExportError(f"{type(model).__name__}'s cache is not [batch, heads, length, head_dim] per layer")
    _, heads, _, dim = layers[0][0].shape
    return CacheLayout(len(layers), heads, dim)


def positions(attention_mask: np.ndarray) -> np.ndarray:
    """Position of each token, counted over the unmasked ones (left padding gets 1, as
    transformers' generate() gives it; it is masked out anyway)."""
    pos = np.cumsum(attention_mask, axis=-1) - 1
    return np.where(attention_mask == 0, 1, pos).astype(np.int64)


def torch_greedy(model: torch.nn.Module, input_ids, attention_mask, new_tokens: int) -> np.ndarray:
    """PyTorch's greedy continuation, through the same cached forward the export traces."""
    step = CachedDecoder(model).eval()
    ids, mask = torch.as_tensor(input_ids), torch.as_tensor(attention_mask)
    past, out = [], []
    with torch.no_grad():
        feed = ids
        for _ in range(new_tokens):
            pos = torch.as_tensor(positions(mask.numpy()))[:, -feed.shape[1] :]
            logits, past = step(feed, mask, pos, past)
            feed = logits[:, -1].argmax(-1, keepdim=True)
            out.append(feed)
            mask = torch.cat([mask, torch.ones_like(feed)], 1)
    return torch.cat(out, 1).numpy()


def example_prompts(vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two prompts of different lengths, the shorter left-padded: the batch a server sees."""
    g = np.random.default_rng(seed)
    ids = g.integers(0, vocab, (2, 12), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # the second prompt is 7 tokens long
    ids[1, :5] = 0
    return ids, mask


@dataclass
class DecoderReport(ExportReport):
    layout: CacheLayout | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    served_path: str | None = None  # the stateful OpenVINO model a 16-bit export is served as
    not_served: str | None = None  # why a 16-bit export for OpenVINO is served as the ONNX file

    def format(self) -> str:
        lines = [super().format()]
        if self.layout:
            lines.append(
                f"  cache: {self.layout.layers} layers x (key, value), {self.layout.kv_heads} heads x "
                f"{self.layout.head_dim}; inputs {', '.join(INPUTS)}, past_key_values.*; outputs logits, present.*"
            )
        if self.generation:
            lines.append("  generation: " + ", ".join(f"{k} {v}" for k, v in self.generation.items()))
        if self.served_path:
            lines.append(
                f"  served as {self.served_path} (stateful; its FP32 nodes pinned under OpenVINO's BF16 "
                f"hint): Decoder({self.path!r}), or openvino.Core().compile_model({self.served_path!r}, 'CPU')"
            )
        if self.not_served:
            lines.append(f"  served as the ONNX file (hint f32): {self.not_served}")
        return "\n".join(lines)


def export_decoder(
    model: torch.nn.Module,
    path: str,
    *,
    dtype: str = "bf16",
    target: str = "openvino",
    check: bool = True,
    new_tokens: int = 32,
    prompts: tuple | None = None,
    opset: int | None = None,
    options: dict | None = None,
) -> DecoderReport:
    """Export a transformers causal LM for generation, from the amp plan (module docstring).

    dtype, target, opset, options: as ``export_onnx``. ``check`` also generates
    ``new_tokens`` greedy tokens for ``prompts`` ((input_ids, attention_mask), numpy or
    tensors; default: two random prompts, one left-padded) on the target's runtime (OpenVINO,
    ONNX Runtime's CPU provider for target "cpu", its CUDA provider for "cuda" where there is
    one; elsewhere the report says it was skipped) and compares them with PyTorch's FP32
    tokens: an FP32 export must match them; a 16-bit one reports the first divergent token
    and the share of tokens that differ.
    """
    preflight(path, dtype, target, check)  # before the fused-attention hint below could blame opset
    layout = cache_layout(model)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    b, past_len, t = 2, 3, 4  # no size 0 or 1 to trace with: each stays dynamic
    g = torch.Generator().manual_seed(0)
    shape = (b, layout.kv_heads, past_len, layout.head_dim)
    past = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(layout.layers)]
    mask = torch.ones(b, past_len + t, dtype=torch.long)
    args = (
        torch.randint(0, vocab, (b, t), generator=g),
        mask,
        torch.arange(past_len, past_len + t).expand(b, t).contiguous(),
        past,
    )
    auto = torch.export.Dim.AUTO
    dynamic = {
        "input_ids": {0: auto, 1: auto},
        "attention_mask": {0: auto, 1: auto},
        "position_ids": {0: auto, 1: auto},
        "past": [({0: auto, 2: auto}, {0: auto, 2: auto})] * layout.layers,
    }
    ids, prompt_mask = (np.asarray(p) for p in prompts) if prompts is not None else example_prompts(vocab)
    simplify, fused, cache_dtype = None, False, None
    if target == "openvino" and (opset or 23) >= 23 and attention_fuses_here():
        # attention as ONNX's Attention: OpenVINO fuses it with the stateful cache, which a
        # 16-bit plan keeps in 16 bit (the fused cache reads it as it is)
        opset, simplify, fused = opset or 23, fusable_attention, True
        cache_dtype = None if dtype == "fp32" else LOW_DTYPES[dtype]
    if cache_dtype is not None:
        past = [tuple(t.to(cache_dtype) for t in kv) for kv in past]
        args = (*args[:3], past)

    def generates(file: str, report: ExportReport) -> None:
        if target == "cuda" and not ort_cuda():
            report.generation = {
                "skipped": "no CUDA device with onnxruntime-gpu here: generate where it is served, "
                "Decoder(path, runtime='ort', provider='CUDAExecutionProvider')"
            }
            return
        want = torch_greedy(model, ids, prompt_mask, new_tokens)
        runtime = "openvino" if target == "openvino" else "ort"
        provider = "CUDAExecutionProvider" if target == "cuda" else "CPUExecutionProvider"
        runner = Decoder(file, runtime=runtime, provider=provider, layout=layout)
        got = runner.generate(ids, prompt_mask, new_tokens)
        report.generation = compare_tokens(got, want)
        if dtype == "fp32" and report.generation["tokens_differing"]:
            raise ExportError(
                f"the FP32 export's greedy tokens leave PyTorch's at token {report.generation['first_divergent']} "
                f"({report.generation['tokens_differing']} of {want.size} differ): the graph is not the model's"
            )

    # a 16-bit decoder for OpenVINO is served as a stateful model with its FP32 nodes pinned
    serve, not_served = target == "openvino" and dtype != "fp32", []

    def serve_beside(file: str) -> None:
        write_served(file, layout)
        if not native_bf16():
            return  # checked where it is served
        try:
            compile_stateful(file, layout)
        except ExportError as e:  # OpenVINO's BF16 hint would not keep this plan
            remove_served(file)
            not_served.append(f"under OpenVINO's BF16 hint {e}")

    try:
        report = export_checked(
            CachedDecoder(model, cache_dtype),
            args,
            path,
            kwargs=None,
            dtype=dtype,
            target=target,
            dynamic_shapes=dynamic,
            opset=opset,
            check=check,
            low_precision_io=False,
            options=options,
            tolerance=None,
            io_names=([*INPUTS, *layout.past_names], ["logits", *layout.present_names]),
            more_checks=generates if check else None,
            simplify=simplify,
            fused_attention=fused,
            beside=serve_beside if serve else None,
        )
    except ExportError as e:
        if not fused:
            raise
        raise ExportError(f"{e} (attention fused for OpenVINO; opset=22 writes it out: MatMul, Softmax, MatMul)") from e
    serve = serve and not not_served
    if not serve:  # an earlier export's served model would not be this file's
        remove_served(path)
    return DecoderReport(
        **vars(report),
        layout=layout,
        served_path=served_path(path) if serve else None,
        not_served=not_served[0] if not_served else None,
    )


def compare_tokens(got: np.ndarray, want: np.ndarray) -> dict[str, Any]:
    """Where generated tokens leave the reference's: per prompt, the first index that differs
    (tokens after it follow a different text, so only the first one is comparable)."""
    firsts = [int(np.argmax(g != w)) if (g != w).any() else None for g, w in zip(got, want)]
    differing = [f for f in firsts if f is not None]
    return {
        "prompts": len(want),
        "new_tokens": want.shape[1],
        "first_divergent": min(differing) if differing else None,  # 0-based, over all prompts
        "prompts_identical": firsts.count(None),
        "tokens_differing": int((got != want).sum()),
    }


class Decoder:
    """Greedy generation from an exported decoder with numpy and the runtime alone.

    runtime "openvino" (``stateful=True``: the cache inside the compiled model) or "ort"
    (ONNX Runtime with ``provider``, the cache passed in and out; a CUDA session never falls
    back to the CPU). ``executed``: on OpenVINO, the precision the planned nodes run in, read
    from the compiled model (ExportError where it is not the plan's); empty on ONNX Runtime.
    """

    def __init__(
        self,
        path: str,
        *,
        runtime: str = "openvino",
        stateful: bool = True,
        layout=None,
        threads=None,
        provider: str = "CPUExecutionProvider",
    ):
        import onnx

        self.runtime, self.stateful = runtime, stateful and runtime == "openvino"
        self.executed: dict[str, Any] = {}
        if layout is None:
            layout = _layout_of(onnx.load(path, load_external_data=False))
        self.layout = layout
        if runtime == "ort":
            import onnxruntime as ort

            so = ort.SessionOptions()
            if threads:
                so.intra_op_num_threads = threads
            if provider == "CUDAExecutionProvider":
                so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
            self.session = ort.InferenceSession(path, so, providers=[provider])
        elif runtime == "openvino":
            from .openvino import compile_openvino, compile_stateful

            # the precision each planned node runs in, checked as the export checks it
            compile = compile_stateful if self.stateful else compile_openvino
            args = (path, layout) if self.stateful else (path,)
            self.compiled, self.executed = compile(*args, threads=threads)
            self.request = self.compiled.create_infer_request()
        else:
            raise ValueError(f"runtime={runtime!r} is not valid; use 'openvino' or 'ort'")

    def step(
        self, feeds: dict[str, np.ndarray], past: list[np.ndarray], beam_idx: np.ndarray | None = None
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One forward: logits and the new cache (the runtime's own cache when stateful: row i
        of it continues from row ``beam_idx[i]``, by default itself)."""
        if self.runtime == "ort":
            out = self.session.run(None, {**feeds, **dict(zip(self.layout.past_names, past))})
            return out[0], out[1:]
        if self.stateful:
            if beam_idx is None:
                beam_idx = np.arange(feeds["input_ids"].shape[0], dtype=np.int32)
            result = self.request.infer({**feeds, "beam_idx": beam_idx})
            return result[self.compiled.output("logits")].copy(), past
        result = self.request.infer(openvino_feeds(self.compiled, {**feeds, **dict(zip(self.layout.past_names, past))}))
        # copies: the request writes its next outputs where these are, while reading them as inputs
        outs = [as_float32(result[port], port).copy() for port in self.compiled.outputs]
        return outs[0], outs[1:]

    def generate(self, input_ids, attention_mask=None, new_tokens: int = 32, eos_token_id=None) -> np.ndarray:
        """``new_tokens`` greedy tokens after each prompt (rows of ``input_ids``, left-padded
        where ``attention_mask`` says); a row that produced ``eos_token_id`` continues with it."""
        ids = np.asarray(input_ids, dtype=np.int64)
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
        if self.stateful:
            self.request.reset_state()
        past, feed, out = self.layout.empty(len(ids)), ids, []
        done = np.zeros(len(ids), bool)
        for _ in range(new_tokens):
            pos = positions(mask)[:, -feed.shape[1] :]
            logits, past = self.step({"input_ids": feed, "attention_mask": mask, "position_ids": pos}, past)
            feed = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
            if eos_token_id is not None:
                feed[done] = eos_token_id
                done |= feed[:, 0] == eos_token_id
            out.append(feed)
            mask = np.concatenate([mask, np.ones_like(feed)], 1)
        return np.concatenate(out, 1)


def _layout_of(model) -> CacheLayout:
    """The cache layout an exported decoder's inputs declare."""
    past = [i for i in model.graph.input if i.name.startswith("past_key_values.")]
    if not past:
        raise ExportError("not a decoder exported for generation: no past_key_values.* inputs (use export_decoder)")
    dims = past[0].type.tensor_type.shape.dim
    return CacheLayout(len(past) // 2, dims[1].dim_value, dims[3].dim_value)
