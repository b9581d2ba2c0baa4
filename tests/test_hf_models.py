"""Model code nobody here wrote: Hugging Face transformers from small configs, one training step.

For each: every matmul/conv/attention executes in BF16, softmax/norms/reductions/loss in
FP32 (forward), loss within 2% of FP32 eager, gradients FP32, finite, cosine >= 0.99.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import LOW_EXEC, OpRecorder, cosine, grads, profiled_gemms, recording_backend, tiny_gpt2, tiny_llama

from amp_compiler import AmpBackend

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten

LOW_FWD = LOW_EXEC
FP32_FWD = (
    aten._softmax,
    aten._log_softmax,
    aten.native_layer_norm,
    aten.mean,
    aten.pow,
    aten.rsqrt,
    aten.nll_loss_forward,
    aten.exp,
)


def gpt2():
    return tiny_gpt2(vocab_size=100, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)


def llama(attn="sdpa"):
    return tiny_llama(attn)


def bert():
    cfg = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(cfg)


def vit():
    cfg = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        num_labels=3,
        hidden_dropout_prob=0,
        attention_probs_dropout_prob=0,
    )
    return transformers.ViTForImageClassification(cfg)


def wav2vec2():
    cfg = transformers.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        num_labels=3,
        hidden_dropout=0,
        attention_dropout=0,
        activation_dropout=0,
        feat_proj_dropout=0,
        layerdrop=0,
        mask_time_prob=0,
    )
    return transformers.Wav2Vec2ForSequenceClassification(cfg)


def whisper():
    cfg = transformers.WhisperConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=50,
        max_target_positions=32,
        vocab_size=100,
        dropout=0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(cfg)


def mixtral():
    cfg = transformers.MixtralConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=100,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM(cfg)


ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
CASES = {
    "gpt2": (gpt2, dict(input_ids=ids, labels=ids)),
    "llama_sdpa": (llama, dict(input_ids=ids, labels=ids)),
    "llama_eager_attention": (lambda: llama("eager"), dict(input_ids=ids, labels=ids)),
    "bert_classifier": (bert, dict(input_ids=ids, labels=torch.tensor([0, 2]))),
    "vit": (vit, dict(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([0, 2]))),
    "wav2vec2": (wav2vec2, dict(input_values=torch.randn(2, 1600), labels=torch.tensor([0, 2]))),
    "whisper": (whisper, dict(input_features=torch.randn(2, 16, 100), labels=ids[:, :8], decoder_input_ids=ids[:, :8])),
    "mixtral_moe": (mixtral, dict(input_ids=ids, labels=ids)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hf_model_one_training_step(name):
    factory, kwargs = CASES[name]
    model = factory()
    ref = copy.deepcopy(model)
    ref_loss = ref(**kwargs).loss
    ref_loss.backward()

    rec = OpRecorder()
    backend = AmpBackend(dtype="bf16", inner=recording_backend(rec))
    loss = torch.compile(model, backend=backend)(**kwargs).loss
    loss.backward()

    assert backend.records, "nothing was compiled"
    low = rec.dtypes_of(*LOW_FWD)
    assert low and all(d[:2] == [torch.bfloat16] * 2 for d in low), low
    for packet in FP32_FWD:
        for dtypes in rec.dtypes_of(packet):
            assert all(d == torch.float32 for d in dtypes), (packet, dtypes)
    assert abs(loss.item() - ref_loss.item()) <= 0.02 * abs(ref_loss.item())
    g = grads(model)
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
    assert cosine(g, grads(ref)) >= 0.99
    assert all(p.dtype == torch.float32 for p in model.parameters())
    summary = backend.plan().summary()
    assert summary["nodes"]["LOW"] > 0 and summary["unknown_ops"] == {}


def test_hf_plan_names_modules_and_reasons():
    """explain() on a Llama names each Linear's module and says why it is LOW."""
    from amp_compiler import explain

    plan = explain(llama(), ids)
    lm_head = [n for n in plan.nodes if n.module == "lm_head"]  # the path users write
    assert any(n.module == "model.layers.0.mlp.down_proj" for n in plan.nodes)
    assert lm_head and lm_head[0].precision == "LOW" and "matmul" in lm_head[0].reason
    assert any(n.precision == "FP32" and n.op.startswith("aten.rsqrt") for n in plan.nodes)


def test_hf_resnet_grads_no_worse_than_autocast():
    """A tiny random-init ResNet (BatchNorm, batch 2) is BF16-sensitive: its gradient cosine
    to FP32 is ~0.96 under torch.autocast too. amp must be no worse than autocast."""
    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)
    model = transformers.ResNetForImageClassification(cfg)
    kwargs = dict(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([0, 2]))
    ref, auto = copy.deepcopy(model), copy.deepcopy(model)
    ref(**kwargs).loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto(**kwargs).loss.backward()
    loss = torch.compile(model, backend=AmpBackend(inner="aot_eager"))(**kwargs).loss
    loss.backward()
    ours, theirs = cosine(grads(model), grads(ref)), cosine(grads(auto), grads(ref))
    assert ours >= theirs - 0.02, (ours, theirs)
    assert all(b.dtype == torch.float32 for n, b in model.named_buffers() if "running" in n)


# -- the product as users run it: Inductor generating the code, by the backend and by the step


def _gpt2():
    model = tiny_gpt2(seed=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    # transformers 5 warns once (a graph break) that GPT-2's class name maps to no loss
    model.loss_type = "ForCausalLM"
    return model


def test_a_hugging_face_decoder_runs_its_gemms_in_bf16_under_inductor():
    """A tiny GPT-2 through ``torch.compile(backend=AmpBackend(...))`` with Inductor (the
    default code generator) and through ``make_train_step``: every GEMM the generated code
    ran, forward and backward, took BF16 operands; the loss is FP32 eager's to the 16-bit
    head's rounding; the step trains FP32 master weights. (Without the plan the same GEMMs
    take FP32: the control below.)"""
    from amp_compiler import make_train_step

    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    model, ref = _gpt2(), _gpt2()
    compiled = torch.compile(model, backend=AmpBackend(dtype="bf16"))
    compiled(input_ids=ids, labels=ids).loss.backward()  # compiles
    model.zero_grad()

    def forward_backward(m):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    loss, gemms = profiled_gemms(lambda: forward_backward(compiled))
    assert len(gemms) >= 2 * 3 * 2  # 2 layers' attention and MLP GEMMs, forward and backward
    assert all(d == ["bf16"] * 2 for d in gemms), gemms
    ref_loss, ref_gemms = profiled_gemms(lambda: forward_backward(ref))
    assert ref_gemms and all(d == ["fp32"] * 2 for d in ref_gemms)  # the control: eager FP32
    # measured on this 4.6-nat loss: 3e-5 nats from FP32's, gradient cosine 0.99999
    assert abs(loss.item() - ref_loss.item()) < 1e-3
    assert cosine(grads(model), grads(ref)) > 0.999

    model = _gpt2()
    step = make_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), lambda out: out.loss, dtype="bf16")
    batch = {"input_ids": ids, "labels": ids}
    first = step(batch).loss.item()  # compiles
    results, gemms = profiled_gemms(lambda: [step(batch) for _ in range(3)])
    assert gemms and all(d == ["bf16"] * 2 for d in gemms), gemms
    assert results[-1].loss.item() < first and not any(r.skipped for r in results)
    assert all(p.dtype == torch.float32 for p in model.parameters())
