"""Second training stage of the demo model: whole top-level functions, each ended by <|endoftext|>.

The first stage (scripts/train_demo_model.py) trains on random 1024-token windows of whole files, where
a function is followed by more of its file. Completing a signature, such a model writes the long
docstrings of library code and runs past max_tokens without ever ending the function. This stage
continues training on documents that are single top-level functions of the training files (the same
file-level train / held-out split, by a hash of each file's label: no held-out file is read), each
followed by <|endoftext|>, so that the model learns where a function stops.

Runs on a CPU in minutes (the model is ~16M parameters); seeded. The data are the Python files of the
machine it runs on (stdlib + site-packages), filtered as in the first stage.

  python3 scripts/finetune_demo_functions.py --model gyrfalcon/assets/demo-model --out /tmp/dm-ft --minutes 12
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib.util
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

_spec = importlib.util.spec_from_file_location("train_demo_model", Path(__file__).with_name("train_demo_model.py"))
T = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(T)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="first-stage checkpoint directory")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--minutes", type=float, default=12.0, help="training budget (wall clock)")
    p.add_argument("--steps", type=int, default=None, help="exactly this many steps instead of --minutes")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--min-body-lines", type=int, default=2)
    p.add_argument("--max-body-lines", type=int, default=40)
    p.add_argument("--max-function-tokens", type=int, default=256)
    p.add_argument("--strip-docstrings", type=float, default=0.0,
                   help="probability of removing a function's docstring from its document (seeded)")
    p.add_argument("--self-contained-repeat", type=int, default=1,
                   help="include each self-contained function (its names are its arguments, its locals, "
                        "builtins and itself) this many times: the closest a library corpus comes to "
                        "standalone textbook functions, which is what a bare signature completes into")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--eval-max-tokens", type=int, default=128, help="max_new_tokens of the parse check")
    p.add_argument("--eval-tokens", type=int, default=100_000, help="held-out tokens for the loss check")
    return p.parse_args(argv)


def function_documents(files, exclude_names: set) -> list[str]:
    """Top-level (undecorated or decorated) function definitions of `files`, source text as written."""
    docs = []
    for _, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.split("\n")
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name in exclude_names:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            docs.append((node, "\n".join(lines[start - 1:node.end_lineno])))
    return docs


def self_contained(node) -> bool:
    """Whether every name the function reads is bound inside it (arguments, assignments, imports, nested
    definitions, except-clause names), a builtin, or the function itself (recursion)."""
    bound = {node.name}
    loads = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loads if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not node:
            bound.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
    return not (loads - bound - _BUILTINS)


_BUILTINS = set(dir(builtins))


def strip_docstring(node, text: str) -> str:
    """`text` (the function's source, from its first decorator or `def` line) without its docstring, when
    the docstring is the first statement, is followed by more code, and sits on lines of its own; else
    `text` unchanged."""
    body = node.body
    if len(body) < 2 or not (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                             and isinstance(body[0].value.value, str)):
        return text
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = text.split("\n")
    first, last = body[0].lineno - start, body[0].end_lineno - start
    if lines[first][:body[0].col_offset].strip() or lines[last][body[0].end_col_offset:].strip():
        return text  # shares a line with the signature or with code
    return "\n".join(lines[:first] + lines[last + 1:])


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    src = Path(args.model)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    eos = tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    prompts = json.loads((src / "heldout_prompts.json").read_text())

    # Data: the first stage's file filters and split (its defaults), training files only.
    targs = T.parse_args(["--out", str(args.out)])
    files = T.collect_files(targs)
    train_files, held_files = T.split_files(files, targs)
    held_labels = {p["file"] for p in prompts}
    train_files = [(lab, txt) for lab, txt in train_files if lab not in held_labels]
    # Belt and braces: no function named like a held-out prompt's (a copy under another path).
    exclude = {p["name"] for p in prompts}
    funcs = function_documents(train_files, exclude)
    docs = []
    # Library functions nearly all open with a docstring; a model this small, completing a signature,
    # then writes docstrings it does not end. Some documents without theirs teach it that code may
    # follow the signature directly. Own generator: the shuffle below stays as without the option.
    strip_rng = random.Random(args.seed + 1)
    n_stripped = n_self = 0
    for node, text in funcs:
        first = node.body[0]
        body = node.end_lineno - first.lineno + 1
        if args.min_body_lines <= body <= args.max_body_lines:
            if args.strip_docstrings and strip_rng.random() < args.strip_docstrings:
                stripped = strip_docstring(node, text)
                n_stripped += stripped != text
                text = stripped
            docs.append(text)
            if args.self_contained_repeat > 1 and self_contained(node):
                n_self += 1
                docs.extend([text] * (args.self_contained_repeat - 1))
    random.shuffle(docs)
    ids = []
    n_docs = n_long = 0
    for t in tok([text + "\n" for text in docs], add_special_tokens=False)["input_ids"]:
        if len(t) > args.max_function_tokens:
            n_long += 1
            continue
        ids.extend(t + [eos])
        n_docs += 1
    data = torch.tensor(np.asarray(ids, dtype=np.int64))
    T.log(f"{n_stripped} of {len(docs)} function documents without their docstring; {n_self} self-contained "
          f"functions repeated {args.self_contained_repeat}x")
    T.log(f"{len(train_files)} training files -> {len(funcs)} top-level functions; {n_docs} documents "
          f"({len(data) / 1e6:.2f} M tokens; {n_long} over {args.max_function_tokens} tokens dropped)")

    # Whole-file modeling before / after, on this machine's held-out files (the first eval_tokens tokens
    # in label-hash order), as the first stage measures it: the cost of this stage on its own task.
    held_ids, n_held = [], 0
    for lab, txt in sorted(held_files, key=lambda lt: T.label_hash(lt[0], "eval:")):
        if n_held >= args.eval_tokens:
            break
        held_ids.append(np.asarray(tok(txt, add_special_tokens=False)["input_ids"], dtype=np.int64))
        n_held += len(held_ids[-1])
    eargs = argparse.Namespace(seq_len=1024, eval_max_tokens=args.eval_tokens)
    before = T.evaluate(model, held_ids, eargs, torch.device("cpu"), eos)
    T.log(f"held-out loss before: {before['heldout_loss']} over {before['heldout_tokens']} tokens")

    # Train: AdamW, linear warmup then cosine to 10%, fp32 on the CPU.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    L, B = args.seq_len, args.batch_size
    n_windows = len(data) - L - 1
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    deadline = time.time() + args.minutes * 60
    # With a time budget the schedule needs a length: measure the first steps, then fix it.
    total = args.steps or 10**9
    step, hist, t_train = 0, [], time.time()
    while step < total and (args.steps or time.time() < deadline):
        if step == 5 and not args.steps:
            per = (time.time() - t_train) / 5
            total = max(6, int((deadline - t_train) / per))
        lr_scale = min(1.0, (step + 1) / args.warmup_steps)
        if total < 10**9 and step >= args.warmup_steps:
            frac = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
            lr_scale = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_scale
        starts = torch.randint(0, n_windows, (B,), generator=gen)
        w = data[starts[:, None] + torch.arange(L + 1)]
        logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            hist.append({"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - t_train, 1)})
            T.log(f"step {step}/{total if total < 10**9 else '?'} loss {loss.item():.4f}")
    train_s = time.time() - t_train
    model.eval()

    after = T.evaluate(model, held_ids, eargs, torch.device("cpu"), eos)
    T.log(f"held-out loss after: {after['heldout_loss']} (before {before['heldout_loss']})")

    # Held-out parse check, as in the first stage (greedy, batched, fp32).
    comps = T.greedy_batch(model, tok, [p["prompt"] for p in prompts], args.eval_max_tokens, torch.device("cpu"))
    verdicts = [T.judge_completion(p["prompt"], c, fin) for p, (c, _, fin) in zip(prompts, comps)]
    parsed = verdicts.count("parsed")
    T.log(f"held-out parse: {parsed}/{len(prompts)}; verdicts {verdicts}")

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="15MB")
    meta = json.loads((out / "metrics.json").read_text())
    meta["finetune_functions"] = {
        "command": "python3 scripts/finetune_demo_functions.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args), "train_files": len(train_files), "functions": len(funcs), "documents": n_docs,
        "docstrings_stripped": n_stripped, "self_contained_functions": n_self,
        "heldout_files_here": {"before": before, "after": after},
        "tokens": int(len(data)), "steps": step, "tokens_seen": step * B * L, "train_seconds": round(train_s, 1),
        "history": hist, "device": "cpu", "threads": torch.get_num_threads(),
        "parse_eval": {"max_new_tokens": args.eval_max_tokens, "parsed": parsed, "total": len(prompts),
                       "verdicts": verdicts},
        "total_seconds": round(time.time() - t0, 1),
    }
    (out / "metrics.json").write_text(json.dumps(meta, indent=1))
    T.log(f"wrote {out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
