"""Generation side by side: time to first token, time per later token, tokens against FP32.

``python tools/serve_bench.py --generate`` (see there). Variants, the same weights:
  eager-fp32            transformers' generate(), greedy, eager PyTorch in FP32
  openvino-fp32         our FP32 export, stateful OpenVINO, its settings (hint f32, FP32 cache)
  openvino-own-bf16     our FP32 export, stateful OpenVINO, its defaults (bf16 on a CPU with
                        native BF16: OpenVINO picks the precision of every op itself, and
                        stores a fused attention's cache as u8, as optimum-intel's default
                        serving does)
  openvino-amp-bf16     our BF16 export (the plan), stateful OpenVINO, its settings (hint f32)
  autocast-inductor-static  transformers' generate() with a static cache, the model's forward
                        compiled by Inductor, under torch.autocast (BF16)
  amp-static            the same compiled by amp's backend (BF16); its plan's 16-bit ops counted
  optimum-bf16          optimum-intel's export of the same weights (``--optimum DIR``), its
                        defaults (as ``OVModelForCausalLM`` serves it on this CPU)
  optimum-f32           the same, hint f32
The optimum-intel anchor is made in a venv of its own (optimum-intel pins an older
transformers): ``--save-model DIR`` writes the bench's model, then, in that venv,
``optimum-cli export openvino --model DIR --task text-generation-with-past --weight-format
fp32 OUT``; ``--optimum OUT`` adds it here (one process: the same loop, the same machine).
Each OpenVINO variant is timed by the same loop (prefill, then one token at a time); the
first token's time includes the prompt, each later token's is the median over the rest.
generate() is timed by a streamer's clock: the call to the first new token, then the
interval between tokens. The compiled variants compile at a first, untimed generation per
case (its seconds reported as ``compile_s``).
Tokens are compared with eager FP32's: the first divergent token over the prompts.
"""

from __future__ import annotations

import pathlib
import statistics
import time

import numpy as np

GEN_VARIANTS = ("eager-fp32", "openvino-fp32", "openvino-own-bf16", "openvino-amp-bf16")
COMPILED_VARIANTS = ("autocast-inductor-static", "amp-static")
OPTIMUM_VARIANTS = ("optimum-bf16", "optimum-f32")


def llama_for(d: int, layers: int, vocab: int, seed: int = 0):
    """A Llama-style decoder with grouped-query attention, its head scaled so the logits
    spread as a trained model's (greedy picks then have margins: divergence means rounding
    changed a real decision, not a near-tie of an untrained model)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    heads = max(d // 64, 2)
    config = transformers.LlamaConfig(
        hidden_size=d, intermediate_size=int(d * 8 / 3) // 64 * 64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), vocab_size=vocab,
        max_position_embeddings=4096,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # logit std ~3 instead of ~0.1
    return model


def _prompts(batch: int, length: int, vocab: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed + batch * 1000 + length).integers(0, vocab, (batch, length), dtype=np.int64)
    return ids, np.ones_like(ids)


def _ov_runner(path: str, layout, own: bool, threads: int):
    """A stateful OpenVINO request for the export at ``path``: as served (a 16-bit export: the
    model written beside it, the plan's FP32 pinned under the BF16 hint; an FP32 one: the
    settings beside it, hint f32, the cache in FP32), or ``own``: OpenVINO's defaults on the
    ONNX file (BF16 wherever it can on a native-BF16 CPU, a fused attention's cache as u8)."""
    from amp_compiler.onnx_export.openvino import _core, compile_stateful, stateful_model

    if own:
        config = {"INFERENCE_NUM_THREADS": threads}
        compiled = _core().compile_model(stateful_model(path, layout), "CPU", config)
    else:
        compiled, _ = compile_stateful(path, layout, threads=threads, check=False)
    return compiled.create_infer_request()


# which of our exports each OpenVINO variant serves (the file's stem)
ARTIFACTS = {"openvino-fp32": "fp32", "openvino-own-bf16": "fp32", "openvino-amp-bf16": "bf16"}


def _request(kind: str, folder: str | None, layout, optimum: str | None, threads: int):
    """The OpenVINO request ``kind`` serves: our export in ``folder`` or optimum-intel's, with
    the settings beside it or OpenVINO's defaults (the ``own`` and ``optimum-bf16`` forms)."""
    own = kind in ("openvino-own-bf16", "optimum-bf16")
    if kind in OPTIMUM_VARIANTS:
        return _optimum_runner(optimum, own, threads)
    return _ov_runner(f"{folder}/{ARTIFACTS[kind]}.onnx", layout, own, threads)


def _optimum_runner(folder: str, own: bool, threads: int):
    """A request on optimum-intel's stateful export in ``folder`` (``openvino_model.xml``)."""
    from amp_compiler.onnx_export.openvino import _core

    config = {"INFERENCE_NUM_THREADS": threads}
    if not own:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    core = _core()
    return core.compile_model(core.read_model(f"{folder}/openvino_model.xml"), "CPU", config).create_infer_request()


def _ov_generate(request, ids, mask, new_tokens: int) -> tuple[np.ndarray, float, list[float]]:
    """(tokens, first token seconds, later tokens' seconds each)."""
    from amp_compiler.onnx_export.generation import positions

    request.reset_state()
    beam = np.arange(len(ids), dtype=np.int32)
    feed, out, times = ids, [], []
    for _ in range(new_tokens):
        t = time.perf_counter()
        pos = positions(mask)[:, -feed.shape[1] :]
        logits = request.infer({"input_ids": feed, "attention_mask": mask, "position_ids": pos, "beam_idx": beam})[
            "logits"
        ]
        feed = logits[:, -1].argmax(-1).astype(np.int64)[:, None]
        times.append(time.perf_counter() - t)
        out.append(feed)
        mask = np.concatenate([mask, np.ones_like(feed)], 1)
    return np.concatenate(out, 1), times[0], times[1:]


class _TokenClock:
    """A generate() streamer that stamps what it is given: the prompt, then each new token."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _torch_generate(model, ids, mask, new_tokens: int, *, static=False, autocast=False):
    """transformers' generate(), greedy: (tokens, first token seconds, later tokens' seconds)."""
    import contextlib

    import torch
    import transformers

    config = transformers.GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, cache_implementation="static" if static else None
    )
    model.generation_config.eos_token_id = None
    clock = _TokenClock()
    low = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), low:
        t = time.perf_counter()
        out = model.generate(
            input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), generation_config=config,
            streamer=clock,
        )  # fmt: skip
    new = clock.stamps[1:]  # the first stamp is the prompt's
    return out[:, ids.shape[1] :].numpy(), new[0] - t, list(np.diff(new))


def _how(kind: str) -> dict:
    """How a PyTorch variant calls generate(): the compiled ones with a static cache, one under
    torch.autocast."""
    return {"static": kind in COMPILED_VARIANTS, "autocast": kind == "autocast-inductor-static"}


def _compiled(model, kind: str):
    """A copy of ``model`` whose forward ``kind`` compiles, and amp's backend (or None)."""
    import copy

    import torch

    from amp_compiler import AmpBackend

    compiled = copy.deepcopy(model)
    backend = AmpBackend(dtype="bf16") if kind == "amp-static" else "inductor"
    compiled.forward = torch.compile(compiled.forward, backend=backend)
    return compiled, backend if kind == "amp-static" else None


ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1}


def _cache_held(request, layout) -> dict:
    """The precision a variant holds its KV cache in, and its bytes per token (u8: the values
    only; OpenVINO keeps a scale and zero point per token and head beside them)."""
    if request is not None:
        precision = request.get_compiled_model().get_property("KV_CACHE_PRECISION").to_string()
    else:  # transformers' caches (dynamic or static) are the model's dtype, FP32 here
        precision = "f32"
    values = 2 * layout.layers * layout.kv_heads * layout.head_dim
    return {"precision": precision, "bytes_per_token": values * ELEMENT_BYTES.get(precision, 0)}


def _resident(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def serve_once(args) -> int:
    """The memory child: set ``args.gen_rss_of`` up (load, compile, one generation), reset
    the peak, generate the case again and print {"peak_bytes", "setup_bytes"}. Every child
    imports torch, transformers and OpenVINO alike (optimum-intel's and our generate() import
    them too), so the peaks differ by what each variant holds and computes."""
    import json

    import openvino  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from amp_compiler.onnx_export.generation import CacheLayout

    torch.set_num_threads(args.threads)
    kind, (batch, length) = args.gen_rss_of, (args.batches[0], args.prompt_lengths[0])
    ids, mask = _prompts(batch, length, args.vocab)
    if kind in ("eager-fp32", *COMPILED_VARIANTS):
        model = llama_for(args.d, args.layers, args.vocab)
        if kind in COMPILED_VARIANTS:
            model = _compiled(model, kind)[0]

        def run():
            _torch_generate(model, ids, mask, args.new_tokens, **_how(kind))

    else:
        layout = CacheLayout(**json.loads(args.layout)) if args.layout else None
        request = _request(kind, args.artifact, layout, args.optimum, args.threads)

        def run():
            _ov_generate(request, ids, mask, args.new_tokens)

    run()
    setup = _resident("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on: serving, not setting up
        f.write("5")
    run()
    print(json.dumps({"peak_bytes": _resident("VmHWM"), "setup_bytes": setup}))
    return 0


def memory_of(kind: str, args, folder: str, layout) -> dict:
    """``serve_once`` for ``kind`` in a process of its own, serving the largest case."""
    import dataclasses
    import json
    import subprocess
    import sys

    tool = str(pathlib.Path(__file__).resolve().parents[1] / "serve_bench.py")
    cmd = [sys.executable, tool, "--generate", "--gen-rss-of", kind, "--d", str(args.d), "--layers", str(args.layers)]
    cmd += ["--vocab", str(args.vocab), "--threads", str(args.threads), "--new-tokens", str(args.new_tokens)]
    cmd += ["--batches", str(max(args.batches)), "--prompt-lengths", str(max(args.prompt_lengths))]
    if kind in ARTIFACTS:  # the exports' folder
        cmd += ["--artifact", folder, "--layout", json.dumps(dataclasses.asdict(layout))]
    if args.optimum:
        cmd += ["--optimum", args.optimum]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode:
        raise RuntimeError(f"{kind}: the memory run failed: {res.stderr[-1500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run_generation(args, folder: str) -> dict:
    import torch

    from amp_compiler.onnx_export import export_decoder, native_bf16
    from amp_compiler.onnx_export.generation import cache_layout, compare_tokens

    torch.set_num_threads(args.threads)
    model = llama_for(args.d, args.layers, args.vocab)
    every = GEN_VARIANTS + COMPILED_VARIANTS + (OPTIMUM_VARIANTS if args.optimum else ())
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else list(every)
    bad = [v for v in wanted if v not in every]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; choose from {', '.join(every)}")
    skipped = {}
    if not native_bf16():
        for v in ("openvino-own-bf16", "openvino-amp-bf16", "optimum-bf16"):
            if v in wanted:
                skipped[v] = "no native BF16 on this CPU: OpenVINO would compute in FP32"
    kinds = [v for v in wanted if v not in skipped]
    for dtype in dict.fromkeys(ARTIFACTS[k] for k in kinds if k in ARTIFACTS):
        export_decoder(model, f"{folder}/{dtype}.onnx", dtype=dtype, target="openvino", new_tokens=8)
    layout = cache_layout(model)
    served = (*ARTIFACTS, *OPTIMUM_VARIANTS)
    requests = {k: _request(k, folder, layout, args.optimum, args.threads) for k in kinds if k in served}
    compiled = {k: _compiled(model, k) for k in kinds if k in COMPILED_VARIANTS}
    # a prompt and a later token per case, and Dynamo's first recompile before it turns dynamic
    shapes = len(args.batches) * len(args.prompt_lengths)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * shapes)

    def generate(k, ids, mask):
        return _torch_generate(compiled[k][0] if k in compiled else model, ids, mask, args.new_tokens, **_how(k))

    results = {"skipped": skipped, "model": f"Llama-style d={args.d} x {args.layers} layers, vocab {args.vocab}"}
    results["cache"] = {k: _cache_held(requests.get(k), layout) for k in kinds}
    cases = {}
    for batch in args.batches:
        for length in args.prompt_lengths:
            ids, mask = _prompts(batch, length, args.vocab)
            runs = {k: [] for k in kinds}
            reference = _torch_generate(model, ids, mask, args.new_tokens)[0]
            compile_s = {}
            for k in compiled:  # compiles for this case's shapes, untimed
                t = time.perf_counter()
                generate(k, ids, mask)
                compile_s[k] = time.perf_counter() - t
            for _ in range(args.gen_reps):  # interleaved: drift lands on every variant
                for k in kinds:
                    if k == "eager-fp32" or k in compiled:
                        runs[k].append(generate(k, ids, mask))
                    else:
                        _ov_generate(requests[k], ids, mask, 2)  # the previous runtime's threads go idle
                        runs[k].append(_ov_generate(requests[k], ids, mask, args.new_tokens))
            cases[f"{batch}x{length}"] = {
                k: {
                    "first_token_ms": statistics.median(r[1] for r in rs) * 1e3,
                    "per_token_ms": statistics.median(t for r in rs for t in r[2]) * 1e3,
                    "first_divergent_vs_fp32": (vs := compare_tokens(rs[0][0], reference))["first_divergent"],
                    "tokens_differing_vs_fp32": vs["tokens_differing"],
                    **({"compile_s": compile_s[k]} if k in compile_s else {}),
                }
                for k, rs in runs.items()
            }
    results["cases"] = cases
    if not args.no_memory:  # each variant alone, in a process of its own
        results["memory_case"] = f"{max(args.batches)}x{max(args.prompt_lengths)}"
        results["memory"] = {k: memory_of(k, args, folder, layout) for k in kinds}
    for k, (_, backend) in compiled.items():
        if backend is not None:  # what amp planned for the graphs generate() ran
            nodes = [r.plan.summary()["nodes"] for r in backend.records]
            results.setdefault("amp_graphs", {})[k] = {"graphs": len(nodes), "low_ops": [n["LOW"] for n in nodes]}
    results["new_tokens"] = args.new_tokens
    return results


def generation_table(results: dict) -> str:
    lines = [f"model: {results['model']}"]
    lines += [f"skipped {k}: {why}" for k, why in results["skipped"].items()]
    lines += [
        f"| batch x prompt | variant | first token ms | per token ms | first divergent of {results['new_tokens']} "
        "| cache bytes a token |",
        "|---|---|---|---|---|---|",
    ]
    for case, by_kind in results["cases"].items():
        for k, r in by_kind.items():
            div = "-" if r["first_divergent_vs_fp32"] is None else r["first_divergent_vs_fp32"]
            cache = results["cache"][k]
            lines.append(
                f"| {case} | {k} | {r['first_token_ms']:.1f} | {r['per_token_ms']:.2f} | {div} "
                f"| {cache['bytes_per_token']} ({cache['precision']}) |"
            )
    for k, m in results.get("memory", {}).items():
        lines.append(
            f"{k}: peak {m['peak_bytes'] / 2**20:.0f} MiB serving {results['memory_case']} alone "
            f"({(m['peak_bytes'] - m['setup_bytes']) / 2**20:.0f} MiB above its set-up)"
        )
    for k, amp in results.get("amp_graphs", {}).items():
        lines.append(f"{k}: amp planned {amp['graphs']} graphs, 16-bit ops {amp['low_ops']}")
    return "\n".join(lines)


def generation_plot(results: dict, path: str) -> None:
    """Two panels, each case a group of bars per variant: time to first token, per later token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(results["cases"])
    kinds = list(dict.fromkeys(k for c in cases for k in results["cases"][c]))
    fig, axes = plt.subplots(1, 2, figsize=(3 + 2.2 * len(cases), 4.8))
    width = 0.8 / len(kinds)
    for ax, key, label in zip(axes, ("first_token_ms", "per_token_ms"), ("first token (ms)", "each later token (ms)")):
        for i, k in enumerate(kinds):
            ys = [results["cases"][c].get(k, {}).get(key, 0) for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], ys, width, label=k)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases)
        ax.set_xlabel("batch x prompt")
        ax.set_ylabel(label)
        ax.set_yscale("log")
    m = results["machine"]
    fig.suptitle(f"{results['model']}; {m['cpu_bf16']} CPU, {m['threads']} threads, {m['date']}", fontsize=9)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
