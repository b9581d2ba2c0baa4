"""TRL trainers with their default configs plus ``AmpCallback``: SFT, DPO and KTO train under
amp's plan, and a reference model runs under the same plan as the policy (identical weights,
identical log-probabilities: DPO's margins at step 0 are zero)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from helpers import MATMULS, OpRecorder, recording_backend, tiny_llama  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from amp_compiler.integrations.transformers import AmpCallback  # noqa: E402

aten = torch.ops.aten


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``w0 .. w124`` (no download)."""
    vocab = {f"w{i}": i for i in range(125)} | {"<pad>": 125, "<s>": 126, "</s>": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


# the tokenizer's special tokens: <pad>, <s>, </s> after 125 words
SPECIAL = dict(pad_token_id=125, bos_token_id=126, eos_token_id=127)


def llama(**config) -> LlamaForCausalLM:
    base = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64,
    )  # fmt: skip
    return tiny_llama(seed=0, **{**base, **SPECIAL, **config})


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 125, (n,), generator=g))


def common(tmp_path, steps=2) -> dict:
    """What a job sets beside the defaults: where to write, how long, no reporting."""
    return dict(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, report_to=[],
        save_strategy="no", use_cpu=True, logging_steps=1, disable_tqdm=True,
    )  # fmt: skip


@pytest.mark.parametrize("data", ["text", "prompt-completion"])
def test_sft_with_the_default_config_trains_under_the_plan(tmp_path, data):
    """SFTConfig()'s defaults (bf16=True, gradient checkpointing, which transformers >= 5.25
    runs through a kernel-routing context variable; completion-only loss for prompt-completion
    data) plus the callback: every matmul weight inside the graphs (a 0% limit holds), every
    matmul ran in BF16, no autocast around the model, FP32 parameters, loss falling."""
    rec = OpRecorder()
    callback = AmpCallback(inner=recording_backend(rec), max_uncompiled_share=0.0)  # every matmul weight planned
    config = SFTConfig(**common(tmp_path, steps=6), learning_rate=2e-3)
    assert config.bf16 and config.gradient_checkpointing  # TRL's defaults, untouched
    model = llama()
    autocast = []
    model.register_forward_pre_hook(lambda m, a: autocast.append(torch.is_autocast_enabled("cpu")))
    g = torch.Generator().manual_seed(0)
    if data == "text":
        ds = datasets.Dataset.from_dict({"text": [words(g, 12)] * 8})
    else:
        ds = datasets.Dataset.from_dict({"prompt": [words(g, 6)] * 8, "completion": [words(g, 6)] * 8})
    trainer = SFTTrainer(model=model, args=config, train_dataset=ds, processing_class=tokenizer(), callbacks=[callback])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    matmuls = rec.dtypes_of(*MATMULS)
    assert matmuls and all(d[0] == torch.bfloat16 for d in matmuls)
    norms = rec.dtypes_of(aten.rsqrt, aten.mean)  # RMSNorm
    assert norms and all(d[0] == torch.float32 for d in norms)
    assert autocast and not any(autocast)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert callback.dtype == "bf16" and callback.forwards == ["model"]


def preferences(g: torch.Generator, n=8) -> dict:
    return {"prompt": [words(g, 6) for _ in range(n)], "chosen": [words(g, 5) for _ in range(n)],
            "rejected": [words(g, 5) for _ in range(n)]}  # fmt: skip


@pytest.mark.parametrize("precompute", [False, True], ids=["reference-forward", "precomputed"])
def test_dpo_at_step_zero_sees_no_preference_with_identical_policy_and_reference(tmp_path, precompute):
    """Policy and reference are the same weights: under one plan their log-probs agree, so
    step 0 reports margins within 1e-6 of 0, accuracy 0 and loss log 2 (a reference run in
    another precision counts the rounding as preference signal). Precomputed, TRL's head ran
    as TRL wrote it (FP32, outside the plan) in a process that had not trained yet: margins
    1.3e-4."""
    _dpo_step_zero(tmp_path, llama(), precompute)


def test_dpo_reference_is_checkpointed_as_the_policy_is(tmp_path):
    """GPT-NeoX (parallel residual): with only the policy checkpointed (TRL's default) its
    layers' rounding differed from the reference's, margins -2.6e-6 at step 0; the reference's
    layers are checkpointed like the policy's, so they agree within 1e-6."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        pad_token_id=125, bos_token_id=126, eos_token_id=127,
    )  # fmt: skip
    _dpo_step_zero(tmp_path, GPTNeoXForCausalLM(cfg), False)


def _dpo_step_zero(tmp_path, policy, precompute):
    reference = copy.deepcopy(policy)
    rec = OpRecorder()
    callback = AmpCallback(max_uncompiled_share=0.0, inner=recording_backend(rec))
    config = DPOConfig(**common(tmp_path), precompute_ref_log_probs=precompute)
    g = torch.Generator().manual_seed(1)
    trainer = DPOTrainer(
        model=policy, ref_model=reference, args=config, train_dataset=datasets.Dataset.from_dict(preferences(g)),
        processing_class=tokenizer(), callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    first = trainer.state.log_history[0]
    # margins of 0 alone FP32 would give too: the GEMMs both forwards executed were BF16 (the
    # zero then says the reference ran the policy's plan: in another precision, 1e-4)
    gemms = rec.dtypes_of(torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
    assert gemms and all(d[-2:] == [torch.bfloat16] * 2 for d in gemms)
    assert abs(first["rewards/margins"]) <= 1e-6, first
    assert first["rewards/accuracies"] == 0.0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert "ref_model" in callback.forwards and "forwards under the plan" in first["amp_plan"]
    if precompute:
        assert "precomputed reference log-probs" in callback.forwards


def test_kto_trains_with_its_reference_under_the_plan(tmp_path):
    """KTOConfig()'s defaults plus the callback: the policy and reference forwards both planned."""
    policy = llama()
    g = torch.Generator().manual_seed(2)
    ds = datasets.Dataset.from_dict(
        {"prompt": [words(g, 6) for _ in range(8)], "completion": [words(g, 5) for _ in range(8)],
         "label": [True, False] * 4}
    )  # fmt: skip
    callback = AmpCallback()
    trainer = KTOTrainer(
        model=policy, ref_model=copy.deepcopy(policy), args=KTOConfig(**common(tmp_path)), train_dataset=ds,
        processing_class=tokenizer(), callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    first = trainer.state.log_history[0]
    assert math.isfinite(first["loss"]) and abs(first["rewards/margins"]) <= 1e-6
    assert callback.forwards == ["model", "ref_model"]
    assert all(p.dtype == torch.float32 for p in policy.parameters())


def test_orpo_trains_under_the_plan(tmp_path):
    """ORPOConfig()'s defaults (TRL's experimental ORPO: odds-ratio preference, no reference)
    plus the callback: the policy's matmuls ran in BF16, the loss is finite and falls."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's "experimental API" warning
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    rec = OpRecorder()
    policy = llama()
    callback = AmpCallback(inner=recording_backend(rec))
    config = ORPOConfig(**common(tmp_path, steps=4), learning_rate=2e-3)
    g = torch.Generator().manual_seed(3)
    trainer = ORPOTrainer(
        model=policy, args=config, train_dataset=datasets.Dataset.from_dict(preferences(g)),
        processing_class=tokenizer(), callbacks=[callback],
    )  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    matmuls = rec.dtypes_of(*MATMULS)
    assert matmuls and all(d[0] == torch.bfloat16 for d in matmuls)
    assert callback.forwards == ["model"]
    assert all(p.dtype == torch.float32 for p in policy.parameters())


# a chat template with the {% generation %} markers assistant_only_loss reads
CHAT = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<s> {% generation %}{{ m['content'] }} </s>"
    "{% endgeneration %}{% else %}<s> {{ m['content'] }} </s>{% endif %}{% endfor %}"
)


def test_sft_assistant_only_loss_trains_under_the_plan(tmp_path):
    """SFTConfig(assistant_only_loss=True) on conversations: only the assistant's tokens are
    trained on (the mask TRL builds from the chat template), every matmul in BF16."""
    rec = OpRecorder()
    callback = AmpCallback(inner=recording_backend(rec))
    tok = tokenizer()
    tok.chat_template = CHAT
    g = torch.Generator().manual_seed(4)
    ds = datasets.Dataset.from_dict(
        {"messages": [[{"role": "user", "content": words(g, 6)}, {"role": "assistant", "content": words(g, 6)}]
                      for _ in range(8)]}
    )  # fmt: skip
    config = SFTConfig(**common(tmp_path, steps=6), learning_rate=2e-3, assistant_only_loss=True)
    trainer = SFTTrainer(model=llama(), args=config, train_dataset=ds, processing_class=tok, callbacks=[callback])
    labels = next(iter(trainer.get_train_dataloader()))["labels"]
    trained = labels != -100
    # the assistant's 6 words and its </s>, not the user's turn (6 words, <s>, </s>) before it
    assert trained.sum(1).tolist() == [7] * len(labels), trained.sum(1)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    matmuls = rec.dtypes_of(*MATMULS)
    assert matmuls and all(d[0] == torch.bfloat16 for d in matmuls)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_trl_head_statistics_match_trls_own_function(softcap):
    """The traceable statistics amp traces in place of TRL's ChunkedLogProbFunction equal what
    TRL's Function computes (FP32, every output, temperature, logit scale, soft-capping)."""
    from trl.kernels import ChunkedLogProbFunction

    from amp_compiler.integrations.trl_head import log_prob_statistics

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(24, 16, generator=g), torch.randn(300, 16, generator=g)
    bias, targets = torch.randn(300, generator=g), torch.randint(0, 300, (24,), generator=g)
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    args = (hidden, weight, bias, targets, 0.7, 128, softcap, 1.3, outputs)
    theirs, ours = ChunkedLogProbFunction.apply(*args), log_prob_statistics(*args)
    for a, b in zip(theirs[:4], ours[:4]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert torch.equal(theirs[4], ours[4])
    assert log_prob_statistics(*args[:-1], ("log_probs",))[1:] == (None, None, None, None)


def test_trl_head_runs_in_the_plan_and_its_function_outside_a_compile(tmp_path):
    """Under AmpCallback the LM head's projection (the matmul whose weight has the vocabulary
    as a dimension) executed in BF16 inside the graphs; called eagerly, TRL's own Function
    still runs (the substitution is for tracing only)."""
    from trl.trainer import utils

    rec = OpRecorder()
    callback = AmpCallback(inner=recording_backend(rec), max_uncompiled_share=0.0)
    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_dict({"text": [words(g, 12)] * 8})
    model = llama(intermediate_size=96, num_hidden_layers=1, max_position_embeddings=2048)
    trainer = SFTTrainer(model=model, args=SFTConfig(**common(tmp_path)), train_dataset=ds,
                         processing_class=tokenizer(), callbacks=[callback])  # fmt: skip
    trainer.train()
    head = rec.dtypes_where(MATMULS, lambda shapes: any(128 in s for s in shapes))
    assert len(head) >= 3 * 2 and all(d[0] == torch.bfloat16 for d in head)  # forward and backward, 2 steps
    assert utils._ChunkedLogProbFunction.amp_planned
    real = utils._ChunkedLogProbFunction.wrapped
    ran, apply = [], real.apply
    real.apply = lambda *a: ran.append(1) or apply(*a)
    try:
        utils._ChunkedLogProbFunction.apply(
            torch.randn(4, 64), torch.randn(128, 64), None, torch.zeros(4).long(), 1.0, 64
        )
    finally:
        real.apply = apply
    assert ran == [1]


def test_sft_head_runs_as_amps_fused_head_with_entropy_and_top1(tmp_path):
    """SFT asks TRL's head for log-probs, entropy and top-1. With loss_head="fused" (8192-entry
    vocabulary) amp's blocked head op executed on BF16 hidden states, the logits' statistics
    op never ran (no [tokens, vocabulary] logits), and SFT's logged entropy and token accuracy
    are those of the head left as written."""
    from amp_compiler.loss_head import settings

    vocab = settings().min_vocab
    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_dict(
        {"text": [" ".join(f"w{int(i)}" for i in torch.randint(0, 125, (12,), generator=g))] * 8}
    )
    logs, recs = {}, {}
    for head in ("fused", "off"):
        model = llama(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      max_position_embeddings=2048)  # fmt: skip
        recs[head] = rec = OpRecorder()
        callback = AmpCallback(inner=recording_backend(rec), loss_head=head)
        trainer = SFTTrainer(model=model, args=SFTConfig(**common(tmp_path / head)), train_dataset=ds,
                             processing_class=tokenizer(), callbacks=[callback])  # fmt: skip
        trainer.train()
        logs[head] = [h for h in trainer.state.log_history if "entropy" in h]
    fused_head = recs["fused"].dtypes_of(torch.ops.amp.head_stats)
    assert fused_head and all(d[:2] == [torch.bfloat16, torch.float32] for d in fused_head)
    assert not recs["fused"].dtypes_of(torch.ops.amp.logits_stats)
    assert recs["off"].dtypes_of(torch.ops.amp.logits_stats) and not recs["off"].dtypes_of(torch.ops.amp.head_stats)
    assert len(logs["fused"]) == len(logs["off"]) == 2
    for a, b in zip(logs["fused"], logs["off"]):
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-2)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2)
        assert a["mean_token_accuracy"] == pytest.approx(b["mean_token_accuracy"], abs=0.05)


def test_trl_bench_tool_times_trl_and_amp_side_by_side(capsys):
    """tools/trl_bench.py runs SFT's default config without and with AmpCallback (tiny here)
    and prints both step times and their ratio."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import trl_bench

    argv = ["--vocab", "256", "--d", "32", "--layers", "1", "--seq", "16", "--batch", "2"]
    assert trl_bench.main(argv + ["--steps", "1", "--warmup", "1", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "TRL SFT, vocabulary 256" in out and "ms/step, AmpCallback " in out and out.rstrip().endswith("x")
