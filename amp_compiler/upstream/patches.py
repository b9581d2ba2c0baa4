"""Every attribute amp replaces or reads beyond the public API of transformers, Accelerate and TRL.

The Trainer and TRL integrations switch Accelerate's own mixed precision off and put amp's
plan where TRL's fused head and precomputed reference log-probs would bypass it. Each entry
names the attribute and what breaks without it; tests/test_upstream.py holds one canary per
entry against the installed release, so a release that renames one turns CI red here.
"""

from __future__ import annotations

# "package: owner.attribute" -> what amp does with it
PATCHES: dict[str, str] = {
    "accelerate: Accelerator.native_amp": "set False: Accelerate's autocast stands aside for amp's plan",
    "accelerate: Accelerator.scaler": "set None: Accelerate's GradScaler stands aside for amp's loss scaling",
    "accelerate: Accelerator.prepare_model keeps model._original_forward": (
        "restored as the model's forward: Accelerate's autocast wrapper removed"
    ),
    "transformers: Trainer.callback_handler.callbacks": "finds the Trainer that owns an AmpCallback",
    "transformers: layer._gradient_checkpointing_func": "a reference model checkpointed as the policy is",
    "trl: trl.trainer.utils._ChunkedLogProbFunction": "replaced inside a compile: TRL's fused head under the plan",
    "trl: DPOTrainer._precompute_ref_logps": "wrapped: precomputed reference log-probs under the plan",
    "trl: DPOTrainer._precompute_model_hash": "suffixed with amp's dtype: a cache of FP32 log-probs is not reused",
    "transformers: LRScheduler.step (instance)": "held once after a skipped step, as the Trainer's own fp16 does",
}
