"""Pre-training with Lightning: the same ``LightningModule`` trained by a plain FP32 Trainer and
by one with ``AmpPrecision``.

    python examples/lightning_train.py --steps 100
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch
from common import Timer, arguments, corpus, llama, report, token_blocks, tokenizer

from amp_compiler.integrations.lightning import AmpPrecision


class LM(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids).loss

    def training_step(self, batch, batch_idx):
        return self(batch)  # self(...): the compiled forward

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__, argv, steps=100, dtype=True)
    sentences = corpus()
    tok = tokenizer(sentences)
    data = token_blocks(sentences, tok, 64)
    train, val = data[:-32], data[-32:]
    base = llama(vocab=len(tok))
    results, plugin = {}, None
    for name in ("fp32", "amp"):
        module = LM(copy.deepcopy(base))
        plugins = [plugin := AmpPrecision(args.dtype)] if name == "amp" else []
        trainer = pl.Trainer(
            max_steps=args.steps, plugins=plugins, accelerator="cpu", devices=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        loader = torch.utils.data.DataLoader(
            train, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
        )
        with Timer() as t:
            trainer.fit(module, loader)
        with torch.no_grad():
            results[name] = (module(val).item(), t.seconds)
    print(f"lightning: amp ran {plugin.dtype} ({plugin.reason})")
    report("lightning (validation loss)", results["fp32"], results["amp"], plugin.plan())
    return {"results": results, "plugin": plugin}


if __name__ == "__main__":
    main()
