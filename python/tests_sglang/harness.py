"""The tests' view of the engine processes (`engine.py`): start one per role against a gateway pair,
call it, kill it; and the `KVPoll` values."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
#: Slack on top of a configured bound on a loaded 2-core machine.
GRACE_S = 3.0
#: How long an engine may take to start (imports torch and SGLang).
START_TIMEOUT_S = 90.0

FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = 0, 1, 2, 3, 4
POLL_NAMES = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}

#: A tiny Llama configuration: what SGLang's `ServerArgs` resolution reads of a model.
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}


def write_tiny_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_MODEL))
    return folder


class EngineError(RuntimeError):
    pass


class Engine:
    """One `engine.py` process."""

    def __init__(self, role: str, socket: str, model: Path, bootstrap_port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.role = role
        self.log_path = log
        environment = dict(os.environ)
        environment.update(
            {
                "KVGATE_ENGINE_API": socket,
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "python"), environment.get("PYTHONPATH", "")) if p),
            }
        )
        environment.update(env or {})
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "engine.py"), role, str(model), str(bootstrap_port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=environment,
        )
        self._lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello: dict[str, Any] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(b"")

    def _answer(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"{self.role} engine gave no answer within {timeout} s\n{self.log()}") from None
        if not line:
            raise EngineError(f"{self.role} engine exited ({self.proc.poll()})\n{self.log()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        self.hello = self._answer(timeout)
        assert self.hello.get("ready"), self.hello

    def call(self, op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        answer = self._answer(timeout)
        if not answer.get("ok"):
            raise EngineError(f"{self.role} {op}: {answer.get('error')}\n{answer.get('trace', '')}")
        return answer

    def poll(self, room: int) -> int:
        value: int = self.call("poll", room=room)["poll"]
        return value

    def wait_poll(self, room: int, states: set[int], within: float, what: str = "") -> tuple[int, float]:
        """Poll until the room is in one of `states`; (state, seconds it took)."""
        started = time.monotonic()
        while True:
            state = self.poll(room)
            if state in states:
                return state, time.monotonic() - started
            if time.monotonic() - started > within:
                raise AssertionError(f"{self.role} room {room} still {POLL_NAMES.get(state)} after {within} s {what}")
            time.sleep(0.02)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=10)
            except (EngineError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


@dataclass
class Engines:
    prefill: Engine
    decode: Engine

    def transfer(
        self,
        room: int,
        pages_src: list[int],
        pages_dst: list[int],
        aux_src: int,
        aux_dst: int,
        chunks: list[int] | None = None,
        prefix: int = 0,
        within: float = 20.0,
    ) -> None:
        """One request through SGLang's sequence of calls: decode receiver and its metadata, prefill
        sender bootstrapped, chunks sent, both sides polled to Success."""
        self.decode.call("new_receiver", room=room)
        self.prefill.call("new_sender", room=room)
        self.decode.call("send_metadata", room=room, pages=pages_dst, aux=aux_dst, prefix=prefix)
        self.prefill.wait_poll(room, {WAITING}, within, "(bootstrap)")
        assert self.prefill.call("pop_prefix", room=room)["prefix"] == prefix
        self.prefill.call("init", room=room, pages=len(pages_src), aux=aux_src)
        bounds = chunks or [len(pages_src)]
        start = 0
        for end in bounds:
            self.prefill.call("send", room=room, pages=pages_src[start:end])
            start = end
        state, _ = self.prefill.wait_poll(room, {SUCCESS, FAILED}, within, "(prefill outcome)")
        assert state == SUCCESS, self.prefill.call("failure", room=room)
        state, _ = self.decode.wait_poll(room, {SUCCESS, FAILED}, within, "(decode outcome)")
        assert state == SUCCESS, self.decode.call("failure", room=room)


def wait_until(condition: Callable[[], bool], within: float, what: str, step: float = 0.05) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"not within {within} s: {what}")
        time.sleep(step)
    return time.monotonic() - started
