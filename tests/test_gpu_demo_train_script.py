"""scripts/demo_model/gpu_demo_train.sh, the one-call GPU retraining of the demo model, without a GPU: its syntax, and
its flow and packing with stand-ins for the two training scripts (the parts must come back through the device
tool: at most 8 files of at most 16 MiB, plain names, and `cat parts | tar x` must give the checkpoints back)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "demo_model" / "gpu_demo_train.sh"

# Stands in for `python3`: writes a checkpoint folder the way each stage does (weights of STUB_MB MiB of random
# bytes) and records its command line.
STUB = r'''
import json, os, shutil, sys
from pathlib import Path
args = sys.argv[1:]
if args[0] == "-c":
    print("python stand-in")
    sys.exit(0)
with open(os.environ["STUB_CALLS"], "a") as f:
    f.write(" ".join(args) + "\n")
out = Path(args[args.index("--out") + 1])
mb = float(os.environ.get("STUB_MB", "1"))
if args[0].endswith("train_demo_model.py"):
    out.mkdir(parents=True)
    for name in ("config.json", "metrics.json", "README.md", "heldout_prompts.json"):
        (out / name).write_text("{}")
    for i in (1, 2):
        (out / f"model-0000{i}-of-00002.safetensors").write_bytes(os.urandom(int(mb * 2**20)))
    print("stage 1 stand-in done")
else:
    if os.environ.get("STUB_FAIL_STAGE2"):
        sys.exit(3)
    shutil.copytree(Path(args[args.index("--model") + 1]), out)
    (out / "metrics.json").write_text(json.dumps({"finetune_functions": {"steps": 1}}))
    print("held-out parse: 1/1 stand-in")
'''


def test_script_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def run_script(tmp_path, **env):
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    out = tmp_path / "out"
    out.mkdir()
    calls = tmp_path / "calls.txt"
    e = dict(os.environ, OUT=str(out), WORK=str(tmp_path / "work"), PYTHON=f"{sys.executable} {stub}",
             STUB_CALLS=str(calls), PART_SIZE="1M", **env)
    (tmp_path / "work").mkdir()
    r = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return out, calls.read_text().splitlines() if calls.exists() else [], r.stdout


def unpack(out: Path, dest: Path):
    """As the script's header says: `cat parts | tar xz`; the parts' sha256 is the one the log ends with."""
    import hashlib

    parts = sorted(out.glob("demo-model.tar.gz.part-*"))
    x = dest / "x"
    x.mkdir()
    subprocess.run(f'cat "{out}"/demo-model.tar.gz.part-* | tar xz -C "{x}"', shell=True, check=True)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    assert f"sha256 {digest} demo-model.tar.gz" in (out / "gpu_demo_train.log").read_text()
    return parts, x


def check_returnable(out: Path):
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 8
    for p in files:
        assert re.fullmatch(r"[A-Za-z0-9._-]+", p.name) and p.parent == out
        assert p.stat().st_size <= 16 * 2**20
    return files


@pytest.mark.skipif(not (shutil.which("split") and shutil.which("numfmt") and shutil.which("timeout")),
                    reason="coreutils missing")
def test_both_stages_packed_in_parts(tmp_path):
    out, calls, stdout = run_script(tmp_path, STUB_MB="1.3", STAGE1_MINUTES="0.1", STAGE1_TOTAL_MINUTES="0.2",
                                    STAGE2_EPOCHS="3")
    files = check_returnable(out)
    assert (out / "gpu_demo_train.log").exists() and "=== done" in (out / "gpu_demo_train.log").read_text()
    assert len(calls) == 2
    s1, s2 = calls
    assert s1.startswith("scripts/demo_model/train_demo_model.py --out ") and s1.endswith(
        "--compile --max-corpus-mb 400 --minutes 0.1 --total-minutes 0.2 --reserve-seconds 25")
    assert s2.startswith("scripts/demo_model/finetune_demo_functions.py --model ") and "--device cuda" in s2
    assert "--strip-docstrings 0.5" in s2 and "--epochs 3 --minutes" in s2 and "--batch-size 64" in s2
    assert "--file-mix 0.5" in s2
    parts, x = unpack(out, tmp_path)
    assert len(parts) == len(files) - 1 >= 4  # 4 x 1.3 MiB of weights in 1 MiB parts
    assert all(p.stat().st_size <= 2**20 for p in parts)
    assert (x / "dm-stage2" / "config.json").exists() and (x / "dm-stage1" / "metrics.json").exists()
    assert len(list((x / "dm-stage1").glob("*.safetensors"))) == 2
    assert "stage 1 stand-in done" in (x / "dm-logs" / "stage1.log").read_text()
    assert "held-out parse" in (x / "dm-logs" / "stage2.log").read_text()


@pytest.mark.skipif(not (shutil.which("split") and shutil.which("numfmt") and shutil.which("timeout")),
                    reason="coreutils missing")
def test_too_big_drops_stage1_weights_and_a_failed_stage2_still_packs(tmp_path):
    out, calls, stdout = run_script(tmp_path, STUB_MB="1.3", MAX_MB="2", STUB_FAIL_STAGE2="1",
                                    STAGE2_STEPS="500")
    check_returnable(out)
    assert "--steps 500" in calls[1] and "--epochs" not in calls[1]
    assert "leaving out the first stage's weights" in stdout
    parts, x = unpack(out, tmp_path)
    assert len(parts) <= 2
    assert not (x / "dm-stage2").exists()  # stage 2 failed: nothing half-written comes back as a checkpoint
    assert (x / "dm-stage1" / "config.json").exists() and not list((x / "dm-stage1").glob("*.safetensors"))
    assert "stage 2 exit 3" in stdout
