"""Model code nobody here wrote: Hugging Face transformers from small configs, one training step.

For each: every matmul/conv/attention executes in BF16, softmax/norms/reductions/loss in
FP32 (forward), loss within 2% of FP32 eager, gradients FP32, finite, cosine >= 0.99.
"""

from __future__ import annotations

import copy

import pytest
import torch

from amp_compiler import AmpBackend

from conftest import OpRecorder, cosine, grads, recording_backend

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten

LOW_FWD = (aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.convolution,
           aten._scaled_dot_product_flash_attention_for_cpu)
FP32_FWD = (aten._softmax, aten._log_softmax, aten.native_layer_norm, aten.mean, aten.pow,
            aten.rsqrt, aten.nll_loss_forward, aten.exp)


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                  resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    return transformers.GPT2LMHeadModel(cfg)


def llama(attn="sdpa"):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=64, vocab_size=100,
                                   attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg)


def bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=100, hidden_dropout_prob=0,
                                  attention_probs_dropout_prob=0, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
CASES = {
    "gpt2": (gpt2, dict(input_ids=ids, labels=ids)),
    "llama_sdpa": (llama, dict(input_ids=ids, labels=ids)),
    "llama_eager_attention": (lambda: llama("eager"), dict(input_ids=ids, labels=ids)),
    "bert_classifier": (bert, dict(input_ids=ids, labels=torch.tensor([0, 2]))),
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
    lm_head = [n for n in plan.nodes if n.module.endswith("lm_head")]
    assert lm_head and lm_head[0].precision == "LOW" and "matmul" in lm_head[0].reason
    assert any(n.precision == "FP32" and n.op.startswith("aten.rsqrt") for n in plan.nodes)
