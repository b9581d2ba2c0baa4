"""Preference tuning from unpaired labels with TRL's ``KTOTrainer`` and its default ``KTOConfig``
plus ``AmpCallback``.

    python examples/kto.py --steps 50
"""

from __future__ import annotations

import copy

from common import arguments, corpus, llama, preference_data, run_trl, tokenizer
from datasets import Dataset
from trl import KTOConfig, KTOTrainer


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__, argv, steps=50)
    sentences = corpus()
    tok = tokenizer(sentences)
    pairs = preference_data(sentences, 128)
    data = Dataset.from_dict({
        "prompt": pairs["prompt"] * 2,
        "completion": pairs["chosen"] + pairs["rejected"],
        "label": [True] * len(pairs["chosen"]) + [False] * len(pairs["rejected"]),
    })  # fmt: skip

    def make():
        policy = llama(vocab=len(tok))
        return {"model": policy, "ref_model": copy.deepcopy(policy), "train_dataset": data, "processing_class": tok}

    return run_trl("kto", KTOTrainer, KTOConfig, make, args.steps, learning_rate=1e-4)


if __name__ == "__main__":
    main()
