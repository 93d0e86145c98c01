"""The engine core as its own process: the Engine stepped in a loop, fed and drained over ZeroMQ.

`gyrfalcon serve` runs HTTP in one process and this loop in another, so tokenization, detokenization
and the event loop never compete with a model step for the interpreter. The two talk over two ZeroMQ
sockets this process binds (ipc:// paths the front end chooses):

    front end  --PUSH-->  input  (PULL)   AddRequest, AbortRequests, FinishRequests, Shutdown
    front end  <--PULL--  output (PUSH)   Ready, StartupFailed, Outputs, Stats, RequestFailed, EngineDead

Every message is a msgpack array `[tag, field, ...]` whose fields are plain ints, floats, strings,
lists and maps (never pickle). The core never waits on the front end: it polls its input without
blocking while requests run and sends with an unbounded queue. It exits when the front end says
Shutdown, on SIGTERM, or when its parent process is gone (PR_SET_PDEATHSIG plus a getppid() check),
so a killed server leaves no engine behind.

Run as `python -m gyrfalcon.engine.core_process '<json>'` (the front end does it; see
gyrfalcon/server/engine_client.py for the other side).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, List, Optional

import msgpack

from gyrfalcon import envs
from gyrfalcon.engine.request_stats import RequestStats
from gyrfalcon.sampling_params import SamplingParams

logger = logging.getLogger("gyrfalcon.engine_core")

# How often an idle core reports its stats (a heartbeat) and re-checks its parent.
IDLE_POLL_MS = 500
# While busy, the engine-core histograms go to the front end at most this often (each copy costs tens of
# microseconds per step to build and encode; a scrape every few seconds needs no more).
HISTOGRAM_INTERVAL_S = 0.25


# ---- messages --------------------------------------------------------------------------------------
class ProtocolError(ValueError):
    """A message that does not decode into one of the known types."""


_MESSAGES: Dict[int, type] = {}


def _message(tag: int):
    def register(cls):
        cls.TAG = tag
        assert tag not in _MESSAGES, tag
        _MESSAGES[tag] = cls
        return cls
    return register


class Message:
    TAG: ClassVar[int]

    def encode(self) -> bytes:
        return msgpack.packb([self.TAG, *(getattr(self, f.name) for f in fields(self))],
                             use_bin_type=True)


def decode_message(data: bytes) -> Message:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for garbage
        raise ProtocolError(f"undecodable message: {e}") from None
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], int):
        raise ProtocolError("a message is a list [tag, fields...]")
    cls = _MESSAGES.get(obj[0])
    if cls is None:
        raise ProtocolError(f"unknown message tag {obj[0]}")
    n = len(fields(cls))
    if len(obj) - 1 != n:
        raise ProtocolError(f"{cls.__name__} has {n} fields, got {len(obj) - 1}")
    return cls(*obj[1:])


def encode_sampling_params(p: SamplingParams) -> Dict[str, Any]:
    """The public fields only; the engine fills the private ones itself."""
    return p.to_dict()


def decode_sampling_params(d: Dict[str, Any]) -> SamplingParams:
    if not isinstance(d, dict):
        raise ProtocolError("sampling params must be a map")
    known = {f.name for f in fields(SamplingParams) if not f.name.startswith("_")}
    unknown = set(d) - known
    if unknown:
        raise ProtocolError(f"unknown sampling params {sorted(unknown)}")
    return SamplingParams(**d)


# Front end -> core.
@_message(1)
@dataclass
class AddRequest(Message):
    request_id: str
    prompt_token_ids: List[int]
    sampling_params: Dict[str, Any]  # encode_sampling_params()


@_message(2)
@dataclass
class AbortRequests(Message):
    request_ids: List[str]


@_message(3)
@dataclass
class FinishRequests(Message):
    """Requests the front end saw stop (a stop string): end them as finish_reason 'stop'."""
    request_ids: List[str]


@_message(4)
@dataclass
class Shutdown(Message):
    pass


# Core -> front end.
@_message(10)
@dataclass
class Ready(Message):
    pid: int
    num_blocks: int
    block_size: int
    max_model_len: int


@_message(11)
@dataclass
class StartupFailed(Message):
    error: str


@_message(12)
@dataclass
class Outputs(Message):
    """One step's results. Each update is [request_id, new_token_ids, new_logprobs, finished,
    finish_reason, stop_reason, num_prompt_tokens, num_cached_tokens, queue_time, prompt_logprobs] where
    new_logprobs holds per token [logprob, rank, [[token_id, logprob], ...]], queue_time is the
    seconds the request waited before its first scheduling (set on its first update only), and
    prompt_logprobs is None or [first prompt token index, [entry as in new_logprobs, ...]]."""
    updates: List[list]
    stats: Dict[str, Any]


@_message(13)
@dataclass
class Stats(Message):
    stats: Dict[str, Any]


@_message(14)
@dataclass
class RequestFailed(Message):
    request_id: str
    error: str


@_message(15)
@dataclass
class EngineDead(Message):
    error: str


# ---- the loop ----------------------------------------------------------------------------------------
class EngineCoreProc:
    """Owns an Engine and the two sockets; `run()` returns on Shutdown, SIGTERM or parent death."""

    def __init__(self, engine, input_sock, output_sock, parent_pid: Optional[int]) -> None:
        import zmq
        self._zmq = zmq
        self.engine = engine
        self.input = input_sock
        self.output = output_sock
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(input_sock, zmq.POLLIN)
        # Requests whose first update (carrying their queue time) has not gone out yet.
        self._unreported: Dict[str, Any] = {}
        self.request_stats = RequestStats()
        self._histograms_sent, self._histograms_time = 0, 0.0  # the version and time of the last sent
        self._stats_dirty = True
        self._last_stats = 0.0
        self._shutdown = False

    def stats(self, fresh: bool = False) -> Dict[str, Any]:
        """The snapshot the front end's /metrics reads. The histograms (bucket counts, the bulk of it) ride along
        when they changed, at most every HISTOGRAM_INTERVAL_S while busy (the front end keeps the last ones it got),
        and always when `fresh`: the idle loop sends a fresh snapshot once the last step's went out stale."""
        e = self.engine
        bm = e.block_manager
        out = {"running": e.scheduler.num_running, "waiting": e.scheduler.num_waiting,
               "kv_usage": bm.usage, "prefix_queries": bm.prefix_queries, "prefix_hits": bm.prefix_hits,
               "preemptions": e.scheduler.num_preemptions_total,
               "prompt_tokens": e.num_prompt_tokens_total,
               "generation_tokens": e.num_generation_tokens_total, "time": time.time()}
        rs, now = self.request_stats, time.monotonic()
        if rs.version != self._histograms_sent and (fresh or now - self._histograms_time >= HISTOGRAM_INTERVAL_S):
            out["histograms"] = rs.snapshot()
            self._histograms_sent, self._histograms_time = rs.version, now
        if getattr(e.runner, "proposes_drafts", False):
            out["spec_decode"] = e.spec_stats.as_dict()
        return out

    def _send(self, msg: Message) -> None:
        try:
            self.output.send(msg.encode(), flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            pass  # nobody listening: the front end is gone and the parent check ends us

    def _parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def _handle(self, msg: Message) -> None:
        e = self.engine
        if isinstance(msg, AddRequest):
            try:
                params = decode_sampling_params(msg.sampling_params)
                req = e.add_request(msg.request_id, list(msg.prompt_token_ids), params)
                self._unreported[msg.request_id] = req
                self.request_stats.on_add(msg.request_id, len(msg.prompt_token_ids))
            except (ValueError, TypeError) as err:
                self._send(RequestFailed(msg.request_id, str(err)))
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                e.abort_request(rid)
                self._unreported.pop(rid, None)
                self.request_stats.on_end(rid)
        elif isinstance(msg, FinishRequests):
            for rid in msg.request_ids:
                e.finish_request(rid)
                self._unreported.pop(rid, None)
                self.request_stats.on_end(rid)
        elif isinstance(msg, Shutdown):
            self._shutdown = True
        else:
            logger.warning("engine core: unexpected message %s", type(msg).__name__)
        self._stats_dirty = True

    def _drain_input(self, timeout_ms: int) -> None:
        zmq = self._zmq
        if not self.poller.poll(timeout_ms):
            return
        while True:
            try:
                data = self.input.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle(decode_message(data))
            except ProtocolError as err:
                logger.error("engine core: dropped a bad message: %s", err)

    def _updates(self, updates) -> List[list]:
        out = []
        first_scheduled: Dict[str, Optional[float]] = {}
        for u in updates:
            queue_time = None
            req = self._unreported.pop(u.request_id, None)
            if req is not None and req.first_scheduled_time is not None:
                queue_time = req.first_scheduled_time - req.arrival_time
                first_scheduled[u.request_id] = req.first_scheduled_time
            if u.finished:
                self._unreported.pop(u.request_id, None)
            out.append([u.request_id, u.new_token_ids, u.new_logprobs, u.finished, u.finish_reason,
                        u.stop_reason, u.num_prompt_tokens, u.num_cached_tokens, queue_time,
                        u.prompt_logprobs])
        self.request_stats.on_step(self.engine.last_step_num_tokens, updates, time.monotonic(), first_scheduled)
        return out

    def run(self) -> None:
        while not self._shutdown:
            busy = self.engine.has_unfinished_requests()
            self._drain_input(0 if busy or self._stats_dirty else IDLE_POLL_MS)
            if self._shutdown or not self._parent_alive():
                break
            if not busy:
                # A tensor-parallel worker that died while nothing ran ends the engine now, not at the next
                # request (engine/executor_mp.py); raises into run_engine_core's EngineDead.
                self.engine.check_health()
            if self.engine.has_unfinished_requests():
                updates = self.engine.step()
                out = self._updates(updates)
                # The step that leaves the engine idle carries fresh histograms with its running = 0.
                self._send(Outputs(out, self.stats(fresh=not self.engine.has_unfinished_requests())))
                self._stats_dirty = self.request_stats.version != self._histograms_sent
                self._last_stats = time.monotonic()
            elif self._stats_dirty or time.monotonic() - self._last_stats > IDLE_POLL_MS / 1000:
                # Idle: say so (aborts changed the counts) and serve as a heartbeat.
                self._send(Stats(self.stats(fresh=True)))
                self._stats_dirty = False
                self._last_stats = time.monotonic()


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the parent exits (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except Exception:  # best effort: the getppid() check still ends us
        pass


def _set_cpu_threads(device: str) -> None:
    import torch
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        try:
            ncpu = len(os.sched_getaffinity(0))
        except AttributeError:
            ncpu = os.cpu_count() or 1
        # Leave one core to the HTTP process, which detokenizes while we step.
        torch.set_num_threads(max(1, ncpu - 1))


def run_engine_core(spec: Dict[str, Any]) -> int:
    """spec: {"input_addr", "output_addr", "parent_pid", "model", "engine_args"[, "eos_token_ids"]}.

    engine_args are EngineConfig.create's keyword arguments; without eos_token_ids the core reads
    them from the checkpoint and its tokenizer, as the offline LLM does."""
    import zmq

    _die_with_parent()
    parent_pid = spec.get("parent_pid")
    if parent_pid is not None and os.getppid() != parent_pid:
        return 1  # the parent died before we could ask to follow it
    # Ctrl-C in a terminal reaches the whole process group: the server shuts us down, in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_term(signum, frame):
        # SIGTERM comes from a dead parent (PR_SET_PDEATHSIG) or from a server whose orderly
        # Shutdown message went unanswered: leave at once. Raising SystemExit instead can land in a
        # spot that swallows it (a finalizer) or hang in interpreter teardown (zmq, torch threads).
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)

    logging.basicConfig(level=envs.get().log_level,
                        format="%(levelname)s %(asctime)s [engine core] %(message)s")
    ctx = zmq.Context(io_threads=1)
    inp = ctx.socket(zmq.PULL)
    out = ctx.socket(zmq.PUSH)
    for s in (inp, out):
        s.setsockopt(zmq.LINGER, 1000)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    inp.bind(spec["input_addr"])
    out.bind(spec["output_addr"])
    try:
        try:
            from gyrfalcon.config import EngineConfig
            from gyrfalcon.engine.engine import Engine, freeze_gc_after_startup
            from gyrfalcon.runner.model_runner import start_device_init

            ea = spec["engine_args"]
            # (worker processes make their own)
            if ea.get("tensor_parallel_size", 1) == ea.get("pipeline_parallel_size", 1) == 1:
                start_device_init(spec["engine_args"].get("device", "auto"))  # overlaps the config and tokenizer
            config = EngineConfig.create(spec["model"], **spec["engine_args"])
            _set_cpu_threads(config.device)
            eos = spec.get("eos_token_ids")
            if eos is None:
                from gyrfalcon.tokenizer import load_tokenizer
                mc = config.model_config
                eos = mc.eos_token_ids(load_tokenizer(mc.tokenizer_path, mc.trust_remote_code).eos_token_id)
            engine = Engine(config, eos)
            freeze_gc_after_startup(default=True)  # this process serves one engine (engine.py)
        except BaseException as err:  # noqa: BLE001: the front end must hear why
            if isinstance(err, (ValueError, FileNotFoundError)):  # bad settings: the message says it all
                logger.error("engine core failed to start: %s", err)
            else:
                logger.error("engine core failed to start:\n%s", traceback.format_exc())
            out.send(StartupFailed(f"{type(err).__name__}: {err}").encode())
            return 1
        out.send(Ready(os.getpid(), engine.block_manager.num_blocks, engine.block_manager.block_size,
                       engine.max_model_len).encode())
        logger.info("engine core ready (pid %d, %d KV blocks of %d tokens, max_model_len=%d)",
                    os.getpid(), engine.block_manager.num_blocks, engine.block_manager.block_size,
                    engine.max_model_len)
        core = EngineCoreProc(engine, inp, out, parent_pid)
        try:
            core.run()
        except SystemExit:
            raise
        except BaseException as err:  # noqa: BLE001
            logger.error("engine core died:\n%s", traceback.format_exc())
            core._send(EngineDead(f"{type(err).__name__}: {err}"))
            return 1
        finally:
            engine.shutdown()  # tensor-parallel workers, if any
        return 0
    finally:
        inp.close(linger=0)
        out.close(linger=500)
        ctx.term()


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m gyrfalcon.engine.core_process '<json spec>'", file=sys.stderr)
        return 2
    try:
        return run_engine_core(json.loads(argv[0]))
    except SystemExit as e:
        return int(e.code or 0)


if __name__ == "__main__":
    code = main()
    # Sockets are closed; skip the slow final garbage collection of torch's objects.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
