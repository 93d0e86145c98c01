"""The code model shipped in gyrfalcon/assets/demo-model (trained by scripts/demo_model/train_demo_model.py, then
scripts/demo_model/finetune_demo_functions.py).

(a) the checkpoint is a well-formed Hugging Face checkpoint that transformers loads, with finite logits
    and a low loss on held-out code (a trained model, not random weights);
(b) gyrfalcon's greedy tokens equal transformers' greedy generate (fp32, CPU);
(c) greedy completions of the held-out function signatures in heldout_prompts.json are valid Python.

All on CPU in float32. GYRFALCON_DEMO_MODEL_DIR=<checkpoint> runs them on another checkpoint (a retrained
candidate, before it replaces the shipped one).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("GYRFALCON_DEMO_MODEL_DIR") or REPO / "gyrfalcon" / "assets" / "demo-model")
EOS = "<|endoftext|>"
PARITY_MAX_TOKENS = 32
PARSE_MAX_TOKENS = 128
# Issue 5 asks >= 70% of the held-out completions to parse. The shipped model: 20 / 24 parse, 21 / 24 parse
# or are valid-but-truncated (CPU, fp32 compute; the model card's table).
MIN_PARSE_RATE = 0.7  # ast.parse of the cut completion (truncation inside a statement counts as a failure)
MIN_VALID_RATE = 0.8  # ... or valid-but-truncated (see judge_completion)
PARITY_PROMPTS = [
    "def fib(n):",
    "import os\n\n\ndef read_file(path):",
    "class Stack:\n    def __init__(self):",
    "x = [i * i for i in range(10)]\n",
    "<|im_start|>user\nWrite a function that adds two numbers.<|im_end|>\n<|im_start|>assistant\n",
]

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason="demo model not present")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """A 15M-parameter model gains nothing from intra-op threads on CPU, and a busy machine (CI runners,
    parallel test jobs) makes OpenMP spin-waits cost 10x. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def heldout_prompts():
    return json.loads((MODEL_DIR / "heldout_prompts.json").read_text())


# -- the judging procedure: the training script's own (it scores the model card's numbers) -------------

def _load_train_script():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "demo_model" / "train_demo_model.py"
    spec = importlib.util.spec_from_file_location("train_demo_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its top level imports only the standard library
    return module


_train = _load_train_script()
cut_completion, parses, judge_completion = _train.cut_completion, _train.parses, _train.judge_completion


def test_judge_completion():
    sig = "def f(x):"
    assert judge_completion(sig, "\n    return x\n\n\ndef g():\n    )))", False) == "parsed"
    assert judge_completion(sig, "\n    return x\n", True) == "parsed"
    assert judge_completion(sig, "\n    y = x\n    if y:\n        return {\n            1: 2,\n  ", False) \
        == "truncated-valid"
    assert judge_completion(sig, '\n    """Doc\n\n    more', False) == "invalid"  # no body statement yet
    assert judge_completion(sig, "\n    # only\n    # comments\n  ", False) == "invalid"
    assert judge_completion(sig, '\n    """Doc."""\n        return x\n  ', False) == "invalid"  # bad indent
    assert judge_completion(sig, "\n    return x +\n\ndef g(): pass\n", False) == "invalid"  # ended, invalid
    assert judge_completion(sig, " retur", False) == "invalid"  # nothing past the signature


def _load_finetune_script():
    """scripts/demo_model/finetune_demo_functions.py as a module, registered in sys.modules so that its parse workers
    (forked processes) can be handed its functions."""
    import importlib.util

    if "finetune_demo_functions" not in sys.modules:
        spec = importlib.util.spec_from_file_location("finetune_demo_functions",
                                                      REPO / "scripts" / "demo_model" / "finetune_demo_functions.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["finetune_demo_functions"]


def test_finetune_documents_are_whole_top_level_functions():
    """The second training stage's documents: each top-level function (decorators included) as written,
    none named like a held-out prompt; methods and nested functions are not documents of their own."""
    ft = _load_finetune_script()
    text = ("import os\n\n\n@cache\ndef a(x):\n    def inner():\n        return 1\n    return x\n\n\n"
            "class C:\n    def m(self):\n        return 2\n\n\nasync def held(y):\n    return y\n\n\n"
            "def b():\n    pass\n")
    docs = ft.function_documents([("x/f.py", text), ("x/bad.py", "def (:\n")], exclude_names={"held"})
    assert [d for _, d in docs] == ["@cache\ndef a(x):\n    def inner():\n        return 1\n    return x",
                                    "def b():\n    pass"]


def test_self_contained_functions():
    """The second stage's optional upweighting: functions whose every read name is bound inside them, a
    builtin, or themselves."""
    import ast

    ft = _load_finetune_script()
    src = {
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)": True,
        "def f(xs, *rest, key=None):\n    import os\n    out = [len(x) for x in xs]\n    return out, os.sep": True,
        "def g(p):\n    try:\n        return open(p).read()\n    except OSError as e:\n        return str(e)": True,
        "def h(x):\n    return np.sum(x)": False,  # a module-level import
        "def k(x):\n    return helper(x) + CONST": False,
    }
    for text, want in src.items():
        assert ft.self_contained(ast.parse(text).body[0]) is want, text


def test_finetune_card_sections():
    """The second stage rewrites its own section of the model card and the samples, leaving the rest (and
    '#' lines inside code blocks) alone; without a section of its own it goes before '## Evaluation'."""
    ft = _load_finetune_script()
    card = ("# m\n\n## Training\n\ntext\n\n### Second stage: old\n\nold\n\n## Evaluation\n\neval\n\n"
            "## Greedy samples\n\n```python\n# a comment\n## not a heading\n```\n")
    out = ft.replace_section(card, "### Second stage", "### Second stage: new\n\nnew\n", before="## Evaluation")
    assert "old" not in out and out.count("### Second stage") == 1
    assert out.index("### Second stage: new") < out.index("## Evaluation") < out.index("## Greedy samples")
    out = ft.replace_section(out, "## Greedy samples", "## Greedy samples\n\nnew samples\n")
    assert out.endswith("## Greedy samples\n\nnew samples\n") and "# a comment" not in out and "eval" in out
    plain = "# m\n\n## Training\n\ntext\n\n## Evaluation\n\neval\n"
    out = ft.replace_section(plain, "### Second stage", "### Second stage: x\n\nx\n", before="## Evaluation")
    assert out == "# m\n\n## Training\n\ntext\n\n### Second stage: x\n\nx\n\n## Evaluation\n\neval\n"


def _tiny_stage1(tmp_path):
    """A first-stage checkpoint as the second stage reads it, with the demo model's tokenizer and prompts but
    a 1-layer, 32-wide model; and a source root of generated files, some of them held out."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    ft = _load_finetune_script()
    src = tmp_path / "stage1"
    src.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        if (MODEL_DIR / name).exists():
            shutil.copy(MODEL_DIR / name, src / name)
    (src / "heldout_prompts.json").write_text(json.dumps(heldout_prompts()[:3]))
    (src / "metrics.json").write_text("{}")
    cfg = Qwen3Config(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    root = tmp_path / "root"
    root.mkdir()
    n_held = 0
    for i in range(400):
        if n_held >= 2 and i >= 40:
            break
        held = ft.T.label_hash(f"root0/m{i}.py", "split:") % 1000 < 20
        if held and n_held >= 2:
            continue
        n_held += held
        body = "".join(f'def f{i}_{j}(x, y={j}):\n    """Add {j}."""\n    z = x + y\n    return z * {i}\n\n\n'
                       for j in range(4))
        (root / f"m{i}.py").write_text(f"import os\n\n\n{body}class C{i}:\n    def m(self):\n        return 1\n")
    assert n_held >= 1
    return src, root


def test_finetune_runs_on_device_cpu(tmp_path):
    """The second stage end to end with --device cpu on a tiny model: seeded (the parse workers do not change
    the result), the device recorded in metrics.json and in the model card; then --eval-only on its output."""
    from safetensors.torch import load_file

    ft = _load_finetune_script()
    src, root = _tiny_stage1(tmp_path)
    common = ["--model", str(src), "--device", "cpu", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
              "--eval-tokens", "300", "--eval-max-tokens", "4", "--strip-docstrings", "0.5", "--threads", "1",
              "--roots", str(root)]
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        ft.main(common + ["--out", str(out), "--workers", str(workers)])
        outs.append(out)
    weights = [load_file(o / "model.safetensors") for o in outs]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert all(t.dtype == torch.bfloat16 for t in weights[0].values())
    m = json.loads((outs[0] / "metrics.json").read_text())["finetune_functions"]
    m2 = json.loads((outs[1] / "metrics.json").read_text())["finetune_functions"]
    assert m["device"] == "cpu" and "CPU" in m["device_name"] and m["precision"] == "fp32"
    assert m["steps"] == 3 and m["tokens_seen"] == 3 * 2 * 32 and m["args"]["device"] == "cpu"
    assert m["documents"] > 0 and m["docstrings_stripped"] > 0 and m["functions"] == m2["functions"]
    assert [h["loss"] for h in m["history"]] == [h["loss"] for h in m2["history"]]
    assert m["heldout_files_here"] == m2["heldout_files_here"] and m["heldout_files_here"]["after"]["heldout_tokens"] > 0
    assert m["parse_eval"]["total"] == 3 and len(m["samples"]) == 5
    card = (outs[0] / "README.md").read_text()
    assert card.count("### Second stage") == 1 and card.count("## Greedy samples") == 1
    assert f"on {m['device_name']} in" in " ".join(card.split()) and "--device cpu" in card  # card lines wrap
    assert "```python\ndef fib(n):" in card

    res = ft.main(["--model", str(outs[0]), "--eval-only", "--device", "cpu", "--eval-tokens", "300",
                   "--eval-max-tokens", "4", "--roots", str(root), "--eval-json", str(tmp_path / "eval.json")])
    assert res["device"] == "cpu" and res["parse_eval"]["total"] == 3
    assert json.loads((tmp_path / "eval.json").read_text())["heldout_files_here"]["heldout_tokens"] > 0


def test_finetune_file_mix_replays_whole_files(tmp_path):
    """--file-mix: part of each batch is windows of whole training files (replay of the first stage's task);
    recorded in metrics.json and the card, epochs counted over the function rows only; seeded."""
    ft = _load_finetune_script()
    src, root = _tiny_stage1(tmp_path)
    common = ["--model", str(src), "--device", "cpu", "--steps", "2", "--batch-size", "4", "--seq-len", "16",
              "--eval-tokens", "200", "--eval-max-tokens", "2", "--threads", "1", "--workers", "1",
              "--roots", str(root)]
    ms = []
    for name, extra in (("mix", ["--file-mix", "0.5"]), ("mix2", ["--file-mix", "0.5"]), ("plain", [])):
        ft.main(common + extra + ["--out", str(tmp_path / name)])
        ms.append(json.loads((tmp_path / name / "metrics.json").read_text())["finetune_functions"])
    mix, mix2, plain = ms
    assert mix["file_mix_rows"] == 2 and mix["file_mix_tokens"] > 0 and plain["file_mix_rows"] == 0
    assert mix["epochs"] == pytest.approx(2 * 2 * 16 / mix["tokens"])
    assert mix["tokens_seen"] == plain["tokens_seen"] == 2 * 4 * 16
    assert [h["loss"] for h in mix["history"]] == [h["loss"] for h in mix2["history"]]
    assert [h["loss"] for h in mix["history"]] != [h["loss"] for h in plain["history"]]
    assert "--file-mix 0.5" in (tmp_path / "mix" / "README.md").read_text()


def score(prompts, completions):
    """completions: [(text, finished)] -> (n_parsed, n_valid, verdicts)."""
    verdicts = [judge_completion(p["prompt"], c, fin) for p, (c, fin) in zip(prompts, completions)]
    return verdicts.count("parsed"), sum(v != "invalid" for v in verdicts), verdicts


# -- transformers ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    return model, tok


def until_eos(ids, eos_id):
    """Token ids up to and including the first eos (gyrfalcon, like vLLM, reports the eos it stopped at)."""
    ids = list(ids)
    return ids[: ids.index(eos_id) + 1] if eos_id in ids else ids


def hf_greedy(model, tok, prompt: str, max_new_tokens: int):
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return until_eos(out[0, ids["input_ids"].shape[1]:].tolist(), tok.eos_token_id)


def test_checkpoint_files():
    files = {f.name: f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file()}
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors.index.json", "README.md", "heldout_prompts.json", "metrics.json"):
        assert name in files, name
    assert max(files.values()) <= 15 * 2**20, "a file exceeds 15 MiB"
    assert sum(files.values()) <= 40e6
    index = json.loads((MODEL_DIR / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all(s in files for s in shards)
    from safetensors import safe_open

    n_params = 0
    for s in shards:
        with safe_open(str(MODEL_DIR / s), framework="pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                assert t.get_dtype() == "BF16", k
                n_params += math.prod(t.get_shape())
    assert 10e6 <= n_params <= 20e6, n_params
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert "lm_head.weight" not in index["weight_map"]
    assert len(heldout_prompts()) >= 20


def test_tokenizer(hf):
    _, tok = hf
    assert tok.eos_token == EOS and tok.pad_token == EOS
    assert tok.bos_token is None
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids(EOS)
    for special in (EOS, "<|im_start|>", "<|im_end|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1, special
    code = "def add(a, b):\n    return a + b  # 😀\n\tx = 'é'\n"
    ids = tok(code)["input_ids"]  # no BOS / EOS added
    assert ids == tok(code, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == code
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                   tokenize=False)
    assert text.endswith("<|im_start|>assistant\nyo<|im_end|>\n")


def test_transformers_logits_finite_and_trained(hf):
    model, tok = hf
    refs = [p["reference"] for p in heldout_prompts()]
    losses = []
    with torch.no_grad():
        for ref in refs:
            ids = tok(ref, return_tensors="pt")["input_ids"][:, :256]
            out = model(input_ids=ids, labels=ids)
            assert torch.isfinite(out.logits).all()
            assert out.logits.shape == (1, ids.shape[1], model.config.vocab_size)
            losses.append(out.loss.item())
    mean = sum(losses) / len(losses)
    print(f"\nmean loss on the held-out reference functions: {mean:.3f} nats/token")
    assert mean < 2.5  # random weights give ~ln(8192) = 9


def hf_greedy_batch(model, tok, prompts, max_new_tokens: int):
    """One left-padded batched greedy generate: [(completion text, finished)]."""
    eos = tok.eos_token_id
    enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(map(len, enc))
    ids = torch.tensor([[eos] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    res = []
    for row in out[:, width:].tolist():
        row = until_eos(row, eos)
        res.append((tok.decode(row, skip_special_tokens=True), eos in row))
    return res


def test_heldout_completions_parse_transformers(hf):
    model, tok = hf
    prompts = heldout_prompts()
    comps = hf_greedy_batch(model, tok, [p["prompt"] for p in prompts], PARSE_MAX_TOKENS)
    parsed, valid, verdicts = score(prompts, comps)
    n = len(prompts)
    print(f"\ntransformers greedy (batched), {PARSE_MAX_TOKENS} tokens: {parsed}/{n} parse ({parsed / n:.0%}); "
          f"{valid}/{n} parse or are valid-but-truncated ({valid / n:.0%})")
    print("  " + ", ".join(f"{p['name']}:{v}" for p, v in zip(prompts, verdicts)))
    assert parsed / n >= MIN_PARSE_RATE
    assert valid / n >= MIN_VALID_RATE


# -- gyrfalcon ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    from gyrfalcon import LLM

    return LLM(model=str(MODEL_DIR), dtype="float32", device="cpu")


def test_gyrfalcon_matches_transformers_greedy(hf, llm):
    from gyrfalcon import SamplingParams

    model, tok = hf
    prompts = PARITY_PROMPTS + [p["prompt"] for p in heldout_prompts()[:4]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=PARITY_MAX_TOKENS), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        got = list(out.outputs[0].token_ids)
        want = hf_greedy(model, tok, prompt, PARITY_MAX_TOKENS)
        assert until_eos(got, tok.eos_token_id) == got, "tokens after eos"
        assert got == want, f"prompt {prompt!r}:\n gyrfalcon    {got}\n transformers {want}"
        assert out.outputs[0].text == tok.decode(got, skip_special_tokens=True)


def test_heldout_completions_parse_gyrfalcon(llm):
    from gyrfalcon import SamplingParams

    prompts = heldout_prompts()
    eos_id = llm.get_tokenizer().eos_token_id
    outs = llm.generate([p["prompt"] for p in prompts],
                        SamplingParams(temperature=0, max_tokens=PARSE_MAX_TOKENS), use_tqdm=False)
    comps = [(o.outputs[0].text, eos_id in o.outputs[0].token_ids) for o in outs]
    parsed, valid, verdicts = score(prompts, comps)
    n = len(prompts)
    print(f"\ngyrfalcon greedy, {PARSE_MAX_TOKENS} tokens: {parsed}/{n} parse ({parsed / n:.0%}); "
          f"{valid}/{n} parse or are valid-but-truncated ({valid / n:.0%})")
    print("  " + ", ".join(f"{p['name']}:{v}" for p, v in zip(prompts, verdicts)))
    assert parsed / n >= MIN_PARSE_RATE
    assert valid / n >= MIN_VALID_RATE
