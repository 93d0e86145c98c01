"""AsyncEngineClient: the HTTP process's handle on the engine core process.

It starts the core (`python -m gyrfalcon.engine.core_process`), connects to its two ZeroMQ sockets,
and runs one asyncio task that receives step outputs and feeds them through the OutputProcessor
(detokenization, stop strings, n > 1 fan-out). Each API call registers an asyncio.Queue; the task
puts every RequestState it touched into the queue of that request, and the handler reads text,
deltas and logprobs from the state. Sends are non-blocking (an unbounded ZeroMQ queue), so no
handler ever waits on the engine, and aborts can be sent from a `finally` that runs under
cancellation (a client that went away).

A second task watches the core's process: when it exits (or reports EngineDead) every pending
request fails with EngineDeadError and later calls fail at once, which the API turns into 503s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Set

import zmq
import zmq.asyncio

from gyrfalcon.engine.core_process import (AbortRequests, AddRequest, EngineDead, FinishRequests, Outputs,
                                           ProtocolError, Ready, RequestFailed, Shutdown, StartupFailed,
                                           Stats, decode_message, encode_sampling_params)
from gyrfalcon.engine.scheduler import RequestUpdate
from gyrfalcon.output_processor import OutputProcessor, RequestState
from gyrfalcon.sampling_params import SamplingParams

logger = logging.getLogger("gyrfalcon.server")


class EngineDeadError(RuntimeError):
    """The engine core process is gone (or going); nothing more can be generated."""

    def __init__(self, message: str, code: str = "engine_dead") -> None:
        super().__init__(message)
        self.code = code


class RequestRejected(ValueError):
    """The engine core refused a request (it failed validation there)."""


class AsyncEngineClient:
    def __init__(self, model: str, engine_args: Dict[str, Any]) -> None:
        """The core builds its own EngineConfig from (model, engine_args), the same as this side."""
        self.model = model
        self.engine_args = engine_args
        self.metrics = None
        # Streams read text as it grows; a non-streaming call reads it once at the end, so its text
        # (without stop strings) is decoded once instead of token by token.
        self.processor: Optional[OutputProcessor] = None
        self.deferred: Optional[OutputProcessor] = None
        self._proc_of: Dict[str, OutputProcessor] = {}
        self.proc: Optional[subprocess.Popen] = None
        self.core_pid: Optional[int] = None
        self.num_blocks = 0
        self.dead_reason: Optional[str] = None
        self.stats: Dict[str, Any] = {"running": 0, "waiting": 0, "kv_usage": 0.0, "prefix_queries": 0,
                                      "prefix_hits": 0, "preemptions": 0}
        self._queues: Dict[str, asyncio.Queue] = {}
        # Engine ids that a stop string ended here: the core may still send a step for them before
        # it reads FinishRequests, and those tokens must not reach the (finished) sample.
        self._stopped: Set[str] = set()
        self._recorded: Set[str] = set()  # finished samples already counted in the metrics
        self._started: Set[str] = set()  # requests whose first token arrived
        self._tasks: List[asyncio.Task] = []
        self._tmpdir: Optional[str] = None
        self._input_addr = self._output_addr = ""
        self._ctx = None
        self._in = None
        self._out = None
        self._closing = False
        # Called once, with the reason, when the core dies while the server runs (the server decides whether to
        # exit: api_server.ServerState).
        self.on_dead: Optional[Callable[[str], None]] = None

    # ---- lifecycle --------------------------------------------------------------------------------
    def set_tokenizer(self, tokenizer, metrics=None) -> None:
        self.processor = OutputProcessor(tokenizer)
        self.deferred = OutputProcessor(tokenizer, defer_text=True)
        self.metrics = metrics

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def launch(self) -> None:
        """Start the core process now (it loads the model while this process sets itself up)."""
        self._tmpdir = tempfile.mkdtemp(prefix="gyrfalcon-")
        self._input_addr = f"ipc://{self._tmpdir}/input"
        self._output_addr = f"ipc://{self._tmpdir}/output"
        spec = {"input_addr": self._input_addr, "output_addr": self._output_addr, "parent_pid": os.getpid(),
                "model": self.model, "engine_args": self.engine_args}
        env = dict(os.environ)
        # The core must import the same gyrfalcon as this process, wherever it was found.
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "gyrfalcon.engine.core_process", json.dumps(spec)],
                                     env=env, stdin=subprocess.DEVNULL)

    def kill(self) -> None:
        """Synchronous last resort (startup failed before the event loop ran)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    async def start(self, startup_timeout: float = 1800.0) -> None:
        """Connect to the launched core and wait until it has loaded the model."""
        if self.proc is None:
            self.launch()
        self._ctx = zmq.asyncio.Context(io_threads=1)
        # Input is a plain socket: a send never blocks (unbounded queue) and needs no await, so it
        # works from synchronous code and from a cancelled handler's cleanup.
        self._in = zmq.Context.instance().socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        for s in (self._in, self._out):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        self._in.connect(self._input_addr)
        self._out.connect(self._output_addr)

        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"The engine core exited during startup (exit code {self.proc.returncode}).")
            if time.monotonic() > deadline:
                raise RuntimeError(f"The engine core did not start within {startup_timeout:.0f} s.")
            if await self._out.poll(200):
                msg = decode_message(await self._out.recv())
                if isinstance(msg, StartupFailed):
                    raise RuntimeError(f"The engine core failed to start: {msg.error}")
                if isinstance(msg, Ready):
                    self.core_pid, self.num_blocks = msg.pid, msg.num_blocks
                    break
        self._tasks = [asyncio.create_task(self._output_loop(), name="gyrfalcon-engine-outputs"),
                       asyncio.create_task(self._watch_process(), name="gyrfalcon-engine-watch")]

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core (Shutdown, then SIGTERM, then SIGKILL) and close everything."""
        self._closing = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            self._send(Shutdown())
            deadline = time.monotonic() + timeout / 2
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                proc.terminate()
                deadline = time.monotonic() + timeout / 2
                while proc.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self.fail_all_requests()
        for s in (self._in, self._out):
            if s is not None:
                s.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _mark_dead(self, reason: str) -> None:
        first = self.dead_reason is None
        if first:
            self.dead_reason = reason
            if not self._closing:
                logger.error("%s Generation requests now get HTTP 503.", reason)
        self._fail_all(EngineDeadError(reason))
        if first and not self._closing and self.on_dead is not None:
            self.on_dead(reason)

    def fail_all_requests(self, message: str = "The server is shutting down.") -> None:
        """End every request in flight with a 503 (streams: an error event, then [DONE])."""
        for rid in list(self._queues):
            q = self._queues.get(rid)
            self.abort(rid)
            if q is not None:
                q.put_nowait(EngineDeadError(message, code="server_shutting_down"))

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def _fail_all(self, err: Exception) -> None:
        queues, self._queues = self._queues, {}
        for rid, q in queues.items():
            self._processor(rid).abort(rid)
            q.put_nowait(err)
        self._proc_of.clear()
        self._stopped.clear()
        self._started.clear()
        self._recorded.clear()

    async def _watch_process(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            rc = self.proc.poll()
            if rc is not None:
                self._mark_dead(f"The engine core process (pid {self.proc.pid}) exited with code {rc}.")
                return

    # ---- requests ---------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        self._send_bytes(msg.encode())

    def _send_bytes(self, data: bytes) -> None:
        try:
            self._in.send(data, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # cannot happen with an unbounded queue; be loud if it does
            self._mark_dead(f"Could not reach the engine core: {e}.")
            raise EngineDeadError(self.dead_reason) from None

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int],
                    params: SamplingParams, queue: asyncio.Queue, arrival_time: Optional[float] = None,
                    stream: bool = True) -> RequestState:
        """Submit one prompt (its n samples); updates of its RequestState go to `queue`.
        stream=False: the caller reads the text only once the request has finished."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        proc = self.processor if stream else self.deferred
        pairs = proc.add_request(request_id, prompt, prompt_token_ids, params, arrival_time)
        self._proc_of[request_id] = proc
        self._queues[request_id] = queue
        state = proc.requests[request_id]
        try:
            try:
                msgs = [AddRequest(eid, list(prompt_token_ids), encode_sampling_params(child)).encode()
                        for eid, child in pairs]
            except (OverflowError, TypeError, ValueError) as e:  # e.g. an integer past 64 bits
                raise RequestRejected(f"A request value cannot be encoded: {e}.") from None
            for data in msgs:
                self._send_bytes(data)
        except (EngineDeadError, RequestRejected):
            self._queues.pop(request_id, None)
            self._proc_of.pop(request_id, None)
            proc.abort(request_id)
            raise
        return state

    def abort(self, request_id: str) -> None:
        """Forget a request and stop it in the engine (a no-op once it finished)."""
        self._queues.pop(request_id, None)
        proc = self._processor(request_id)
        state = proc.requests.get(request_id)
        eids = proc.abort(request_id)
        if state is not None:
            for s in state.samples:
                self._record_sample(state, s)
            self._forget(state)
        if eids and self.dead_reason is None:
            try:
                self._send(AbortRequests(eids))
            except EngineDeadError:
                pass

    # ---- outputs ----------------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            data = await self._out.recv()
            try:
                msg = decode_message(data)
            except ProtocolError as e:
                logger.error("Dropped a bad message from the engine core: %s", e)
                continue
            try:
                if isinstance(msg, Outputs):
                    self.stats = {**self.stats, **msg.stats}  # the histograms come only when they changed
                    self._handle_outputs(msg.updates)
                elif isinstance(msg, Stats):
                    self.stats = {**self.stats, **msg.stats}
                elif isinstance(msg, RequestFailed):
                    self._handle_failed(msg)
                elif isinstance(msg, EngineDead):
                    self._mark_dead(f"The engine core failed: {msg.error}")
                    return
            except Exception:  # a bug here must not silently stop all output
                logger.exception("Error while processing engine outputs")

    def _handle_failed(self, msg: RequestFailed) -> None:
        for rid, q in list(self._queues.items()):
            st = self._processor(rid).requests.get(rid)
            if st is not None and any(s.engine_id == msg.request_id for s in st.samples):
                self.abort(rid)
                q.put_nowait(RequestRejected(msg.error))

    def _handle_outputs(self, raw_updates: List[list]) -> None:
        updates = []
        for u in raw_updates:
            eid = u[0]
            if eid in self._stopped:
                if u[3]:
                    self._stopped.discard(eid)
                continue
            if u[8] is not None and self.metrics is not None:
                self.metrics.observe_queue_time(u[8])
            updates.append(RequestUpdate(request_id=eid, new_token_ids=u[1], new_logprobs=u[2],
                                         finished=u[3], finish_reason=u[4], stop_reason=u[5],
                                         num_prompt_tokens=u[6], num_cached_tokens=u[7],
                                         prompt_logprobs=u[9]))
        # Each processor skips the engine ids it does not track.
        touched, to_finish = self.processor.process(updates)
        touched2, to_finish2 = self.deferred.process(updates)
        touched += touched2
        to_finish += to_finish2
        if to_finish:
            self._stopped.update(to_finish)
            self._send(FinishRequests(to_finish))
        if self.metrics is not None:
            self.metrics.add_generation_tokens(sum(len(u.new_token_ids) for u in updates))
        for st in touched:
            if st.request_id not in self._started:
                self._started.add(st.request_id)
                if self.metrics is not None:
                    self.metrics.on_first_token(st)
            for s in st.samples:
                if s.finished:
                    self._record_sample(st, s)
            q = self._queues.get(st.request_id)
            if st.finished:
                self._forget(st)
                if self.metrics is not None:
                    self.metrics.on_request_finished(st)
            if q is not None:
                q.put_nowait(st)

    def _processor(self, request_id: str) -> OutputProcessor:
        return self._proc_of.get(request_id, self.processor)

    def _record_sample(self, st: RequestState, s) -> None:
        """Count a finished (or aborted) sample in the metrics, once."""
        if s.engine_id not in self._recorded:
            self._recorded.add(s.engine_id)
            if self.metrics is not None:
                self.metrics.on_sample_finished(st, s)

    def _forget(self, st: RequestState) -> None:
        """Drop the per-request bookkeeping of a request that ended."""
        self._queues.pop(st.request_id, None)
        self._proc_of.pop(st.request_id, None)
        self._started.discard(st.request_id)
        for s in st.samples:
            self._stopped.discard(s.engine_id)
            self._recorded.discard(s.engine_id)
