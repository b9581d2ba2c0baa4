"""Workloads: the models, their inputs and losses, by name."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

WORKLOADS = ("lm-explicit", "lm-sdpa", "encoder", "encoder-dropout", "cnn")
HEAD_WORKLOADS = {"lm-head-32k": 32768, "lm-head-128k": 131072}  # vocabulary
HF_WORKLOADS = ("hf-gpt2", "hf-llama", "hf-bert", "hf-qwen2", "hf-neox", "hf-opt", "hf-gemma", "hf-phi")
SIZES = {  # LM dimensions: d, layers, heads, batch, seq, vocab
    "cpu": dict(d=512, layers=4, heads=8, batch=8, seq=128, vocab=2048),
    "tiny": dict(d=64, layers=1, heads=2, batch=2, seq=16, vocab=64),
    "gpt2-small": dict(d=768, layers=12, heads=12, batch=8, seq=1024, vocab=50304),
    "gpt2-medium": dict(d=1024, layers=24, heads=16, batch=4, seq=1024, vocab=50304),
}
HEAD_SIZE = dict(d=256, layers=2, heads=4, batch=4, seq=512)  # the loss-head workloads' model


class Block(nn.Module):
    def __init__(self, d: int, heads: int, explicit: bool):
        super().__init__()
        self.heads, self.explicit = heads, explicit
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.explicit:
            scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            a = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, d, layers, heads, seq, vocab, explicit, **_):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, explicit) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Encoder(nn.Module):
    def __init__(self, d, layers, heads, vocab, classes=10, dropout=0.0, **_):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        return self.head(self.encoder(self.tok(ids)).mean(1))


class CNN(nn.Module):
    def __init__(self, width=32, classes=10, **_):
        super().__init__()
        layers, c = [], 3
        for w in (width, 2 * width, 4 * width):
            layers += [
                nn.Conv2d(c, w, 3, padding=1, bias=False),
                nn.BatchNorm2d(w),
                nn.ReLU(),
                nn.Conv2d(w, w, 3, padding=1, bias=False),
                nn.BatchNorm2d(w),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            c = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def cls_loss(logits, targets):
    return F.cross_entropy(logits.float(), targets)


def build(workload: str, size: dict, device: str):
    """(model, inputs, targets, loss_fn, flops per training step or None)."""
    g = torch.Generator().manual_seed(0)
    if workload in HEAD_WORKLOADS:
        size = {**size, "vocab": HEAD_WORKLOADS[workload]}
    b, t, v = size["batch"], size["seq"], size["vocab"]
    if workload.startswith("lm"):
        model = LM(explicit=workload == "lm-explicit", **size)
        ids = torch.randint(0, v, (b, t), generator=g)
        targets = torch.roll(ids, -1, 1)
        n = sum(p.numel() for n_, p in model.named_parameters() if not n_.startswith(("tok", "pos")))
        flops = 6 * n * b * t + 12 * size["layers"] * size["d"] * t * b * t
        return model, ids.to(device), targets.to(device), lm_loss, flops
    if workload.startswith("encoder"):  # encoder-dropout: PyTorch's default rate, 0.1
        model = Encoder(dropout=0.1 if workload == "encoder-dropout" else 0.0, **size)
        ids = torch.randint(0, v, (b, t), generator=g)
        return model, ids.to(device), torch.randint(0, 10, (b,), generator=g).to(device), cls_loss, None
    if workload == "cnn":
        model = CNN(width=max(16, size["d"] // 16))
        x = torch.randn(2 * b, 3, 64, 64, generator=g)
        return model, x.to(device), torch.randint(0, 10, (2 * b,), generator=g).to(device), cls_loss, None
    if workload in HF_WORKLOADS:
        model = hf_model(workload, size)
        ids = torch.randint(0, v, (b, t), generator=g)
        return model, ids.to(device), torch.roll(ids, -1, 1).to(device), hf_loss, None
    raise SystemExit(f"unknown workload {workload!r}; choose from {WORKLOADS + HF_WORKLOADS}")


# Hugging Face workloads: (model class, config class, what each config sets beyond the
# common sizes). GPT-2 and BERT keep their default dropout 0.1, the others none.
HF_CONFIGS = {
    "hf-gpt2": ("GPT2LMHeadModel", "GPT2Config", lambda d, h: {}),
    "hf-llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        lambda d, h: dict(intermediate_size=8 * d // 3, num_key_value_heads=h),
    ),
    "hf-bert": ("BertForMaskedLM", "BertConfig", lambda d, h: dict(intermediate_size=4 * d)),
    "hf-qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        lambda d, h: dict(intermediate_size=8 * d // 3, num_key_value_heads=max(1, h // 4)),
    ),
    "hf-neox": (
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        lambda d, h: dict(intermediate_size=4 * d, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0),
    ),
    "hf-opt": (
        "OPTForCausalLM",
        "OPTConfig",
        lambda d, h: dict(ffn_dim=4 * d, word_embed_proj_dim=d, dropout=0.0, attention_dropout=0.0),
    ),
    "hf-gemma": (
        "GemmaForCausalLM",
        "GemmaConfig",
        lambda d, h: dict(intermediate_size=4 * d, num_key_value_heads=1, head_dim=d // h),
    ),
    "hf-phi": (
        "PhiForCausalLM",
        "PhiConfig",
        lambda d, h: dict(intermediate_size=4 * d, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    ),
}


def hf_model(workload: str, size: dict) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise SystemExit(f"{workload} needs transformers: pip install -e '.[hf]'") from None
    d, n, h, v, t = size["d"], size["layers"], size["heads"], size["vocab"], size["seq"]
    model_class, config_class, extra = HF_CONFIGS[workload]
    if workload == "hf-gpt2":  # GPT-2's own names for the common sizes
        common = dict(n_embd=d, n_layer=n, n_head=h, vocab_size=v, n_positions=t)
    else:
        common = dict(
            hidden_size=d, num_hidden_layers=n, num_attention_heads=h, vocab_size=v, max_position_embeddings=t
        )
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**common, **extra(d, h))
    return getattr(transformers, model_class)(config)


def hf_loss(output, targets):
    return lm_loss(output.logits, targets)
