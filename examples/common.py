"""What the examples share: a real English corpus that ships with Python, a word-level
tokenizer built from it, a small Llama built from a config, and a side-by-side timer.

The corpus is ``pydoc_data.topics``: the reference documentation Python's ``help()`` shows
(about 465k characters), so every example runs offline with nothing downloaded.
"""

from __future__ import annotations

import re
import time
from collections import Counter

import torch

VOCAB = 1024  # the most frequent words; the rest map to <unk>
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
WORD = r"[A-Za-z_]+|[0-9]+|[^\sA-Za-z_0-9]"  # a word, a number or one punctuation mark


def corpus() -> list[str]:
    """Sentences of Python's own reference documentation, in a fixed order."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    sentences = re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text))
    return [s for s in sentences if 6 <= len(s.split()) <= 40]


def words(sentence: str) -> list[str]:
    return re.findall(WORD, sentence.lower())


def tokenizer(sentences: list[str]):
    """A word-level ``PreTrainedTokenizerFast`` over the corpus's most frequent words."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    counts = Counter(w for s in sentences for w in words(s))
    vocab = {w: i for i, w in enumerate(SPECIALS)}
    for w, _ in counts.most_common(VOCAB - len(SPECIALS)):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    split = pre_tokenizers.Split(Regex(WORD), "isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), split])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def llama(vocab: int = VOCAB, hidden: int = 128, layers: int = 2, seed: int = 0):
    """A small Llama built from a config (no weights downloaded), FP32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


class Timer:
    """Wall time of a block, for the FP32-vs-amp line each example prints."""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def report(job: str, fp32: tuple[float, float], amp: tuple[float, float], plan) -> None:
    """One comparison: final loss and seconds of each run, and amp's plan summary."""
    (loss32, s32), (loss_amp, s_amp) = fp32, amp
    print(f"{job}: final loss FP32 {loss32:.4f}, amp {loss_amp:.4f} ({(loss_amp / loss32 - 1) * 100:+.2f}%)")
    print(f"{job}: time FP32 {s32:.1f} s, amp {s_amp:.1f} s (first steps include compilation)")
    print(f"{job}: plan {plan.format_summary()}")


def preference_data(sentences: list[str], n: int, seed: int = 0) -> dict:
    """Prompt: a sentence's first words; chosen: the rest as written; rejected: the rest shuffled."""
    g = torch.Generator().manual_seed(seed)
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for s in sentences[:n]:
        w = s.split()
        rest = w[5:]
        shuffled = [rest[i] for i in torch.randperm(len(rest), generator=g)]
        rows["prompt"].append(" ".join(w[:5]))
        rows["chosen"].append(" ".join(rest))
        rows["rejected"].append(" ".join(shuffled))
    return rows


def run_trl(job: str, trainer_cls, config_cls, make_kwargs, steps: int, **config) -> dict:
    """The same TRL job twice from the same weights: its config as TRL ships it with bf16 off
    (FP32), then as shipped (bf16=True) plus ``AmpCallback``. Prints the comparison."""
    from amp_compiler.integrations.transformers import AmpCallback

    results, callback = {}, None
    for name in ("fp32", "amp"):
        base = dict(output_dir=f"out-{job}-{name}", max_steps=steps, per_device_train_batch_size=4,
                    report_to=[], save_strategy="no", use_cpu=True, logging_steps=1, disable_tqdm=True)  # fmt: skip
        if name == "fp32":
            base["bf16"] = False
        callbacks = [callback := AmpCallback()] if name == "amp" else []
        trainer = trainer_cls(args=config_cls(**base, **config), callbacks=callbacks, **make_kwargs())
        with Timer() as t:
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results[name] = (losses[-1], t.seconds)
        results[f"{name}_log"] = trainer.state.log_history
    print(f"{job}: amp ran {callback.dtype} ({callback.reason}); forwards under the plan: {callback.forwards}")
    report(job, results["fp32"], results["amp"], callback.plan())
    return {"results": results, "callback": callback}


def token_blocks(sentences: list[str], tok, seq: int) -> torch.Tensor:
    """The corpus as one token stream (sentences ended by </s>), cut into rows of ``seq``."""
    ids = [i for s in sentences for i in tok(s).input_ids + [tok.eos_token_id]]
    return torch.tensor(ids[: len(ids) // seq * seq]).view(-1, seq)


def arguments(doc: str, argv: list[str] | None, steps: int, dtype: bool = False, **more):
    """An example's command line: ``--steps`` (and ``--dtype`` where the script chooses it)."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=steps)
    if dtype:
        p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    for name, default in more.items():
        p.add_argument(f"--{name}", type=type(default), default=default)
    return p.parse_args(argv)
