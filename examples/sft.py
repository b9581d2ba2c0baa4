"""Supervised fine-tuning with TRL's ``SFTTrainer`` and its default ``SFTConfig`` plus ``AmpCallback``.

    python examples/sft.py --steps 50

The config stays as TRL ships it (``bf16=True``, gradient checkpointing): the callback reads
the flag as the dtype request and runs amp's plan in place of the Trainer's autocast.
"""

from __future__ import annotations

from common import arguments, corpus, llama, run_trl, tokenizer
from datasets import Dataset
from trl import SFTConfig, SFTTrainer


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__, argv, steps=50)
    sentences = corpus()
    tok = tokenizer(sentences)
    data = Dataset.from_dict({"text": sentences[:512]})

    def make():
        return {"model": llama(vocab=len(tok)), "train_dataset": data, "processing_class": tok}

    return run_trl("sft", SFTTrainer, SFTConfig, make, args.steps, learning_rate=1e-3)


if __name__ == "__main__":
    main()
