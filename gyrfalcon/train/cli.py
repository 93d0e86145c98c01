"""`gyrfalcon train-draft`: argparse only (the training imports happen when it runs)."""

from __future__ import annotations

import argparse


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    from gyrfalcon.cli import add_engine_args

    p = subparsers.add_parser(
        "train-draft", help="train an EAGLE-3 draft on the target's own hidden states",
        description="Regenerate responses to --prompts with the target, capture its hidden states through "
                    "gyrfalcon's forward pass, and train an EAGLE-3 head saved in the speculators layout "
                    "(docs/spec_decode.md, 'Training a draft').")
    add_engine_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--prompts", required=True,
                   help="a .jsonl of {\"prompt\"} / {\"messages\"} lines, or a text file with one prompt per line")
    g.add_argument("--out", required=True, help="the draft's directory (config.json, model.safetensors) and the "
                   "run's checkpoint and captured data")
    g.add_argument("--max-tokens", type=int, default=256, help="the longest regenerated response")
    g.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                   help="sampling temperature of the responses; several values: one response per prompt and value "
                        "(e.g. 0 0.8 0.8: the greedy one and two samples)")
    g.add_argument("--raw-prompts", action="store_true",
                   help="tokenize prompts as they are, without the tokenizer's chat template")
    t = p.add_argument_group("draft")
    t.add_argument("--draft-vocab-size", type=int, default=32000,
                   help="the draft's vocabulary: the most frequent target tokens in the data (capped at the "
                        "target's vocabulary)")
    t.add_argument("--aux-layers", type=int, nargs=3, default=None, metavar="L",
                   help="the target layers whose incoming residual stream the head reads (default 2, N//2, N-3)")
    t.add_argument("--num-speculative-tokens", type=int, default=3, help="k written into the draft's config")
    o = p.add_argument_group("training")
    o.add_argument("--ttt-steps", type=int, default=3, help="unrolled draft steps per position (training-time test)")
    o.add_argument("--epochs", type=int, default=2, help="passes over the data")
    o.add_argument("--batch-size", type=int, default=8, help="sequences per step (padded)")
    o.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak learning rate")
    o.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine", help="after the warmup")
    o.add_argument("--warmup-steps", type=int, default=0, help="linear LR warmup steps")
    o.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's weight decay")
    o.add_argument("--train-seed", type=int, default=0, help="the head's initialization and the data order")
    o.add_argument("--save-every", type=int, default=100, help="a checkpoint every N steps (0: at the end only)")
    o.add_argument("--eval-prompts", default=None,
                   help="held-out prompts (the --prompts formats): after training, print the draft's mean acceptance "
                        "length on them (greedy, k = --num-speculative-tokens, --max-tokens each)")
    o.add_argument("--init-draft", default=None, metavar="DIR",
                   help="start from this draft's weights (the speculators layout, e.g. an earlier train-draft "
                        "output) instead of a fresh head: its vocabulary, aux layers and config are kept, "
                        "--draft-vocab-size is not used")
    o.add_argument("--resume", action="store_true", help="continue the run checkpointed in --out")
    o.add_argument("--stop-after-steps", type=int, default=None,
                   help="stop (checkpoint and export) after this many steps in all; --resume continues the schedule")
    # The engine only regenerates and captures; the rest of the GPU is the training's (activations, the target's
    # logits over a batch, AdamW's state), and the evaluation engine starts after the first one is gone.
    p.set_defaults(func=main, gpu_memory_utilization=0.4)
    return p


def main(args: argparse.Namespace) -> int:
    from gyrfalcon.cli import engine_kwargs
    from gyrfalcon.train.trainer import train_draft

    out = train_draft(args.model, args.prompts, args.out, engine_kwargs(args), max_tokens=args.max_tokens,
                      temperature=args.temperature, raw_prompts=args.raw_prompts,
                      draft_vocab_size=args.draft_vocab_size, aux_layer_ids=args.aux_layers,
                      num_speculative_tokens=args.num_speculative_tokens, resume=args.resume,
                      save_every=args.save_every, stop_after=args.stop_after_steps, eval_prompts=args.eval_prompts,
                      init_draft=args.init_draft, batch_size=args.batch_size,
                      ttt_steps=args.ttt_steps, epochs=args.epochs, lr=args.lr, schedule=args.lr_schedule,
                      warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, seed=args.train_seed)
    print(f"EAGLE-3 draft saved in {out}")
    return 0
