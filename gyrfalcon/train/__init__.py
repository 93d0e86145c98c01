"""Draft-model training from gyrfalcon's own hidden states (`gyrfalcon train-draft`, docs/spec_decode.md
"Training a draft"). It sits above the engine like bench/: it drives an offline LLM to regenerate responses and
capture the target's hidden states, then trains an EAGLE-3 head (models/eagle3.py's module) on them.

data.py      prompts -> responses (LLM.generate / chat) -> captured aux + final hidden states per token
vocab.py     the draft vocabulary (the most frequent target tokens) as d2t / t2d
ttt.py       the head's training forward: training-time test over unrolled draft steps, and its loss
trainer.py   DraftTrainer: batches, AdamW, LR schedule, checkpoints / resume, export
export.py    the speculators layout (config.json + model.safetensors)
evaluate.py  mean acceptance length of a draft through the engine
cli.py       the subcommand's flags (argparse only)
"""
