"""How close each served BF16 form of a briefly trained decoder stays to FP32.

    python tools/generation_closeness.py train DIR        # trains (FP32), saves the model, held-out rows
    OPTIMUM_VENV/bin/optimum-cli export openvino --model DIR --task text-generation-with-past \\
        --weight-format fp32 DIR/optimum                   # optimum-intel, in a venv of its own
    python tools/generation_closeness.py measure DIR --optimum DIR/optimum --json out.json

The decoder is examples/common.py's Llama (d=256, 4 layers, grouped-query attention) trained
on Python's reference documentation by words, as tools/convergence.py trains it. Forms, all on
stateful OpenVINO: our FP32 export (hint f32, FP32 cache); the same with OpenVINO's defaults
(its own BF16, a u8 cache); our BF16 export (the plan, as served), the same with ``lm_head``
pinned FP32 and with ``lm_head`` and attention pinned (``fp32_modules``; served as the ONNX
file, which the BF16 hint cannot keep); optimum-intel's export with its
defaults and with hint f32 (``--optimum``). On held-out rows of 64 tokens: the next-token
KL(FP32 || form) averaged over every position, top-1 agreement with FP32 and the mean NLL,
all from one prefill of each row; then greedy generation of 32 tokens after each row's first
32, against eager FP32's: the first divergent token and the share that differ. Beside them
the time of that prefill (8 rows of 64) and of each later token of one row, the forms
interleaved, medians of five: how close, and at what cost.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))


def train(folder: pathlib.Path, steps: int, d: int, layers: int, seed: int = 0) -> None:
    from common import corpus, llama, token_blocks, tokenizer

    sentences = corpus()
    tok = tokenizer(sentences)
    data = token_blocks(sentences, tok, 64)
    train_rows, held_out = data[:-64], data[-64:]
    model = llama(vocab=len(tok), hidden=d, layers=layers, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    order = torch.randint(0, len(train_rows), (steps, 16), generator=torch.Generator().manual_seed(seed))
    model.train()
    for i, rows in enumerate(order):
        x = train_rows[rows]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if i % 100 == 0 or i == steps - 1:
            print(f"step {i}: loss {loss.item():.3f}", flush=True)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    np.save(folder / "held_out.npy", held_out.numpy())
    print(f"wrote {folder}: export it with optimum-cli (see the module docstring), then measure")


def _prefill_logits(request, rows: np.ndarray) -> np.ndarray:
    from amp_compiler.onnx_export.generation import positions

    mask = np.ones_like(rows)
    request.reset_state()
    feeds = {"input_ids": rows, "attention_mask": mask, "position_ids": positions(mask)}
    return request.infer({**feeds, "beam_idx": np.arange(len(rows), dtype=np.int32)})["logits"].copy()


def closeness(logits: np.ndarray, reference: np.ndarray, rows: np.ndarray) -> dict:
    """KL(reference || logits) per position averaged, top-1 agreement, NLL of the next token."""

    def log_softmax(z):
        z = z.astype(np.float64)
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp, lq = log_softmax(reference), log_softmax(logits)
    kl = (np.exp(lp) * (lp - lq)).sum(-1).mean()
    agree = (reference.argmax(-1) == logits.argmax(-1)).mean()
    nll = -np.take_along_axis(lq[:, :-1], rows[:, 1:, None], -1).mean()
    return {"kl_to_fp32": float(kl), "top1_agreement": float(agree), "nll": float(nll)}


# the plan with modules pinned FP32 (``fp32_modules``): the head; the head and attention
PINNED = {"bf16-fp32-head": ("lm_head",), "bf16-fp32-head-attention": ("lm_head", "self_attn$")}
REPS = 5


def measure(folder: pathlib.Path, optimum: str | None, threads: int) -> dict:
    import transformers
    from benchkit.generation import _optimum_runner, _ov_generate, _ov_runner, _torch_generate

    from amp_compiler import export_decoder
    from amp_compiler.onnx_export.generation import compare_tokens
    from amp_compiler.onnx_export.openvino import native_bf16

    if not native_bf16():
        raise SystemExit(
            "cannot measure how close BF16 generation stays to FP32 on this CPU: it has no native "
            "BF16, so OpenVINO would run every BF16 form in FP32. Measure on a CPU with AVX512-BF16 or AMX."
        )
    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    rows = np.load(folder / "held_out.npy")[:8]
    paths = {k: str(folder / f"amp-{k}.onnx") for k in ("fp32", "bf16", *PINNED)}
    layout = export_decoder(model, paths["fp32"], dtype="fp32", target="openvino", new_tokens=8).layout
    export_decoder(model, paths["bf16"], dtype="bf16", target="openvino", new_tokens=8)
    for name, pins in PINNED.items():
        export_decoder(
            model, paths[name], dtype="bf16", target="openvino", new_tokens=8, options={"fp32_modules": pins}
        )
    forms = {
        "openvino-fp32": lambda: _ov_runner(paths["fp32"], layout, False, threads),
        "openvino-own-bf16": lambda: _ov_runner(paths["fp32"], layout, True, threads),
        "openvino-amp-bf16": lambda: _ov_runner(paths["bf16"], layout, False, threads),
        **{f"openvino-amp-{k}": (lambda k=k: _ov_runner(paths[k], layout, False, threads)) for k in PINNED},
    }
    if optimum:
        forms["optimum-bf16"] = lambda: _optimum_runner(optimum, True, threads)
        forms["optimum-f32"] = lambda: _optimum_runner(optimum, False, threads)
    with torch.no_grad():
        reference = model(input_ids=torch.as_tensor(rows)).logits.numpy()
    prompts, mask = rows[:, :32], np.ones_like(rows[:, :32])
    greedy = _torch_generate(model, prompts, mask, 32)[0]
    out = {"rows": rows.shape, "eager_fp32_nll": closeness(reference, reference, rows)["nll"], "forms": {}}
    requests = {name: make() for name, make in forms.items()}
    prefill, later = {name: [] for name in forms}, {name: [] for name in forms}
    for _ in range(REPS):  # interleaved, as serve_bench times: drift lands on every form
        for name, request in requests.items():
            t = time.perf_counter()
            _prefill_logits(request, rows)
            prefill[name].append(time.perf_counter() - t)
            later[name] += _ov_generate(request, prompts[:1], mask[:1], 16)[2]
    for name, request in requests.items():
        tokens = _ov_generate(request, prompts, mask, 32)[0]
        out["forms"][name] = {
            **closeness(_prefill_logits(request, rows), reference, rows),
            **{f"greedy_{k}": v for k, v in compare_tokens(tokens, greedy).items()},
            "prefill_ms": statistics.median(prefill[name]) * 1e3,
            "per_token_ms": statistics.median(later[name]) * 1e3,
        }
    return out


def table(result: dict) -> str:
    lines = [
        f"held-out rows {tuple(result['rows'])}; eager FP32 NLL {result['eager_fp32_nll']:.4f}",
        "| form | KL to FP32 | top-1 agreement | NLL | greedy: first divergent | tokens differing "
        "| prefill 8 x 64 ms | per later token ms (1 row) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["forms"].items():
        first = "-" if r["greedy_first_divergent"] is None else r["greedy_first_divergent"]
        lines.append(
            f"| {name} | {r['kl_to_fp32']:.2e} | {r['top1_agreement']:.2%} | {r['nll']:.4f} | {first} | "
            f"{r['greedy_tokens_differing']} | {r['prefill_ms']:.2f} | {r['per_token_ms']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=("train", "measure"))
    p.add_argument("folder", type=pathlib.Path)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--optimum", help="optimum-intel's export of the trained model (openvino_model.xml there)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.step == "train":
        train(args.folder, args.steps, args.d, args.layers)
        return 0
    result = measure(args.folder, args.optimum, args.threads)
    print(table(result))
    if args.json:
        record = {"args": {k: str(v) for k, v in vars(args).items()}, **result}
        pathlib.Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
