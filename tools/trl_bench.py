"""TRL SFT with its default config, with and without ``AmpCallback``: step time, one process.

    python tools/trl_bench.py                     # a 32k-vocabulary Llama, 4 x 256 tokens
    python tools/trl_bench.py --vocab 151936 --d 896
    python tools/trl_bench.py --loss-head fused  # amp fuses the head whatever the memory

The model is a ``LlamaForCausalLM`` built from a config (2 layers, d=256, no download), the
data random words of a word-level tokenizer over the whole vocabulary. ``SFTConfig``'s
defaults are kept (BF16 through TRL's own autocast, gradient checkpointing, TRL's chunked
loss head); the runs alternate (TRL, amp, TRL, amp, ...) and each reports the median of its
steps after the first ``--warmup`` (compiles). Prints both step times and their ratio,
the best run of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


def tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 3)} | {"<pad>": vocab - 3, "<s>": vocab - 2, "</s>": vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def run(args, data, amp: bool) -> float:
    """One SFT job; the median step time (ms) after the warm-up steps."""
    import torch
    from benchkit.variants import SAME_ALLOCATOR
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from amp_compiler.integrations.transformers import AmpCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.start)

    v = args.vocab
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=v, hidden_size=args.d, intermediate_size=8 * args.d // 3, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.seq,
        pad_token_id=v - 3, bos_token_id=v - 2, eos_token_id=v - 1,
    )  # fmt: skip
    timer = Timer()
    sft = SFTConfig(
        output_dir=tempfile.mkdtemp(), max_steps=args.warmup + args.steps, per_device_train_batch_size=args.batch,
        report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(), logging_steps=10**6,
        disable_tqdm=True, max_length=args.seq,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=LlamaForCausalLM(config),
        args=sft,
        train_dataset=data,
        processing_class=tokenizer(v),
        callbacks=[timer, *([AmpCallback(loss_head=args.loss_head, **SAME_ALLOCATOR)] if amp else [])],
    )
    trainer.train()
    return statistics.median(timer.times[args.warmup :]) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (compiles)")
    p.add_argument("--reps", type=int, default=2, help="runs of each, alternating")
    p.add_argument("--loss-head", default="auto", choices=["auto", "fused", "off", "exact"], help="AmpCallback's")
    p.add_argument("--reuse-memory", action="store_true", help="keep freed CPU memory for reuse in both")
    args = p.parse_args(argv)
    try:
        import datasets
        import torch
    except ImportError as e:
        raise SystemExit(f"{e.name} is needed: pip install -e '.[trl]'") from None
    g = torch.Generator().manual_seed(0)
    text = [
        " ".join(f"w{int(i)}" for i in torch.randint(0, args.vocab - 3, (args.seq - 1,), generator=g))
        for _ in range(args.batch * (args.warmup + args.steps))
    ]
    data = datasets.Dataset.from_dict({"text": text})
    from benchkit.measure import reuse_memory

    reuse_memory(args.reuse_memory)
    times = {False: [], True: []}
    for _ in range(args.reps):
        for amp in (False, True):
            times[amp].append(run(args, data, amp))
    trl, amp = min(times[False]), min(times[True])
    print(
        f"TRL SFT, vocabulary {args.vocab}, d={args.d}, {args.batch} x {args.seq} tokens, torch {torch.__version__}: "
        f"TRL's bf16 {trl:.1f} ms/step, AmpCallback (loss_head={args.loss_head!r}) {amp:.1f} ms/step, "
        f"{amp / trl:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
