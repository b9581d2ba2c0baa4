"""Preference tuning with TRL's ``DPOTrainer`` and its default ``DPOConfig`` plus ``AmpCallback``.

    python examples/dpo.py --steps 50

The reference model (a copy of the starting policy) runs under the same precision plan as the
policy, so at step 0 the margins are zero, not rounding noise counted as preference.
"""

from __future__ import annotations

import copy

from common import arguments, corpus, llama, preference_data, run_trl, tokenizer
from datasets import Dataset
from trl import DPOConfig, DPOTrainer


def main(argv: list[str] | None = None) -> dict:
    args = arguments(__doc__, argv, steps=50)
    sentences = corpus()
    tok = tokenizer(sentences)
    data = Dataset.from_dict(preference_data(sentences, 256))

    def make():
        policy = llama(vocab=len(tok))
        return {"model": policy, "ref_model": copy.deepcopy(policy), "train_dataset": data, "processing_class": tok}

    out = run_trl("dpo", DPOTrainer, DPOConfig, make, args.steps, learning_rate=1e-4)
    print(f"dpo: step-0 margins under amp {out['results']['amp_log'][0]['rewards/margins']:.2e} (0: one plan)")
    return out


if __name__ == "__main__":
    main()
