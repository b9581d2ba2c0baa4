"""Pre-training with a plain loop: ``make_train_step`` against the same loop in FP32.

    python examples/pretrain.py --steps 200          # dtype "auto": what this machine runs fast

A small Llama learns next-word prediction on Python's reference documentation. Both runs
start from the same weights and see the same batches; the script prints both final
validation losses, both times and amp's plan.
"""

from __future__ import annotations

import copy

import torch
from common import Timer, arguments, corpus, llama, report, token_blocks, tokenizer

import amp_compiler


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__, argv, steps=200, dtype=True, batch=8, seq=64)

    sentences = corpus()
    tok = tokenizer(sentences)
    data = token_blocks(sentences, tok, args.seq)
    train, val = data[: -args.batch * 4], data[-args.batch * 4 :]
    g = torch.Generator().manual_seed(0)
    order = torch.randint(0, len(train), (args.steps, args.batch), generator=g)

    model = llama(vocab=len(tok))
    results = {}
    for name in ("fp32", "amp"):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        if name == "amp":
            step = amp_compiler.make_train_step(m, opt, lambda out: out.loss, dtype=args.dtype, max_grad_norm=1.0)
            print(f"amp: {step.dtype} ({step.dtype_reason})")
        with Timer() as t:
            for batch in order:
                x = train[batch]
                if name == "amp":
                    step({"input_ids": x, "labels": x})
                else:
                    opt.zero_grad()
                    m(input_ids=x, labels=x).loss.backward()
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                    opt.step()
        with torch.no_grad():
            if name == "amp":
                val_loss = step.loss({"input_ids": val, "labels": val}).item()
            else:
                val_loss = m(input_ids=val, labels=val).loss.item()
        results[name] = (val_loss, t.seconds)
    report("pre-training (validation loss)", results["fp32"], results["amp"], step.backend.plan())
    return {"results": results, "step": step}


if __name__ == "__main__":
    main()
