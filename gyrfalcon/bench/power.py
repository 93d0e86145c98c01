"""The GPU's SM clock and power draw while a benchmark times its runs (nvidia-smi sampled in a subprocess).

Why: on the H200 the throughput row draws close to its 700 W limit and the SM clock falls well below its
maximum, so its GEMMs run slower than timed alone; the latency rows touch the cap too. Calls on different
machine instances have differed by a few percent on the same commit. A
benchmark JSON that records the clock and power of its own timed section says whether two numbers were taken
under the same conditions.

PowerSampler is a context manager: inside it `nvidia-smi --query-gpu=... --loop-ms=PERIOD` writes one CSV line per
sample (timestamp, SM clock MHz, memory clock MHz, power W, temperature C[, clock event reasons]); a reader
thread keeps them. summary() -> {} when nvidia-smi is missing or gave no sample (a CPU run), else the
samples' count, SM clock median / min / max, power median / max, and the fraction of samples flagged with the
software power cap (clock event reason bit 0x4) or a thermal / hardware slowdown (0x8 | 0x20 | 0x40 | 0x80).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from typing import List, Optional

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"
REASONS = "clocks_event_reasons.active"  # absent from older drivers' fields: sampled without it there
POWER_CAP = 0x4  # SW power cap
SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW / HW thermal slowdown, HW power brake


def _num(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_samples(lines: List[str]) -> List[dict]:
    """nvidia-smi's CSV lines (noheader, nounits) -> [{"sm_mhz", "power_w", "reasons"}] (lines it cannot
    read are skipped: a message instead of a sample)."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        sm, power = _num(parts[1]), _num(parts[3])
        if sm is None or power is None:
            continue
        reasons, temp = None, _num(parts[4])
        if len(parts) > 5 and parts[5].lower().startswith("0x"):
            reasons = int(parts[5], 16)
        out.append({"sm_mhz": sm, "power_w": power, "reasons": reasons, "temp_c": temp})
    return out


def summarize(samples: List[dict], power_limit_w: Optional[float] = None) -> dict:
    """The samples' clock and power figures (see the module docstring); {} without samples. power_limit_w: the
    card's enforced power limit, recorded beside them (instances of one GPU model have flagged the cap at
    different draws)."""
    if not samples:
        return {}
    sm = [s["sm_mhz"] for s in samples]
    power = [s["power_w"] for s in samples]
    flagged = [s["reasons"] for s in samples if s["reasons"] is not None]
    temps = [s["temp_c"] for s in samples if s.get("temp_c") is not None]
    res = {"samples": len(samples), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
           "sm_mhz_max": max(sm), "power_w_median": statistics.median(power), "power_w_max": max(power)}
    if temps:
        res["temp_c_max"] = max(temps)
    if power_limit_w is not None:
        res["power_limit_w"] = power_limit_w
    if flagged:
        res["power_cap_fraction"] = sum(1 for r in flagged if r & POWER_CAP) / len(flagged)
        res["slowdown_fraction"] = sum(1 for r in flagged if r & SLOWDOWN) / len(flagged)
    return res


def format_summary(s: dict) -> str:
    """One line for a benchmark's output ("" for an empty summary)."""
    if not s:
        return ""
    line = (f"GPU while timed: SM clock median {s['sm_mhz_median']:.0f} MHz "
            f"({s['sm_mhz_min']:.0f}-{s['sm_mhz_max']:.0f}), power median {s['power_w_median']:.0f} W "
            f"(max {s['power_w_max']:.0f}"
            + (f" of a {s['power_limit_w']:.0f} W limit" if s.get("power_limit_w") is not None else "")
            + f"), {s['samples']} samples"
            + (f", up to {s['temp_c_max']:.0f} C" if s.get("temp_c_max") is not None else ""))
    if "power_cap_fraction" in s:
        line += (f", {s['power_cap_fraction']:.0%} at the power cap"
                 + (f", {s['slowdown_fraction']:.0%} slowed (thermal / hardware)" if s["slowdown_fraction"] else ""))
    return line


class PowerSampler:
    """with PowerSampler(device_id) as ps: ...timed work...; then ps.summary(). device_id: what nvidia-smi's -i
    takes (an index or the GPU's UUID; None: the first GPU it lists). period_ms: the sampling period.
    enabled=False (a CPU run): samples nothing."""

    def __init__(self, device_id: Optional[str] = None, period_ms: int = 250, exe: str = "nvidia-smi",
                 enabled: bool = True) -> None:
        self.device_id, self.period_ms, self.exe, self.enabled = device_id, period_ms, exe, enabled
        self.proc: Optional[subprocess.Popen] = None
        self.lines: List[str] = []
        self.reader: Optional[threading.Thread] = None
        self.power_limit_w: Optional[float] = None

    def _command(self, with_reasons: bool) -> List[str]:
        cmd = [self.exe, f"--query-gpu={QUERY}" + (f",{REASONS}" if with_reasons else ""),
               "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"]
        if self.device_id is not None:
            cmd.append(f"--id={self.device_id}")
        return cmd

    def _spawn(self, with_reasons: bool) -> None:
        self.lines = []
        self.proc = subprocess.Popen(self._command(with_reasons), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.reader = threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True)
        self.reader.start()

    def _first_sample(self, timeout_s: float = 2.0) -> bool:
        """Wait until the first sample arrives (True) or nvidia-smi exits without one (False)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if parse_samples(list(self.lines)):
                return True
            if self.proc.poll() is not None:
                self.reader.join(timeout=1)
                return bool(parse_samples(list(self.lines)))
            time.sleep(0.01)
        return False

    def __enter__(self) -> "PowerSampler":
        path = shutil.which(self.exe) if self.enabled else None
        if path is None:
            return self
        self.exe = path
        self.power_limit_w = self._query_limit()
        self._spawn(True)
        if not self._first_sample():
            # A driver without the reasons field refuses the whole query: sample without it.
            self._stop()
            self._spawn(False)
            self._first_sample()
        return self

    def _query_limit(self) -> Optional[float]:
        """The enforced power limit in W (None where nvidia-smi cannot say)."""
        cmd = [self.exe, "--query-gpu=enforced.power.limit", "--format=csv,noheader,nounits"]
        if self.device_id is not None:
            cmd.append(f"--id={self.device_id}")
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError):
            return None
        return _num(out[0].strip()) if out else None

    @staticmethod
    def _read(proc: subprocess.Popen, lines: List[str]) -> None:
        for line in proc.stdout:
            lines.append(line)

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.reader is not None:
            self.reader.join(timeout=5)

    def summary(self) -> dict:
        return summarize(parse_samples(self.lines), self.power_limit_w)


def device_uuid(device) -> Optional[str]:
    """The CUDA device's UUID as nvidia-smi names it ("GPU-..."), so that CUDA_VISIBLE_DEVICES' renumbering does
    not point the sampler at another GPU; None where torch does not report it (nvidia-smi then reads the first)."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # an old torch, no CUDA
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
