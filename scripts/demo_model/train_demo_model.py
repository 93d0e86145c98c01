#!/usr/bin/env python3
"""Train gyrfalcon's small built-in code model ("demo-model") from the Python sources on this machine.

No model weights can be downloaded where gyrfalcon is developed, so the package ships a small but real
model: a Qwen3ForCausalLM of ~16M parameters with a byte-level BPE tokenizer, trained for a few minutes
on one GPU on the Python files that happen to be installed (the standard library and site-packages).

Steps (all seeded; the data depends on what is installed on the machine that runs it):
  1. collect *.py files (stdlib + site-packages), skip huge / binary-ish / non-UTF-8 ones, dedupe by
     content hash, split train / held-out BY FILE (hash of the file's label, ~2% held out);
  2. train a byte-level BPE tokenizer (`tokenizers`, vocab 8192, special tokens <|endoftext|>,
     <|im_start|>, <|im_end|>) and wrap it as a transformers PreTrainedTokenizerFast with a ChatML template;
  3. build a Qwen3ForCausalLM and train it with plain PyTorch (AdamW, warmup + cosine, bf16 autocast,
     packed windows of files separated by <|endoftext|>) for a fixed time budget (or --steps);
  4. evaluate held-out loss / perplexity (bf16-rounded weights, fp32 compute);
  5. save a Hugging Face checkpoint (sharded bf16 safetensors, tokenizer, generation_config.json,
     README.md model card, heldout_prompts.json, metrics.json).

Example (GPU; the shipped checkpoint's exact command is in its README.md):
  python3 scripts/demo_model/train_demo_model.py --out gyrfalcon/assets/demo-model
Quick smoke test (CPU, seconds):
  python3 scripts/demo_model/train_demo_model.py --out /tmp/dm --device cpu --steps 20 --max-corpus-mb 4 \
      --tok-train-mb 2 --vocab-size 1024 --hidden-size 64 --layers 2 --heads 2 --kv-heads 1 \
      --head-dim 32 --intermediate-size 128 --seq-len 128 --batch-size 8
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import random
import re
import shlex
import site
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

T0 = time.time()

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

SAMPLE_PROMPTS = [
    "def fib(n):",
    "def is_prime(n):",
    "import os\n\n\ndef read_file(path):",
    "class Stack:\n    def __init__(self):",
    "def flatten(items):",
]


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    # time budget
    p.add_argument("--minutes", type=float, default=4.5, help="training budget in minutes (wall clock)")
    p.add_argument("--total-minutes", type=float, default=7.3,
                   help="hard deadline for the whole script; training is cut short to leave time for eval+save")
    p.add_argument("--steps", type=int, default=None,
                   help="train exactly this many steps (reproducible schedule) instead of a time budget")
    p.add_argument("--reserve-seconds", type=float, default=50.0,
                   help="seconds kept free before --total-minutes for evaluation and saving")
    # data
    p.add_argument("--heldout-permille", type=int, default=20, help="held-out share of files, in 1/1000")
    p.add_argument("--min-file-bytes", type=int, default=200)
    p.add_argument("--max-file-kb", type=int, default=200)
    p.add_argument("--max-line-chars", type=int, default=400)
    p.add_argument("--max-corpus-mb", type=float, default=400.0, help="cap on training text (deterministic subsample)")
    p.add_argument("--tok-train-mb", type=float, default=32.0, help="text used to train the tokenizer")
    p.add_argument("--encode-seconds", type=float, default=75.0,
                   help="time budget for encoding the training text (files in hash order; the rest is dropped)")
    p.add_argument("--roots", nargs="*", default=None, help="override the source roots (default: stdlib + site-packages)")
    # tokenizer / model
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=100000.0)
    # optimisation
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=150)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the training step (default: on with CUDA; falls back to eager on failure)")
    # outputs
    p.add_argument("--num-heldout-prompts", type=int, default=24)
    p.add_argument("--eval-max-tokens", type=int, default=2_000_000, help="cap on held-out tokens evaluated")
    p.add_argument("--max-shard-size", default="15MB")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# 1. data
# ----------------------------------------------------------------------------------------------------------

def source_roots() -> list[tuple[str, Path]]:
    roots: list[tuple[str, Path]] = []
    paths = sysconfig.get_paths()
    roots.append(("stdlib", Path(paths["stdlib"])))
    sp = []
    try:
        sp += list(site.getsitepackages())
    except AttributeError:  # virtualenv's old site module
        pass
    sp += [paths.get("purelib", ""), paths.get("platlib", "")]
    for s in sp:
        if s:
            roots.append(("site-packages", Path(s)))
    out, seen = [], set()
    for tag, r in roots:
        if not r.is_dir():
            continue
        rr = r.resolve()
        if rr in seen:
            continue
        seen.add(rr)
        out.append((tag, rr))
    return out


_CTRL = re.compile(rb"[\x00-\x08\x0b\x0e-\x1f\x7f]")


def _read_candidate(path: Path, args) -> str | None:
    try:
        size = path.stat().st_size
        if size < args.min_file_bytes or size > args.max_file_kb * 1024:
            return None
        data = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in data or _CTRL.search(data):
        return None  # binary-ish: control characters other than \t \n \r \f
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if text.startswith("\ufeff"):
        text = text[1:]
    if max(map(len, text.split("\n"))) > args.max_line_chars:
        return None  # generated tables, base64 blobs, minified code
    if not text.isascii():
        n_non_ascii = len(text) - len(text.encode("ascii", errors="ignore"))
        if n_non_ascii > 0.05 * len(text):
            return None
    return text


def collect_files(args) -> list[tuple[str, str]]:
    """Returns sorted, deduplicated [(label, text)]; label = '<root tag>/<relative path>'."""
    if args.roots:
        roots = [(f"root{i}", Path(r).resolve()) for i, r in enumerate(args.roots)]
    else:
        roots = source_roots()
    log("source roots: " + ", ".join(f"{t}={r}" for t, r in roots))
    root_set = {r for _, r in roots}
    cand: dict[Path, str] = {}
    for tag, root in roots:
        for dp, dns, fns in os.walk(root):
            # prune caches, hidden dirs and other roots nested in this one (site-packages under stdlib)
            dns[:] = sorted(d for d in dns if d != "__pycache__" and not d.startswith(".")
                            and (Path(dp) / d).resolve() not in root_set)
            for fn in fns:
                if not fn.endswith(".py"):
                    continue
                full = Path(dp) / fn
                try:
                    real = full.resolve()
                except OSError:
                    continue
                cand.setdefault(real, f"{tag}/{full.relative_to(root).as_posix()}")
    items = sorted((label, path) for path, label in cand.items())
    log(f"found {len(items)} .py files; reading")
    with ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 4) * 2)) as ex:
        texts = list(ex.map(lambda it: _read_candidate(it[1], args), items))
    files, seen_hash, n_dup, n_skip = [], set(), 0, 0
    for (label, _), text in zip(items, texts):
        if text is None:
            n_skip += 1
            continue
        h = hashlib.sha256(text.encode("utf-8")).digest()
        if h in seen_hash:
            n_dup += 1
            continue
        seen_hash.add(h)
        files.append((label, text))
    log(f"kept {len(files)} files ({sum(len(t) for _, t in files) / 1e6:.1f} M chars); "
        f"skipped {n_skip} (size/binary/encoding), {n_dup} duplicates")
    return files


def label_hash(label: str, salt: str = "") -> int:
    return int.from_bytes(hashlib.sha256((salt + label).encode("utf-8")).digest()[:8], "big")


def split_files(files, args):
    train, held = [], []
    for label, text in files:
        (held if label_hash(label, "split:") % 1000 < args.heldout_permille else train).append((label, text))
    total = sum(len(t) for _, t in train)
    cap = int(args.max_corpus_mb * 1e6)
    if total > cap:
        order = sorted(train, key=lambda lt: label_hash(lt[0], "cap:"))
        kept, acc = [], 0
        for lt in order:
            if acc + len(lt[1]) > cap:
                continue
            kept.append(lt)
            acc += len(lt[1])
        train = sorted(kept)
        log(f"capped training text at {args.max_corpus_mb} MB: {len(train)} files")
    return train, held


# ----------------------------------------------------------------------------------------------------------
# 2. tokenizer
# ----------------------------------------------------------------------------------------------------------

def train_tokenizer(train_files, args):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    budget = int(args.tok_train_mb * 1e6)
    order = sorted(train_files, key=lambda lt: label_hash(lt[0], "tok:"))
    sample, acc = [], 0
    for _, text in order:
        if acc >= budget:
            break
        sample.append(text)
        acc += len(text)
    log(f"training BPE tokenizer (vocab {args.vocab_size}) on {len(sample)} files, {acc / 1e6:.1f} M chars")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    log(f"tokenizer trained: {tok.get_vocab_size()} tokens")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=args.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return tok, hf_tok


_SAFE_SPLIT = re.compile(r"(?<=\S\n)(?=\S)")


def encode_files(tok, files, eos_id, chunk=256, time_budget=None):
    """Encode each file (+ <|endoftext|>) into one uint16 stream. Files are split into pieces at newlines
    between two non-space characters, where the byte-level pre-tokenizer splits anyway (so the ids are
    identical to encoding whole files, but the Rust side gets many short inputs to spread over cores).
    With time_budget (seconds), stops after the chunk that crosses it and says how many files made it."""
    import numpy as np

    t0 = time.time()
    ids_per_file = []
    for i in range(0, len(files), chunk):
        group = files[i:i + chunk]
        pieces, owner = [], []
        for j, (_, text) in enumerate(group):
            for piece in _SAFE_SPLIT.split(text):
                pieces.append(piece)
                owner.append(j)
        encs = tok.encode_batch_fast(pieces, add_special_tokens=False) if hasattr(tok, "encode_batch_fast") \
            else tok.encode_batch(pieces, add_special_tokens=False)
        per = [[] for _ in group]
        for j, e in zip(owner, encs):
            per[j].extend(e.ids)
        ids_per_file.extend(np.asarray(x, dtype=np.uint16) for x in per)
        if time_budget is not None and time.time() - t0 > time_budget and i + chunk < len(files):
            log(f"encoding time budget ({time_budget:.0f} s) reached: using {len(ids_per_file)} of {len(files)} files")
            break
    eos = np.asarray([eos_id], dtype=np.uint16)
    stream = np.concatenate([x for ids in ids_per_file for x in (ids, eos)]) if ids_per_file else np.zeros(0, np.uint16)
    return stream, ids_per_file


# ----------------------------------------------------------------------------------------------------------
# held-out prompts and the parse check (the same procedure is used in tests/test_demo_model.py)
# ----------------------------------------------------------------------------------------------------------

def select_heldout_prompts(held_files, n):
    """Top-level, undecorated functions of held-out files with a short one-to-three-line signature and a
    body of 2-25 lines; one per file, files in hash order. The prompt is the signature, ending at ':'."""
    out = []
    for label, text in sorted(held_files, key=lambda lt: label_hash(lt[0], "prompt:")):
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.split("\n")
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
                continue
            first = node.body[0]
            if first.lineno <= node.lineno:
                continue  # one-liner `def f(): return x`
            sig_lines = lines[node.lineno - 1:first.lineno - 1]
            # drop blank/comment lines between signature and body
            while sig_lines and (not sig_lines[-1].strip() or sig_lines[-1].strip().startswith("#")):
                sig_lines.pop()
            sig = "\n".join(sig_lines).rstrip()
            if not (1 <= len(sig_lines) <= 3) or not sig.endswith(":") or len(sig) > 240:
                continue
            if node.col_offset != 0:
                continue
            body_len = node.end_lineno - first.lineno + 1
            if not (2 <= body_len <= 25):
                continue
            try:
                ast.parse(sig + "\n    pass\n")
            except SyntaxError:
                continue
            ctx_start = max(0, node.lineno - 1 - 15)
            out.append({
                "file": label,
                "name": node.name,
                "lineno": node.lineno,
                "prompt": sig,
                "context": "\n".join(lines[ctx_start:node.lineno - 1]),
                "reference": "\n".join(lines[node.lineno - 1:node.end_lineno]),
            })
            break
        if len(out) >= n:
            break
    return out


def cut_completion(prompt: str, completion: str, finished: bool):
    """prompt + completion, cut where the generated function ends (the first non-blank, non-comment line at
    column 0 after the signature, or the end of text if generation stopped at eos), or else, when
    max_tokens truncated it, at the last complete line. Returns (code, ended); code is None when no
    non-blank line past the signature survives the cut."""
    text = prompt + completion
    ended = finished
    if not finished:
        nl = text.rfind("\n")
        text = text[:nl] if nl >= 0 else ""
    sig_lines = prompt.count("\n") + 1
    lines = text.split("\n")
    for i in range(sig_lines, len(lines)):
        l = lines[i]
        if l.strip() and not l[0].isspace() and not l.startswith("#"):
            lines = lines[:i]
            ended = True
            break
    if len(lines) <= sig_lines or not any(l.strip() for l in lines[sig_lines:]):
        return None, ended
    return "\n".join(lines).rstrip() + "\n", ended


def parses(code: str | None) -> bool:
    if code is None:
        return False
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError):
        return False


def judge_completion(prompt: str, completion: str, finished: bool) -> str:
    """'parsed': the cut code parses with ast.parse. 'truncated-valid': it does not, only because
    max_tokens cut it inside a statement: the function had not ended, Python's incomplete-input check
    (codeop, as the REPL uses) calls it incomplete rather than invalid, and the lines before the unfinished
    statement parse as a function with at least one body line. 'invalid': anything else."""
    import codeop
    import warnings

    code, ended = cut_completion(prompt, completion, finished)
    if code is None:
        return "invalid"
    if parses(code):
        return "parsed"
    if ended:
        return "invalid"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if codeop.compile_command(code, "<completion>", "exec") is not None:
                return "invalid"
    except (SyntaxError, ValueError, OverflowError):
        return "invalid"
    lines = code.rstrip("\n").split("\n")
    sig_lines = prompt.count("\n") + 1
    for k in range(len(lines) - 1, sig_lines, -1):
        if parses("\n".join(lines[:k]) + "\n"):
            return "truncated-valid"
    return "invalid"


# ----------------------------------------------------------------------------------------------------------
# 3. model + training
# ----------------------------------------------------------------------------------------------------------

def build_model(args, vocab_size, eos_id):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        attention_dropout=0.0,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    # transformers 5 keeps rope_theta under rope_parameters; make sure it took
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("rope_theta") != args.rope_theta:
        rp["rope_theta"] = args.rope_theta
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(cfg)
    return model


def lr_at(step, total, args):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    frac = min(1.0, (step - args.warmup_steps) / max(1, total - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def train(model, stream_np, args, device):
    import numpy as np
    import torch
    import torch.nn.functional as F

    V = model.config.vocab_size
    T, B = args.seq_len, args.batch_size
    data = torch.from_numpy(stream_np.astype(np.int32)).to(device)
    n_windows = data.numel() - T - 1
    assert n_windows > 0, "not enough training tokens for one window"
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    offs = torch.arange(T + 1, device=device)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "norm" not in n else no_decay).append(p)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused,
    )
    use_amp = device.type == "cuda"

    def loss_fn(x, y):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
            logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.float().view(-1, V), y.reshape(-1))

    step_fn = loss_fn
    if args.compile:
        try:
            step_fn = torch.compile(loss_fn)
        except Exception as e:  # noqa: BLE001
            log(f"torch.compile unavailable ({e!r}); eager")
            step_fn = loss_fn

    def batch():
        starts = torch.randint(0, n_windows, (B,), device=device, generator=gen)
        w = data[starts[:, None] + offs].long()
        return w[:, :-1], w[:, 1:]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    train_start = time.time()
    deadline = min(train_start + args.minutes * 60, T0 + args.total_minutes * 60 - args.reserve_seconds)
    total = args.steps if args.steps is not None else 10**9
    measure_from, measure_steps = 3, 20  # time steps [3, 23) to size the schedule
    model.train()
    history = []
    step = 0
    t_measure = None
    tok_per_step = B * T
    while step < total:
        lr = lr_at(step, total if total < 10**9 else max(step + 1, args.warmup_steps + 1), args)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch()
        try:
            loss = step_fn(x, y)
        except Exception as e:  # noqa: BLE001 - compile failures surface on the first call
            if step_fn is loss_fn:
                raise
            log(f"compiled step failed ({type(e).__name__}: {str(e)[:200]}); falling back to eager")
            step_fn = loss_fn
            loss = step_fn(x, y)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if args.steps is None:
            if step == measure_from:
                sync()
                t_measure = time.time()
            elif step == measure_from + measure_steps:
                sync()
                dt = (time.time() - t_measure) / measure_steps
                remaining = deadline - time.time()
                total = max(step + 1, step + int(remaining / dt))
                log(f"step time {dt * 1000:.1f} ms ({tok_per_step / dt / 1e6:.2f} M tok/s); "
                    f"schedule fixed at {total} steps ({total * tok_per_step / 1e6:.0f} M tokens)")
        if step % 50 == 0 or step == total:
            l = loss.item()
            history.append({"step": step, "loss": round(l, 4), "lr": lr, "elapsed_s": round(time.time() - train_start, 1)})
            log(f"step {step}/{total if total < 10**9 else '?'} loss {l:.4f} lr {lr:.2e} gnorm {float(gnorm):.2f}")
        if time.time() > deadline + 5 and args.steps is None:
            log(f"deadline reached at step {step} (schedule planned {total}); stopping")
            break
    sync()
    train_s = time.time() - train_start
    return {"steps": step, "planned_steps": total, "train_seconds": round(train_s, 1),
            "tokens_seen": step * tok_per_step, "tokens_per_step": tok_per_step, "history": history}


def evaluate(model, held_ids, args, device, eos_id):
    """Mean next-token loss over the held-out files (each file + <|endoftext|> packed into one stream, cut
    into non-overlapping windows of seq_len; every token after the first of a window is predicted)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    eos = np.asarray([eos_id], dtype=np.int64)
    stream = np.concatenate([x for ids in held_ids for x in (ids.astype(np.int64), eos)])
    stream = stream[: args.eval_max_tokens]
    T = args.seq_len
    model.eval()
    tot_loss, tot_n = 0.0, 0
    with torch.no_grad():
        windows = [stream[i:i + T] for i in range(0, len(stream) - 1, T)]
        windows = [w for w in windows if len(w) >= 2]
        bs = 32
        for i in range(0, len(windows), bs):
            group = windows[i:i + bs]
            L = max(len(w) for w in group)
            x = torch.full((len(group), L), eos_id, dtype=torch.long)
            m = torch.zeros((len(group), L), dtype=torch.bool)
            for j, w in enumerate(group):
                x[j, :len(w)] = torch.from_numpy(w)
                m[j, :len(w)] = True
            x, m = x.to(device), m.to(device)
            logits = model(input_ids=x, use_cache=False).logits.float()
            lo = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
            mm = m[:, 1:].reshape(-1)
            tot_loss += lo[mm].sum().item()
            tot_n += int(mm.sum().item())
    loss = tot_loss / max(1, tot_n)
    return {"heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 3), "heldout_tokens": tot_n,
            "heldout_loss_sum_nats": tot_loss}


def greedy_batch(model, hf_tok, prompts, max_new_tokens, device):
    """Batched greedy generation with left padding. Returns [(completion_text, token_ids, finished)]."""
    import torch

    eos_id = hf_tok.eos_token_id
    enc = [hf_tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    L = max(len(e) for e in enc)
    x = torch.full((len(enc), L), eos_id, dtype=torch.long)
    m = torch.zeros((len(enc), L), dtype=torch.long)
    for i, e in enumerate(enc):
        x[i, L - len(e):] = torch.tensor(e)
        m[i, L - len(e):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=x.to(device), attention_mask=m.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_id, pad_token_id=eos_id)
    res = []
    for i in range(len(enc)):
        ids = out[i, L:].tolist()
        finished = eos_id in ids
        if finished:
            ids = ids[: ids.index(eos_id) + 1]
        res.append((hf_tok.decode([t for t in ids if t != eos_id]), ids, finished))
    return res


# ----------------------------------------------------------------------------------------------------------
# 5. save
# ----------------------------------------------------------------------------------------------------------

def fmt_bytes(n):
    return f"{n / 2**20:.1f} MiB"


def write_model_card(out: Path, meta: dict):
    m = meta
    samples = "\n\n".join(
        f"Prompt `{json.dumps(s['prompt'])}`:\n\n```python\n{s['prompt']}{s['completion']}\n```" for s in m["samples"]
    )
    card = f"""---
library_name: transformers
license: other
tags: [code, python, tiny, gyrfalcon, demo]
pipeline_tag: text-generation
---

# gyrfalcon demo-model

A small Python code model shipped inside the gyrfalcon package (`gyrfalcon/assets/demo-model`), so that
tests, examples and benchmarks can run a real, trained model where no model can be downloaded. It is a
Hugging Face `Qwen3ForCausalLM` checkpoint: load it with `AutoModelForCausalLM.from_pretrained` /
`AutoTokenizer.from_pretrained`, or with `gyrfalcon.LLM(model=...)`.

It completes Python code. It is far too small to be useful for anything else; it has seen no chat
data (the ChatML template exists so that chat code paths can be exercised, not because it can chat).

## Model

| | |
|---|---|
| architecture | Qwen3ForCausalLM (`model_type: qwen3`) |
| parameters | {m['params']:,} ({m['params'] / 1e6:.1f} M; embeddings tied with the LM head) |
| layers / hidden / intermediate | {m['args']['layers']} / {m['args']['hidden_size']} / {m['args']['intermediate_size']} |
| attention | {m['args']['heads']} query heads, {m['args']['kv_heads']} KV heads, head_dim {m['args']['head_dim']}, per-head q/k RMSNorm, RoPE theta {m['args']['rope_theta']:g} |
| context | trained on {m['args']['seq_len']}-token windows; max_position_embeddings {m['args']['max_position_embeddings']} |
| weights | bf16 safetensors, {m['n_shards']} shard(s), {fmt_bytes(m['weights_bytes'])} |
| tokenizer | byte-level BPE, vocab {m['vocab_size']} (`tokenizers`), special tokens `<|endoftext|>` (id {m['eos_id']}, eos and pad), `<|im_start|>`, `<|im_end|>`; no BOS; ChatML chat template |

## Data

All `*.py` files found on the training machine in the Python standard library and site-packages
({', '.join(m['roots'])}), skipping files under {m['args']['min_file_bytes']} B or over {m['args']['max_file_kb']} KiB, non-UTF-8
files, files with lines over {m['args']['max_line_chars']} characters, >5% non-ASCII or non-printable characters;
deduplicated by content hash. Split by file on a hash of the file's path: {m['args']['heldout_permille'] / 10:g}% held out.

| | files | characters | tokens |
|---|---|---|---|
| train | {m['data']['train_files']:,} | {m['data']['train_chars']:,} | {m['data']['train_tokens']:,} |
| held-out | {m['data']['heldout_files']:,} | {m['data']['heldout_chars']:,} | {m['data']['heldout_tokens']:,} |

Top sources of training text (by characters): {m['data']['top_sources']}.
Files are packed into one stream separated by `<|endoftext|>`; training samples random windows of it.
The tokenizer was trained on {m['data']['tok_train_chars'] / 1e6:.1f} M characters of the training files.

## Training

{m['train']['steps']} steps of AdamW (betas 0.9/0.95, weight decay {m['args']['weight_decay']}, peak lr {m['args']['lr']:g}, {m['args']['warmup_steps']} warmup steps,
cosine to {m['args']['min_lr_ratio']:g}x, grad clip {m['args']['grad_clip']}), batch {m['args']['batch_size']} x {m['args']['seq_len']} tokens, bf16 autocast with fp32
master weights, on {m['device_name']} in {m['train']['train_seconds']:.0f} s ({m['train']['tokens_seen'] / 1e6:.0f} M tokens,
{m['train']['tokens_seen'] / max(1, m['data']['train_tokens']):.1f} epochs). Whole script: {m['total_seconds']:.0f} s. Seed {m['args']['seed']}.
Software: Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, tokenizers {m['tokenizers']}.

Command:

```
{m['command']}
```

(It ran with `--out {m['out_dir_used']}` on the training machine; the files were copied here.)
The run used a time budget; to repeat its schedule exactly add `--steps {m['train']['steps']}` (the data
depends on the Python packages installed where it runs).

## Evaluation

Held-out files ({m['eval']['heldout_tokens']:,} predicted tokens, {m['args']['seq_len']}-token windows, weights rounded to bf16, fp32 compute):

| | |
|---|---|
| loss | {m['eval']['heldout_loss']:.4f} nats/token |
| perplexity | {m['eval']['heldout_ppl']:.2f} |
| bits per byte | {m['eval']['heldout_bpb']:.3f} |
| final training loss (last 50 steps, bf16) | {m['train']['history'][-1]['loss'] if m['train']['history'] else float('nan'):.4f} |

`heldout_prompts.json` holds {m['n_prompts']} function signatures from held-out files (top-level, undecorated,
one per file, body of 2-25 lines). Greedy completions of {m['parse_eval']['max_new_tokens']} tokens, cut where the function ends
(or at the last complete line), parse with `ast.parse` in {m['parse_eval']['parsed']} of {m['parse_eval']['total']}
cases ({m['parse_eval']['rate'] * 100:.0f}%); counting also completions that max_tokens cut inside a statement but
that are valid so far (Python's incomplete-input check, as the REPL's), {m['parse_eval'].get('valid', '?')} of {m['parse_eval']['total']}.
Measured after training on the training device, batched; `tests/test_demo_model.py` measures it again on CPU.

## Greedy samples

{samples}
"""
    (out / "README.md").write_text(card)


def main(argv=None):
    args = parse_args(argv)
    random.seed(args.seed)
    import numpy as np
    import torch
    import tokenizers
    import transformers

    np.random.seed(args.seed)
    if args.compile is None:
        args.compile = torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")
    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    log(f"python {platform.python_version()} torch {torch.__version__} transformers {transformers.__version__} "
        f"tokenizers {tokenizers.__version__} device {device} ({device_name})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # 1. data
    files = collect_files(args)
    train_files, held_files = split_files(files, args)
    log(f"train {len(train_files)} files / held-out {len(held_files)} files")

    # 2. tokenizer
    tok, hf_tok = train_tokenizer(train_files, args)
    eos_id = tok.token_to_id("<|endoftext|>")
    _, held_ids = encode_files(tok, held_files, eos_id)
    train_files = sorted(train_files, key=lambda lt: label_hash(lt[0], "order:"))
    t_enc = time.time()
    stream, train_ids = encode_files(tok, train_files, eos_id, time_budget=args.encode_seconds)
    train_files = train_files[:len(train_ids)]
    enc_rate = sum(len(t) for _, t in train_files) / max(1e-9, time.time() - t_enc) / 1e6
    log(f"encoding rate {enc_rate:.1f} M chars/s")
    log(f"encoded: {len(stream):,} training tokens ({sum(len(t) for _, t in train_files) / max(1, len(stream)):.2f} chars/token), "
        f"{sum(len(x) for x in held_ids):,} held-out tokens")

    sources: dict[str, int] = {}
    for label, text in train_files:
        parts = label.split("/")
        key = parts[0] if parts[0] == "stdlib" else "/".join(parts[:2])
        sources[key] = sources.get(key, 0) + len(text)
    top = sorted(sources.items(), key=lambda kv: -kv[1])[:12]
    total_chars = sum(sources.values())
    top_sources = ", ".join(f"{k.split('/')[-1]} {v / total_chars * 100:.0f}%" for k, v in top)

    # 3. model + training
    model = build_model(args, tok.get_vocab_size(), eos_id).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters")
    tr = train(model, stream, args, device)
    log(f"trained {tr['steps']} steps in {tr['train_seconds']} s ({tr['tokens_seen'] / 1e6:.0f} M tokens)")

    # round to the shipped precision, evaluate in fp32
    model = model.to(torch.bfloat16).to(torch.float32)
    model.eval()
    ev = evaluate(model, held_ids, args, device, eos_id)
    held_chars = sum(len(t) for _, t in held_files)
    held_bytes = sum(len(t.encode("utf-8")) for _, t in held_files) + len(held_files)
    n_eval = min(args.eval_max_tokens, sum(len(x) + 1 for x in held_ids))
    ev["heldout_bpb"] = round(ev["heldout_loss_sum_nats"] / math.log(2) / held_bytes
                              * (sum(len(x) + 1 for x in held_ids) / max(1, n_eval)), 4)
    log(f"held-out loss {ev['heldout_loss']:.4f} ppl {ev['heldout_ppl']:.2f} bpb {ev['heldout_bpb']:.3f}")

    # samples + held-out prompts + parse check
    prompts = select_heldout_prompts(held_files, args.num_heldout_prompts)
    log(f"selected {len(prompts)} held-out prompts")
    samples = []
    for p, (c, _, _) in zip(SAMPLE_PROMPTS, greedy_batch(model, hf_tok, SAMPLE_PROMPTS, 64, device)):
        samples.append({"prompt": p, "completion": c})
    pe_tokens = 128
    details = []
    if prompts:
        gens = greedy_batch(model, hf_tok, [p["prompt"] for p in prompts], pe_tokens, device)
        for p, (c, ids, fin) in zip(prompts, gens):
            details.append({"name": p["name"], "verdict": judge_completion(p["prompt"], c, fin), "finished": fin})
    parsed = sum(d["verdict"] == "parsed" for d in details)
    valid = sum(d["verdict"] != "invalid" for d in details)
    parse_eval = {"max_new_tokens": pe_tokens, "parsed": parsed, "valid": valid, "total": len(prompts),
                  "rate": round(parsed / max(1, len(prompts)), 3),
                  "valid_rate": round(valid / max(1, len(prompts)), 3), "details": details}
    log(f"held-out completions (batched greedy, {device.type}): {parsed}/{len(prompts)} parse, "
        f"{valid}/{len(prompts)} parse or are valid-but-truncated")

    # 5. save
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size=args.max_shard_size)
    hf_tok.save_pretrained(out)
    gc = transformers.GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None,
                                       do_sample=False, max_new_tokens=128)
    gc.save_pretrained(out)
    (out / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    shards = sorted(out.glob("*.safetensors"))
    weights_bytes = sum(f.stat().st_size for f in shards)

    argv_list = sys.argv[1:] if argv is None else list(argv)
    shown = list(argv_list)
    for i, a in enumerate(shown):  # show the destination the checkpoint is committed to
        if a == "--out" and i + 1 < len(shown):
            shown[i + 1] = "gyrfalcon/assets/demo-model"
        elif a.startswith("--out="):
            shown[i] = "--out=gyrfalcon/assets/demo-model"
    meta = {
        "params": n_params,
        "vocab_size": tok.get_vocab_size(),
        "eos_id": eos_id,
        "n_shards": len(shards),
        "weights_bytes": weights_bytes,
        "args": vars(args),
        "roots": [f"{t}: {r}" for t, r in (source_roots() if not args.roots else [("root", r) for r in args.roots])],
        "data": {
            "train_files": len(train_files),
            "train_chars": sum(len(t) for _, t in train_files),
            "train_tokens": int(len(stream)),
            "heldout_files": len(held_files),
            "heldout_chars": held_chars,
            "heldout_tokens": int(sum(len(x) + 1 for x in held_ids)),
            "tok_train_chars": min(int(args.tok_train_mb * 1e6), sum(len(t) for _, t in train_files)),
            "top_sources": top_sources,
        },
        "train": tr,
        "eval": ev,
        "parse_eval": parse_eval,
        "n_prompts": len(prompts),
        "samples": samples,
        "device_name": device_name,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "command": "python3 scripts/demo_model/train_demo_model.py " + shlex.join(shown),
        "out_dir_used": str(out),
    }
    meta["total_seconds"] = round(time.time() - T0, 1)
    write_model_card(out, meta)
    metrics = {k: meta[k] for k in ("params", "vocab_size", "eos_id", "n_shards", "weights_bytes", "data", "eval",
                                    "parse_eval", "device_name", "python", "torch", "transformers", "tokenizers",
                                    "command", "total_seconds")}
    metrics["train"] = {k: v for k, v in tr.items()}
    metrics["args"] = vars(args)
    metrics["samples"] = samples
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(f"saved {out}: {len(list(out.iterdir()))} files, {fmt_bytes(total)}; largest "
        f"{max((f.stat().st_size for f in out.iterdir() if f.is_file()), default=0) / 2**20:.1f} MiB")
    log(f"done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
