"""Serving benchmark: one decoder's inference in every way we ship it, side by side.

    python tools/serve_bench.py                        # GPT-2-style, 4 layers, d=512
    python tools/serve_bench.py --shapes 4x128 --reps 30 --json serve.json
    python tools/serve_bench.py --generate --d 512 --layers 6   # generation (benchkit/generation.py)

Variants (the same weights): eager FP32, Inductor + autocast BF16, amp
(``torch.compile(backend="amp")``), our FP32 export on ONNX Runtime's CPU provider, our
BF16 export on OpenVINO Runtime (``target="openvino"``, on a CPU with native BF16), and,
on a CUDA machine with onnxruntime-gpu, our BF16 export on ORT's CUDA provider. A variant
that cannot run here is listed with the reason, never timed as something else.

Per shape (batch x sequence): median latency over interleaved repetitions (every variant
once per repetition, so drift lands on all), throughput in tokens/s, and the ratio to the
FP32 export on ORT CPU. Per variant: the weights' bytes on disk, and the peak resident
memory of a process that loads that artifact alone and serves the largest shape (a fresh
subprocess each, so one runtime's memory never lands on another's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("eager-fp32", "autocast-inductor", "amp", "ort-cpu-fp32", "openvino-bf16", "ort-cuda-bf16")
BASE = "ort-cpu-fp32"


def model_for(d: int, layers: int, vocab: int, seq: int):
    """A GPT-2 (transformers' code) at the given size, eval mode, fixed seed."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=d, n_head=max(d // 64, 1), vocab_size=vocab, n_positions=max(seq, 64)
    )
    config.bos_token_id = config.eos_token_id = 0
    return transformers.GPT2LMHeadModel(config).eval()


def _ids(batch: int, seq: int, vocab: int):
    import numpy as np

    return np.random.default_rng(1).integers(0, vocab, (batch, seq), dtype=np.int64)


def _export(model, kind: str, folder: str, vocab: int) -> str:
    """Our export for ``kind`` (dynamic batch and sequence), written once into ``folder``."""
    import torch
    from torch.export import Dim

    from amp_compiler import export_onnx

    path = os.path.join(folder, f"{kind}.onnx")
    dtype, target = {"ort-cpu-fp32": ("fp32", "cpu"), "openvino-bf16": ("bf16", "openvino")}.get(kind, ("bf16", "cuda"))
    dims = {0: Dim("batch"), 1: Dim("seq", min=2, max=model.config.n_positions)}
    export_onnx(
        model,
        (torch.from_numpy(_ids(2, 16, vocab)),),
        path,
        kwargs={"use_cache": False},
        dtype=dtype,
        target=target,
        dynamic_shapes={"input_ids": dims, "use_cache": None},
    )
    return path


def unavailable(kind: str) -> str | None:
    """Why ``kind`` cannot run on this machine, or None."""
    if kind in ("ort-cpu-fp32", "ort-cuda-bf16"):
        try:
            import onnxruntime as ort
        except ImportError:
            return "onnxruntime is not installed"
        if kind == "ort-cuda-bf16" and "CUDAExecutionProvider" not in ort.get_available_providers():
            return "no CUDA provider (onnxruntime-gpu on a GPU machine)"
    if kind == "openvino-bf16":
        try:
            from amp_compiler.onnx_export.openvino import native_bf16

            if not native_bf16():
                return "this CPU has no native BF16: OpenVINO would run the BF16 export in FP32"
        except Exception as e:  # openvino missing
            return str(e).split(":")[0]
    return None


def runner(kind: str, model, artifact: str | None, threads: int):
    """A callable (numpy ids) -> logits for one variant. Exports run without torch."""
    if kind == "openvino-bf16":
        import openvino

        with open(os.path.splitext(artifact)[0] + ".openvino.json") as f:
            config = json.load(f) | {"INFERENCE_NUM_THREADS": threads}
        compiled = openvino.Core().compile_model(artifact, "CPU", config)
        request = compiled.create_infer_request()
        name = compiled.inputs[0].any_name
        return lambda ids: request.infer({name: ids})[compiled.outputs[0]]
    if kind in ("ort-cpu-fp32", "ort-cuda-bf16"):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        provider = "CUDAExecutionProvider" if kind == "ort-cuda-bf16" else "CPUExecutionProvider"
        session = ort.InferenceSession(artifact, so, providers=[provider])
        name = session.get_inputs()[0].name
        return lambda ids: session.run(None, {name: ids})[0]
    import torch

    if kind == "eager-fp32":
        forward = model
    elif kind == "autocast-inductor":
        compiled = torch.compile(model, dynamic=False)

        def forward(ids, use_cache):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return compiled(ids, use_cache=use_cache)
    else:
        from amp_compiler import AmpBackend

        backend = AmpBackend()
        forward = torch.compile(model, backend=backend, dynamic=False)

    def run(ids):
        with torch.no_grad():
            return forward(torch.from_numpy(ids), use_cache=False).logits

    if kind == "amp":  # by what compiled: a shape amp never planned would be timed as written
        run.records = backend.records
    return run


def disk_bytes(model, artifact: str | None) -> int:
    if artifact:
        data = artifact + ".data"
        return os.path.getsize(artifact) + (os.path.getsize(data) if os.path.exists(data) else 0)
    # torch variants load the FP32 checkpoint, a tied weight once
    unique = {t.untyped_storage().data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def peak_rss(kind: str, artifact: str | None, args, shape: tuple[int, int]) -> int:
    """Peak resident bytes of a fresh process serving ``shape`` with this variant alone."""
    cmd = [sys.executable, __file__, "--rss-of", kind, "--shapes", f"{shape[0]}x{shape[1]}"]
    cmd += ["--d", str(args.d), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    cmd += ["--threads", str(args.threads)] + (["--artifact", artifact] if artifact else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise RuntimeError(f"{kind}: the memory run failed: {res.stderr[-1500:]}")
    return int(res.stdout.strip().splitlines()[-1])


def _serve_once(args) -> int:
    """The --rss-of child: load one artifact, serve one shape twice, print ru_maxrss in bytes."""
    (batch, seq) = parse_shapes(args.shapes)[0]
    model = None if args.artifact else model_for(args.d, args.layers, args.vocab, seq)
    run = runner(args.rss_of, model, args.artifact, args.threads)
    for _ in range(2):
        run(_ids(batch, seq, args.vocab))
    # VmHWM, not ru_maxrss: Linux keeps the forking parent's maxrss across exec
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    print(int(hwm.split()[1]) * 1024)
    return 0


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes {text!r}: write batch x sequence pairs, e.g. 1x128,8x512") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--shapes", default="1x128,8x128,1x512,8x512,4x128", help="batch x sequence, comma-separated")
    p.add_argument("--variants", default=None, help="comma-separated; default: every variant of the mode")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory subprocesses")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", metavar="PNG", help="generation: the first and later tokens' times as bars")
    p.add_argument(
        "--generate", action="store_true", help="generation: first token and per-token latency, tokens vs FP32"
    )
    p.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4])
    p.add_argument("--prompt-lengths", type=lambda t: [int(x) for x in t.split(",")], default=[128, 512])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--gen-reps", type=int, default=3, help="generations per variant and case (medians)")
    p.add_argument("--save-model", metavar="DIR", help="generation: write the bench's model here (for optimum-cli)")
    p.add_argument("--optimum", metavar="DIR", help="generation: optimum-intel's export of that model, served beside")
    p.add_argument("--rss-of", default=None, help=argparse.SUPPRESS)
    p.add_argument("--gen-rss-of", default=None, help=argparse.SUPPRESS)
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--artifact", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_of:  # before torch is imported: an export's process never loads it
        return _serve_once(args)
    if args.generate:
        return _generate(args)
    import torch

    torch.set_num_threads(args.threads)
    shapes = parse_shapes(args.shapes)
    # the compiled variants share the model's code: one Dynamo cache entry per shape each
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(shapes))
    wanted = [v.strip() for v in (args.variants or ",".join(VARIANTS)).split(",") if v.strip()]
    bad = [v for v in wanted if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    model = model_for(args.d, args.layers, args.vocab, max(s for _, s in shapes))
    skipped = {v: why for v in wanted if (why := unavailable(v))}
    kinds = [v for v in wanted if v not in skipped]
    results = {"machine": _machine(args.threads), "skipped": skipped, "shapes": {}, "variants": {}}
    with tempfile.TemporaryDirectory() as folder:
        artifacts = {k: _export(model, k, folder, args.vocab) if "-bf16" in k or k == BASE else None for k in kinds}
        runs = {k: runner(k, model, artifacts[k], args.threads) for k in kinds}
        for batch, seq in shapes:
            ids = _ids(batch, seq, args.vocab)
            for k in kinds:  # compile / warm up outside the timed loop
                records = getattr(runs[k], "records", None)
                before = len(records) if records is not None else 0
                for _ in range(2):
                    runs[k](ids)
                if records is not None:
                    if len(records) == before:
                        raise SystemExit(f"{k}: amp compiled nothing for {batch}x{seq}; it would be timed as written")
                    results["amp_dtype"] = f"{records[-1].dtype} ({records[-1].dtype_reason})"
            samples = {k: [] for k in kinds}
            for _ in range(args.reps):
                for k in kinds:
                    # torch's OpenMP threads spin for a while after their last op, and so do
                    # ORT's and OpenVINO's: an untimed call first lets the previous runtime's
                    # threads go idle, so no variant shares the cores with another's
                    runs[k](ids)
                    t = time.perf_counter()
                    runs[k](ids)
                    samples[k].append((time.perf_counter() - t) * 1e3)
            med = {k: statistics.median(v) for k, v in samples.items()}
            results["shapes"][f"{batch}x{seq}"] = {
                k: {
                    "ms": med[k],
                    "tokens_per_s": batch * seq / med[k] * 1e3,
                    f"vs_{BASE}": med[k] / med[BASE] if BASE in med else None,
                }
                for k in kinds
            }
        largest = max(shapes, key=lambda s: s[0] * s[1])
        for k in kinds:
            entry = {"disk_bytes": disk_bytes(model, artifacts[k])}
            if not args.no_memory:
                entry["peak_rss_bytes"] = peak_rss(k, artifacts[k], args, largest)
            results["variants"][k] = entry
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _generate(args) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchkit.generation import generation_plot, generation_table, llama_for, run_generation, serve_once

    if args.gen_rss_of:
        return serve_once(args)
    if args.save_model:
        llama_for(args.d, args.layers, args.vocab).save_pretrained(args.save_model)
        print(f"wrote {args.save_model}: export it with optimum-cli in its own venv, then pass --optimum")
        return 0
    if args.optimum and not os.path.isfile(os.path.join(args.optimum, "openvino_model.xml")):
        raise SystemExit(f"--optimum {args.optimum}: no openvino_model.xml there (optimum-cli export openvino ... DIR)")

    with tempfile.TemporaryDirectory() as folder:
        results = {"machine": _machine(args.threads), **run_generation(args, folder)}
    print(f"machine: {results['machine']}")
    print(generation_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot:
        generation_plot(results, args.plot)
    return 0


def _machine(threads: int) -> dict:
    import torch

    with contextlib.suppress(OSError):
        flags = open("/proc/cpuinfo").read()
        kind = "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "no native BF16"
        return {"cpu_bf16": kind, "threads": threads, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    return {"threads": threads, "torch": torch.__version__}


def table(results: dict) -> str:
    lines = [f"machine: {results['machine']}", f"amp ran in {results.get('amp_dtype', '-')}"]
    lines += [f"skipped {k}: {why}" for k, why in results["skipped"].items()]
    lines += ["| shape | variant | ms | tokens/s | vs ORT CPU FP32 export |", "|---|---|---|---|---|"]
    for shape, by_kind in results["shapes"].items():
        for k, r in by_kind.items():
            ratio = "-" if r[f"vs_{BASE}"] is None else f"{r[f'vs_{BASE}']:.2f}"
            lines.append(f"| {shape} | {k} | {r['ms']:.1f} | {r['tokens_per_s']:.0f} | {ratio} |")
    lines += ["", "| variant | weights on disk MiB | peak RSS MiB |", "|---|---|---|"]
    for k, r in results["variants"].items():
        rss = r.get("peak_rss_bytes")
        lines.append(f"| {k} | {r['disk_bytes'] / 2**20:.1f} | {'-' if rss is None else f'{rss / 2**20:.0f}'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
