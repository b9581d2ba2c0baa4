"""Convergence on real text: a small decoder trained FP32 vs amp BF16 and FP16, same weights,
same batches; final validation loss, skipped steps and FP16's loss-scale history.

    python tools/convergence.py --steps 300 --json bench/convergence.json
    python tools/convergence.py --dtypes fp32 --fp32-orders 3    # FP32's own spread

The 16-bit runs' distance to FP32 means something only beside FP32's own run-to-run spread:
``--fp32-orders N`` trains FP32 again on N other batch orders (same weights) and reports
how far their validation losses lie from the first.

The corpus is Python's own reference documentation (``pydoc_data.topics``, shipped with
Python), tokenized by words (examples/common.py). Each dtype runs ``make_train_step``;
FP32 is the same step with the plan not applied.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from common import corpus, llama, token_blocks, tokenizer  # noqa: E402

import amp_compiler  # noqa: E402


def run(steps: int, dtypes: list[str], batch: int = 16, seq: int = 64, inner: str = "inductor", order: int = 0) -> dict:
    sentences = corpus()
    tok = tokenizer(sentences)
    data = token_blocks(sentences, tok, seq)
    train, val = data[:-64], data[-64:]
    batches = torch.randint(0, len(train), (steps, batch), generator=torch.Generator().manual_seed(order))
    model = llama(vocab=len(tok))
    out = {"steps": steps, "batch": batch, "seq": seq, "runs": {}}
    for dtype in dtypes:
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        step = amp_compiler.make_train_step(
            m, opt, lambda o: o.loss, dtype=dtype, max_grad_norm=1.0, compile_options={"inner": inner}
        )
        scales, losses = [], []
        for batch_ids in batches:
            x = train[batch_ids]
            r = step({"input_ids": x, "labels": x})
            losses.append(r.loss.item())
            scales.append(r.scale)
        val_loss = step.loss({"input_ids": val, "labels": val}).item()
        out["runs"][dtype] = {
            "val_loss": val_loss, "train_loss_last": losses[-1], "skipped_steps": step.skipped_steps,
            "scale_history": scales if dtype == "fp16" else None, "dtype_ran": step.dtype,
        }  # fmt: skip
    ref = out["runs"].get("fp32", {}).get("val_loss")
    for r in out["runs"].values():
        r["vs_fp32"] = None if ref is None else r["val_loss"] / ref - 1
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--dtypes", default="fp32,bf16,fp16")
    p.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--fp32-orders", type=int, default=0, help="FP32 again on this many other batch orders")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    out = run(args.steps, args.dtypes.split(","), inner=args.inner)
    if args.fp32_orders:
        if "fp32" not in out["runs"]:
            out["runs"].update(run(args.steps, ["fp32"], inner=args.inner)["runs"])
        ref = out["runs"]["fp32"]["val_loss"]
        others = [
            run(args.steps, ["fp32"], inner=args.inner, order=k)["runs"]["fp32"]["val_loss"]
            for k in range(1, args.fp32_orders + 1)
        ]
        out["fp32_orders"] = {"val_losses": others, "vs_first": [v / ref - 1 for v in others]}
        spread = ", ".join(f"{d * 100:+.3f}%" for d in out["fp32_orders"]["vs_first"])
        print(f"fp32 on {args.fp32_orders} other batch orders: validation loss {spread} vs the first")
    for dtype, r in out["runs"].items():
        vs = "" if r["vs_fp32"] is None else f" ({r['vs_fp32'] * 100:+.3f}% vs FP32)"
        scale = ""
        if r["scale_history"]:
            changes = sum(a != b for a, b in zip(r["scale_history"], r["scale_history"][1:]))
            scale = f"; loss scale {r['scale_history'][0]:g} -> {r['scale_history'][-1]:g} ({changes} changes)"
        print(f"{dtype}: validation loss {r['val_loss']:.4f}{vs}; skipped steps {r['skipped_steps']}{scale}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
