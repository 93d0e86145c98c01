"""Second training stage of the demo model: whole top-level functions, each ended by <|endoftext|>.

The first stage (scripts/demo_model/train_demo_model.py) trains on random 1024-token windows of whole files, where
a function is followed by more of its file. Completing a signature, such a model writes the long
docstrings of library code and runs past max_tokens without ever ending the function. This stage
continues training on documents that are single top-level functions of the training files (the same
file-level train / held-out split, by a hash of each file's label: no held-out file is read), each
followed by <|endoftext|>, so that the model learns where a function stops.

Runs on a CPU in minutes (the model is ~16M parameters; fp32) or on a GPU (bf16 autocast with fp32
master weights, as the first stage); seeded. The data are the Python files of the machine it runs on
(stdlib + site-packages), filtered as in the first stage. The held-out loss and the parse check of the
held-out prompts run on the training device; the output folder's README.md (the model card) gets a
"Second stage" section and greedy samples of the result.

  python3 scripts/demo_model/finetune_demo_functions.py --model gyrfalcon/assets/demo-model --out /tmp/dm-ft --minutes 12
  python3 scripts/demo_model/finetune_demo_functions.py --model /tmp/dm-stage1 --out /tmp/dm-stage2 --device cuda \
      --epochs 3 --minutes 1.5 --batch-size 64 --strip-docstrings 0.5 --file-mix 0.5
Evaluate a checkpoint on this machine's held-out files and prompts without training (what the
fine-tuning measures before / after; CPU, fp32 compute on the checkpoint's bf16 weights):
  python3 scripts/demo_model/finetune_demo_functions.py --model gyrfalcon/assets/demo-model --eval-only --device cpu
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import random
import shlex
import shutil
import sys
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

_spec = importlib.util.spec_from_file_location("train_demo_model", Path(__file__).with_name("train_demo_model.py"))
T = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(T)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="first-stage checkpoint directory")
    p.add_argument("--out", default=None, help="output checkpoint directory (required unless --eval-only)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--minutes", type=float, default=12.0,
                   help="training budget (wall clock); with --epochs, a cap on that schedule")
    p.add_argument("--steps", type=int, default=None, help="exactly this many steps instead of --minutes")
    p.add_argument("--epochs", type=float, default=None,
                   help="this many passes over the function documents (steps = epochs x tokens / (batch x "
                        "seq-len)), shortened after the first steps if that schedule would not fit --minutes")
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
    p.add_argument("--file-mix", type=float, default=0.0,
                   help="fraction of each batch's rows drawn as windows of whole training files (the first "
                        "stage's task) instead of function documents: replay against forgetting it (on CPU "
                        "1000 function-only steps took the whole-file held-out loss from 1.017 to 1.320)")
    p.add_argument("--file-mix-chars", type=float, default=40e6,
                   help="characters of training files (a seeded sample of whole files) tokenized for --file-mix")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--workers", type=int, default=None,
                   help="processes that parse the training files (default: the CPU count, at most 16); "
                        "the documents do not depend on it")
    p.add_argument("--roots", nargs="*", default=None,
                   help="source roots instead of stdlib + site-packages (as the first stage's --roots)")
    p.add_argument("--log-every", type=int, default=10, help="log (and record) the loss every this many steps")
    p.add_argument("--eval-max-tokens", type=int, default=128, help="max_new_tokens of the parse check")
    p.add_argument("--eval-tokens", type=int, default=100_000, help="held-out tokens for the loss check")
    p.add_argument("--eval-only", action="store_true",
                   help="train nothing: the held-out loss, the parse check and greedy samples of --model "
                        "(its bf16 weights, fp32 compute), printed as one JSON line 'EVAL {...}'")
    p.add_argument("--eval-json", default=None, help="with --eval-only: also write the results here")
    args = p.parse_args(argv)
    if args.out is None and not args.eval_only:
        p.error("--out is required unless --eval-only")
    return args


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


def _file_function_records(text, exclude_names, min_body, max_body, want_self):
    """One file's share of the documents: (number of top-level functions, [(text, text without its
    docstring, self-contained?)] of those whose body has min_body..max_body lines), in file order."""
    funcs = function_documents([("", text)], exclude_names)
    recs = []
    for node, doc in funcs:
        body = node.end_lineno - node.body[0].lineno + 1
        if min_body <= body <= max_body:
            recs.append((doc, strip_docstring(node, doc), bool(want_self and self_contained(node))))
    return len(funcs), recs


_FORK_FILES = None  # the files the forked parse workers read (inherited, not pickled)


def _records_chunk(job):
    lo, hi, exclude_names, min_body, max_body, want_self = job
    return [_file_function_records(_FORK_FILES[i][1], exclude_names, min_body, max_body, want_self)
            for i in range(lo, hi)]


def function_records(files, exclude_names: set, min_body: int, max_body: int, want_self: bool = False,
                     workers: int = 1):
    """What the documents are made of, in the order of `files` (so they do not depend on `workers`):
    (number of top-level functions, [(text, text without its docstring, self-contained?)] of those with a
    body of min_body..max_body lines). ast.parse of a few hundred MB of code takes minutes on one core:
    with workers > 1 the files are parsed in forked processes."""
    per_file = None
    if workers > 1 and len(files) > 1 and "fork" in multiprocessing.get_all_start_methods():
        global _FORK_FILES
        n_chunks = min(len(files), workers * 8)
        bounds = [len(files) * k // n_chunks for k in range(n_chunks + 1)]
        jobs = [(bounds[k], bounds[k + 1], exclude_names, min_body, max_body, want_self) for k in range(n_chunks)]
        _FORK_FILES = files
        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as ex:
                per_file = [r for chunk in ex.map(_records_chunk, jobs) for r in chunk]
        except Exception as e:  # noqa: BLE001 - e.g. no fork in a sandbox, or an unpicklable module
            T.log(f"parallel parse failed ({type(e).__name__}: {str(e)[:200]}); parsing in this process")
            per_file = None
        finally:
            _FORK_FILES = None
    if per_file is None:
        per_file = [_file_function_records(text, exclude_names, min_body, max_body, want_self) for _, text in files]
    return sum(n for n, _ in per_file), [r for _, recs in per_file for r in recs]


def pick_device(name) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def device_name(device: torch.device) -> str:
    """The GPU's name (this initializes CUDA), or the CPU thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = torch.get_num_threads()
    return f"{n} CPU thread{'s' if n != 1 else ''} ({platform.machine() or 'CPU'})"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def data_files(args, prompts):
    """The first stage's file filters and split (its defaults; --roots passed on): (training files without
    any held-out prompt's file, held-out files)."""
    targs = T.parse_args(["--out", str(args.out or "-")] + (["--roots", *args.roots] if args.roots else []))
    files = T.collect_files(targs)
    train_files, held_files = T.split_files(files, targs)
    held_labels = {p["file"] for p in prompts}
    return [(lab, txt) for lab, txt in train_files if lab not in held_labels], held_files


def file_stream(train_files, tok, eos, max_chars, seed):
    """Token ids [n] of a seeded sample of whole training files (up to max_chars characters), each followed
    by <|endoftext|>: the first stage's own packing (T.encode_files): what --file-mix replays."""
    order = list(train_files)
    random.Random(seed + 3).shuffle(order)
    sample, n = [], 0
    for lt in order:
        if n >= max_chars:
            break
        sample.append(lt)
        n += len(lt[1])
    stream, _ = T.encode_files(tok.backend_tokenizer, sample, eos)
    return torch.from_numpy(stream.astype(np.int64))


def heldout_token_ids(held_files, tok, n_tokens):
    """This machine's held-out files, the first n_tokens tokens of them in label-hash order (whole files)."""
    held_ids, n_held = [], 0
    for lab, txt in sorted(held_files, key=lambda lt: T.label_hash(lt[0], "eval:")):
        if n_held >= n_tokens:
            break
        held_ids.append(np.asarray(tok(txt, add_special_tokens=False)["input_ids"], dtype=np.int64))
        n_held += len(held_ids[-1])
    return held_ids


def parse_check(model, tok, prompts, max_new_tokens, device):
    """Greedy (batched, left-padded) completions of the held-out prompts, judged as tests/test_demo_model.py
    judges them."""
    comps = T.greedy_batch(model, tok, [p["prompt"] for p in prompts], max_new_tokens, device)
    verdicts = [T.judge_completion(p["prompt"], c, fin) for p, (c, _, fin) in zip(prompts, comps)]
    return {"max_new_tokens": max_new_tokens, "parsed": verdicts.count("parsed"),
            "valid": sum(v != "invalid" for v in verdicts), "total": len(prompts), "verdicts": verdicts}


def greedy_samples(model, tok, device, max_new_tokens=64):
    return [{"prompt": p, "completion": c, "finished": fin}
            for p, (c, _, fin) in zip(T.SAMPLE_PROMPTS, T.greedy_batch(model, tok, T.SAMPLE_PROMPTS,
                                                                         max_new_tokens, device))]


# -- the model card ----------------------------------------------------------------------------------------

def _headings(lines):
    """[(line index, level)] of the markdown headings of `lines`, outside code fences."""
    out, fence = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            if line[level:level + 1] == " ":
                out.append((i, level))
    return out


def replace_section(card: str, heading: str, new: str, before: str | None = None) -> str:
    """`card` with the section whose heading line starts with `heading` (up to the next heading of the same
    or a higher level) replaced by `new`; without one, `new` goes before the heading starting with
    `before`, or at the end."""
    lines = card.split("\n")
    heads = _headings(lines)
    new_lines = new.rstrip("\n").split("\n") + [""]
    for k, (i, level) in enumerate(heads):
        if lines[i].startswith(heading):
            j = next((h for h, lv in heads[k + 1:] if lv <= level), len(lines))
            return "\n".join(lines[:i] + new_lines + lines[j:]).rstrip("\n") + "\n"
    for i, _ in heads:
        if before and lines[i].startswith(before):
            return "\n".join(lines[:i] + new_lines + lines[i:]).rstrip("\n") + "\n"
    return card.rstrip("\n") + "\n\n" + "\n".join(new_lines).rstrip("\n") + "\n"


def card_section(ft: dict) -> str:
    a = ft["args"]
    strip = ""
    if a["strip_docstrings"]:
        strip = (f"; each function document loses its docstring with probability {a['strip_docstrings']:g} "
                 f"(`--strip-docstrings {a['strip_docstrings']:g}`, seeded; only docstrings on lines of their own "
                 f"and followed by code): {ft['docstrings_stripped']:,} of the documents have none")
    repeat = ""
    if a["self_contained_repeat"] > 1:
        repeat = (f" The {ft['self_contained_functions']:,} self-contained functions (every name they read is "
                  f"bound inside them, a builtin, or themselves) are included {a['self_contained_repeat']}x.")
    if ft.get("file_mix_rows"):
        repeat += (f" {ft['file_mix_rows']} of each batch's {a['batch_size']} rows are windows of whole training "
                   f"files instead (`--file-mix {a['file_mix']:g}`: {ft['file_mix_tokens'] / 1e6:.1f} M tokens of "
                   f"a seeded sample of them), so that the first stage's task is not forgotten; epochs count the "
                   f"function documents only.")
    b, af, pe = ft["heldout_files_here"]["before"], ft["heldout_files_here"]["after"], ft["parse_eval"]
    intro = (f"Written by `scripts/demo_model/finetune_demo_functions.py`. The first stage sees random windows of whole "
             f"files, where a function runs on into the rest of its file; this stage continues training on "
             f"documents that are single top-level functions of the training files, each followed by "
             f"`<|endoftext|>`: the same file filters and the same file-level split (no held-out file is read, nor "
             f"any function named like a held-out prompt), bodies of {a['min_body_lines']}-{a['max_body_lines']} "
             f"lines, at most {a['max_function_tokens']} tokens{strip}. {ft['documents']:,} documents "
             f"({ft['tokens'] / 1e6:.2f} M tokens) from {ft['functions']:,} top-level functions of "
             f"{ft['train_files']:,} training files of the machine it ran on.{repeat} {ft['steps']} steps of AdamW "
             f"(betas 0.9/0.95, weight decay 0.1, lr {a['lr']:g}, {a['warmup_steps']} warmup steps, cosine to 0.1x, "
             f"grad clip 1.0), batch {a['batch_size']} x {a['seq_len']} tokens ({ft['tokens_seen'] / 1e6:.1f} M "
             f"tokens, {ft['epochs']:.2f} epochs), {ft['precision']}, on {ft['device_name']} in "
             f"{ft['train_seconds']:.0f} s. Whole script: {ft['total_seconds']:.0f} s. Seed {a['seed']}. Software: "
             f"Python {ft['python']}, torch {ft['torch']}, transformers {ft['transformers']}. Command:")
    result = (f"On the held-out files of the machine it ran on (the first {b['heldout_tokens']:,} tokens, "
              f"1024-token windows, fp32 weights, on {ft['device_name']}) the whole-file loss went from "
              f"{b['heldout_loss']:.4f} to {af['heldout_loss']:.4f} nats/token (perplexity {b['heldout_ppl']:.2f} -> "
              f"{af['heldout_ppl']:.2f}). Greedy completions of the {pe['total']} held-out prompts (batched, "
              f"{pe['max_new_tokens']} tokens, fp32 weights, on {ft['device_name']}): {pe['parsed']} / {pe['total']} "
              f"parse, {pe['valid']} / {pe['total']} parse or are valid-but-truncated; `tests/test_demo_model.py` "
              f"measures it again on CPU on the bf16 weights.")
    return (f"### Second stage: whole functions\n\n{_fill(intro)}\n\n```\n{ft['command']}\n```\n\n"
            f"{_fill(result)}\n")


def _fill(paragraph: str) -> str:
    return textwrap.fill(paragraph, width=108, break_long_words=False, break_on_hyphens=False)


def samples_section(samples, device_name, max_new_tokens=64) -> str:
    parts = []
    for s in samples:
        code = s["prompt"] + s["completion"] + ("<|endoftext|>" if s["finished"] else "")
        parts.append(f"Prompt `{json.dumps(s['prompt'])}`:\n\n```python\n{code.rstrip(chr(10))}\n```")
    intro = (f"After both stages (transformers, fp32 compute on the bf16 weights, {max_new_tokens} new tokens, "
             f"on {device_name}; `<|endoftext|>` is where the model ended the function):")
    return "## Greedy samples\n\n" + _fill(intro) + "\n\n" + "\n\n".join(parts) + "\n"


# -- evaluation only ---------------------------------------------------------------------------------------

def evaluate_checkpoint(args):
    """--eval-only: the numbers the fine-tuning reports, for a checkpoint as it is (bf16 weights, fp32
    compute), on this machine's held-out files and the checkpoint's held-out prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    device = pick_device(args.device)
    dev_name = device_name(device)
    src = Path(args.model)
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(device).eval()
    prompts = json.loads((src / "heldout_prompts.json").read_text())
    _, held_files = data_files(args, prompts)
    held_ids = heldout_token_ids(held_files, tok, args.eval_tokens)
    eargs = argparse.Namespace(seq_len=1024, eval_max_tokens=args.eval_tokens)
    ev = T.evaluate(model, held_ids, eargs, device, tok.eos_token_id)
    T.log(f"held-out loss {ev['heldout_loss']} (ppl {ev['heldout_ppl']}) over {ev['heldout_tokens']} tokens")
    pe = parse_check(model, tok, prompts, args.eval_max_tokens, device)
    T.log(f"held-out parse: {pe['parsed']}/{pe['total']} parse, {pe['valid']}/{pe['total']} parse or are "
          f"valid-but-truncated; verdicts {pe['verdicts']}")
    samples = greedy_samples(model, tok, device)
    for s in samples:
        T.log(f"sample {s['prompt']!r}:\n{s['prompt']}{s['completion']}" + ("<|endoftext|>" if s["finished"] else ""))
    res = {"model": str(src), "device": device.type, "device_name": dev_name, "heldout_files_here": ev,
           "parse_eval": pe, "samples": samples, "seconds": round(time.time() - t0, 1)}
    print("EVAL " + json.dumps(res), flush=True)
    if args.eval_json:
        Path(args.eval_json).write_text(json.dumps(res, indent=1) + "\n")
    return res


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eval_only:
        return evaluate_checkpoint(args)
    # The device's name is read after the training files are parsed: the parse workers are forked, best
    # from a process that has not initialized CUDA.
    device = pick_device(args.device)
    use_amp = device.type == "cuda"
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    T.log(f"device {device}; torch {torch.__version__} transformers {transformers.__version__}")
    src = Path(args.model)
    tok = AutoTokenizer.from_pretrained(src)
    eos = tok.eos_token_id
    prompts = json.loads((src / "heldout_prompts.json").read_text())

    # Data: the first stage's file filters and split (its defaults), training files only. Parsed before the
    # model is loaded, so that the parse workers fork a process that has not started torch's threads.
    train_files, held_files = data_files(args, prompts)
    # Belt and braces: no function named like a held-out prompt's (a copy under another path).
    exclude = {p["name"] for p in prompts}
    workers = args.workers or min(16, os.cpu_count() or 1)
    t_parse = time.time()
    n_funcs, records = function_records(train_files, exclude, args.min_body_lines, args.max_body_lines,
                                        want_self=args.self_contained_repeat > 1, workers=workers)
    T.log(f"parsed {len(train_files)} files in {time.time() - t_parse:.1f} s ({workers} worker(s))")
    docs = []
    # Library functions nearly all open with a docstring; a model this small, completing a signature,
    # then writes docstrings it does not end. Some documents without theirs teach it that code may
    # follow the signature directly. Own generator: the shuffle below stays as without the option.
    strip_rng = random.Random(args.seed + 1)
    n_stripped = n_self = 0
    for text, stripped, is_self in records:
        if args.strip_docstrings and strip_rng.random() < args.strip_docstrings:
            n_stripped += stripped != text
            text = stripped
        docs.append(text)
        if args.self_contained_repeat > 1 and is_self:
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
    T.log(f"{len(train_files)} training files -> {n_funcs} top-level functions; {n_docs} documents "
          f"({len(data) / 1e6:.2f} M tokens; {n_long} over {args.max_function_tokens} tokens dropped)")

    file_data = file_stream(train_files, tok, eos, args.file_mix_chars, args.seed) if args.file_mix > 0 else None
    if file_data is not None:
        T.log(f"--file-mix {args.file_mix:g}: {len(file_data) / 1e6:.2f} M tokens of whole training files")

    dev_name = device_name(device)
    T.log(f"training on {device} ({dev_name})")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(device)
    data = data.to(device)
    if file_data is not None:
        file_data = file_data.to(device)

    # Whole-file modeling before / after, on this machine's held-out files (the first eval_tokens tokens
    # in label-hash order), as the first stage measures it: the cost of this stage on its own task.
    held_ids = heldout_token_ids(held_files, tok, args.eval_tokens)
    eargs = argparse.Namespace(seq_len=1024, eval_max_tokens=args.eval_tokens)
    before = T.evaluate(model, held_ids, eargs, device, eos)
    T.log(f"held-out loss before: {before['heldout_loss']} over {before['heldout_tokens']} tokens")

    # Train: AdamW, linear warmup then cosine to 10%; fp32 on a CPU, bf16 autocast with fp32 master
    # weights on a GPU. The windows are drawn on the device (on a GPU, a host-to-device copy of them would
    # wait for the queued steps each time).
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if device.type == "cuda" else {}))
    L, B = args.seq_len, args.batch_size
    n_windows = len(data) - L - 1
    # --file-mix: the last B_file rows of every batch are whole-file windows (own generator below).
    B_file = min(B - 1, round(B * args.file_mix)) if file_data is not None else 0
    offs = torch.arange(L + 1, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    gen_file = torch.Generator(device=device).manual_seed(args.seed + 2)
    model.train()
    deadline = time.time() + args.minutes * 60
    # --steps: exactly that schedule, no clock. --epochs: that schedule, shortened to fit --minutes once the
    # step time is measured. Neither: the schedule that fits --minutes. The step time is measured over steps
    # [0, 5) on a CPU, over [5, 25) on a GPU (after its warm-up), then the schedule's length is fixed.
    target = args.steps or (max(1, math.ceil(args.epochs * len(data) / ((B - B_file) * L)))
                            if args.epochs else None)
    total = target or 10**9
    m_from, m_n = (0, 5) if device.type == "cpu" else (5, 20)
    step, hist, t_train = 0, [], time.time()
    t_measure = t_train
    while step < total and (args.steps or time.time() < deadline):
        if not args.steps and m_from and step == m_from:
            sync(device)
            t_measure = time.time()
        if not args.steps and step == m_from + m_n:
            sync(device)
            per = (time.time() - t_measure) / m_n
            fit = max(step + 1, step + int((deadline - time.time()) / per))
            total = min(target, fit) if target else fit
            T.log(f"step time {per * 1000:.1f} ms ({B * L / per / 1e6:.2f} M tok/s); schedule fixed at {total} "
                  f"steps" + (f" (--epochs {args.epochs:g}: {target})" if target else ""))
        lr_scale = min(1.0, (step + 1) / args.warmup_steps)
        if total < 10**9 and step >= args.warmup_steps:
            frac = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
            lr_scale = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_scale
        starts = torch.randint(0, n_windows, (B - B_file,), generator=gen, device=device)
        w = data[starts[:, None] + offs]
        if B_file:
            fstarts = torch.randint(0, len(file_data) - L - 1, (B_file,), generator=gen_file, device=device)
            w = torch.cat([w, file_data[fstarts[:, None] + offs]])
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_amp):
            logits = model(input_ids=w[:, :-1], use_cache=False).logits
        logits = logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            hist.append({"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.time() - t_train, 1)})
            T.log(f"step {step}/{total if total < 10**9 else '?'} loss {loss.item():.4f}")
    sync(device)
    train_s = time.time() - t_train
    model.eval()

    after = T.evaluate(model, held_ids, eargs, device, eos)
    T.log(f"held-out loss after: {after['heldout_loss']} (before {before['heldout_loss']})")

    # Held-out parse check, as in the first stage (greedy, batched, fp32).
    pe = parse_check(model, tok, prompts, args.eval_max_tokens, device)
    T.log(f"held-out parse: {pe['parsed']}/{pe['total']} ({pe['valid']} parse or are valid-but-truncated); "
          f"verdicts {pe['verdicts']}")

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    model.to("cpu", torch.bfloat16).save_pretrained(out, max_shard_size="15MB")
    # Samples of what is shipped: the bf16 weights, fp32 compute.
    model.to(device, torch.float32)
    samples = greedy_samples(model, tok, device)
    meta = json.loads((out / "metrics.json").read_text())
    ft = meta["finetune_functions"] = {
        "command": "python3 scripts/demo_model/finetune_demo_functions.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "args": vars(args), "train_files": len(train_files), "functions": n_funcs, "documents": n_docs,
        "docstrings_stripped": n_stripped, "self_contained_functions": n_self,
        "heldout_files_here": {"before": before, "after": after},
        "tokens": int(len(data)), "steps": step, "tokens_seen": step * B * L,
        "epochs": step * (B - B_file) * L / len(data), "file_mix_rows": B_file,
        "file_mix_tokens": int(len(file_data)) if file_data is not None else 0,
        "train_seconds": round(train_s, 1), "history": hist, "device": device.type, "device_name": dev_name,
        "precision": "bf16 autocast with fp32 master weights" if use_amp else "fp32",
        "threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "parse_eval": pe, "samples": samples,
    }
    ft["total_seconds"] = round(time.time() - t0, 1)
    (out / "metrics.json").write_text(json.dumps(meta, indent=1))
    card = (out / "README.md").read_text() if (out / "README.md").exists() else "# gyrfalcon demo-model\n"
    card = replace_section(card, "### Second stage", card_section(ft), before="## Evaluation")
    card = replace_section(card, "## Greedy samples", samples_section(samples, dev_name))
    (out / "README.md").write_text(card)
    T.log(f"wrote {out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
