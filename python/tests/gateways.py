"""Real `kvgate serve` processes for the tests: configs written by one function (`write_config`) into a
work folder on /dev/shm, free ports, readiness awaited on the admin listener, SIGKILL / SIGSTOP /
restart for fault injection, and every process killed at teardown."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: How long a started gateway may take to answer on its admin listener with its peers up.
READY_TIMEOUT_S = 20.0
#: Lowest port picked; below the kernel's ephemeral range so an outgoing connection cannot take it first.
PICKED_PORT_MIN = 10_000


def kvgate_binary() -> Path:
    env = os.environ.get("KVGATE_BIN")
    if env:
        return Path(env)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return target / "release" / "kvgate"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on 127.0.0.1 now (picked at random below the ephemeral range)."""
    low = _ephemeral_low()
    for _ in range(64):
        if low <= PICKED_PORT_MIN:
            break
        port = random.randrange(PICKED_PORT_MIN, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        kernel_pick: int = s.getsockname()[1]
        return kernel_pick


@lru_cache(maxsize=1)
def keygen_supported() -> bool:
    """Whether this kvgate has `keygen` (peer links authenticated with a pre-shared key)."""
    try:
        done = subprocess.run([str(kvgate_binary()), "keygen", "--help"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@lru_cache(maxsize=1)
def config_keys() -> frozenset[str]:
    """`section.key` of every key this kvgate's config knows (`kvgate config default`)."""
    done = subprocess.run([str(kvgate_binary()), "config", "default"], capture_output=True, text=True, timeout=30, check=True)
    keys, section = set(), ""
    for line in done.stdout.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line.strip("[]")
        elif "=" in line:
            keys.add(f"{section}.{line.split('=', 1)[0].strip()}")
    return frozenset(keys)


def peer_auth_lines(workdir: Path) -> str:
    """The `[peer_link]` keys that authenticate the links between the test gateways: a pre-shared key
    made once per work folder when this kvgate can make one, else nothing."""
    if not keygen_supported():
        return ""
    key = workdir / "peer.key"
    if not key.exists():
        subprocess.run([str(kvgate_binary()), "keygen", "psk", str(key)], check=True, capture_output=True, timeout=30)
    return f'auth = "psk"\npsk_file = "{key}"\n'


@dataclass
class Settings:
    """What a test may change in the generated configs."""

    heartbeat_interval_ms: int = 100
    heartbeat_misses: int = 5
    bootstrap_timeout_ms: int = 2000
    room_timeout_ms: int = 10000
    transfer_base_ms: int = 2000
    quarantine_timeout_ms: int = 3000
    watch_buffer_events: int = 4096
    #: Written only where this kvgate has the key (engine API v2).
    watch_replay_events: int | None = None
    session_grace_ms: int | None = 1000
    #: Serve the engine API over TCP too, with a bearer token.
    tcp: bool = False
    #: Extra `KVGATE__SECTION__KEY` environment of every gateway.
    env: dict[str, str] = field(default_factory=dict)

    @property
    def peer_loss_bound_s(self) -> float:
        return self.heartbeat_interval_ms * self.heartbeat_misses / 1000.0


@dataclass
class Ports:
    peer: int
    admin: int
    tcp: int


def write_config(workdir: Path, name: str, ports: Ports, peers: dict[str, int], settings: Settings) -> Path:
    """The config of test gateway `name` (the one place test configs are written)."""
    sock = workdir / f"{name}.sock"
    engine_api = f'unix_socket = "{sock}"\nwatch_buffer_events = {settings.watch_buffer_events}\n'
    for key, value in (("watch_replay_events", settings.watch_replay_events), ("session_grace_ms", settings.session_grace_ms)):
        if value is not None and f"engine_api.{key}" in config_keys():
            engine_api += f"{key} = {value}\n"
    if settings.tcp:
        token = workdir / f"{name}.token"
        token.write_text(f"token-of-{name}\n")
        engine_api += f'tcp_listen = "127.0.0.1:{ports.tcp}"\nbearer_token_file = "{token}"\n'
    peer_tables = "".join(f'[[peers]]\nname = "{p}"\naddress = "127.0.0.1:{port}"\nsame_host = true\n\n' for p, port in peers.items())
    text = f"""# kvgate test gateway {name}
[gateway]
name = "{name}"

[engine_api]
{engine_api}
[peer_link]
listen = "127.0.0.1:{ports.peer}"
heartbeat_interval_ms = {settings.heartbeat_interval_ms}
heartbeat_misses = {settings.heartbeat_misses}
connect_timeout_ms = 1000
reconnect_interval_ms = 100
{peer_auth_lines(workdir)}
{peer_tables}[plugins]
preference = ["shm"]

[scheduler]
bootstrap_timeout_ms = {settings.bootstrap_timeout_ms}
room_timeout_ms = {settings.room_timeout_ms}
transfer_base_ms = {settings.transfer_base_ms}
quarantine_timeout_ms = {settings.quarantine_timeout_ms}

[admin]
listen = "127.0.0.1:{ports.admin}"

[driver]
io_threads = 1
"""
    path = workdir / f"{name}.toml"
    path.write_text(text)
    return path


class Gateway:
    """One `kvgate serve` process."""

    def __init__(self, workdir: Path, name: str, ports: Ports, config: Path, settings: Settings) -> None:
        self.workdir = workdir
        self.name = name
        self.ports = ports
        self.config = config
        self.settings = settings
        self.socket = str(workdir / f"{name}.sock")
        self.admin = f"127.0.0.1:{ports.admin}"
        self.tcp = f"127.0.0.1:{ports.tcp}" if settings.tcp else ""
        self.token = f"token-of-{name}" if settings.tcp else ""
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "info")
        env.update(self.settings.env)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [str(kvgate_binary()), "serve", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
            )
        finally:
            log.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL (after SIGCONT, should it be frozen) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def restart(self) -> None:
        """A new process with the same config (a new incarnation to its peers)."""
        self.kill()
        self.start()

    def get(self, path: str, timeout: float = 2.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=timeout) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode()

    def rooms_json(self) -> list[dict[str, Any]]:
        code, body = self.get("/rooms")
        assert code == 200, body
        rooms: list[dict[str, Any]] = json.loads(body)
        return rooms

    def metrics(self) -> str:
        return self.get("/metrics")[1]

    def wait_rooms_empty(self, within: float) -> list[dict[str, Any]]:
        """Wait (bounded) until `/rooms` lists no live room; the last listing."""
        deadline = time.monotonic() + within
        while True:
            rooms = self.rooms_json()
            if not rooms or time.monotonic() > deadline:
                return rooms
            time.sleep(0.05)

    def wait_ready(self, peers_up: bool = True, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise GatewayExited(self.name, self.proc.returncode, self.log())
            try:
                code, body = self.get("/plugins", timeout=1.0)
                if code == 200 and (not peers_up or '"up":false' not in body.replace(" ", "")) and os.path.exists(self.socket):
                    return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway {self.name} not ready within {timeout} s:\n{self.log()}")
            time.sleep(0.05)


class GatewayExited(RuntimeError):
    def __init__(self, name: str, code: int | None, log: str) -> None:
        super().__init__(f"gateway {name} exited ({code}) during start-up:\n{log}")
        self.log = log


class Cluster:
    """Gateways on this machine, each a static peer of every other."""

    def __init__(self, workdir: Path, names: list[str], settings: Settings) -> None:
        self.workdir = workdir
        self.settings = settings
        self.gateways: dict[str, Gateway] = {}
        for attempt in range(4):
            ports = {n: Ports(free_port(), free_port(), free_port()) for n in names}
            self.gateways = {}
            for n in names:
                peers = {p: ports[p].peer for p in names if p != n}
                config = write_config(workdir, n, ports[n], peers, settings)
                self.gateways[n] = Gateway(workdir, n, ports[n], config, settings)
            for g in self.gateways.values():
                g.start()
            try:
                for g in self.gateways.values():
                    g.wait_ready()
                return
            except GatewayExited as e:
                self.kill()
                if "in use" not in e.log or attempt == 3:
                    raise
                # A port was taken between picking and binding: pick again.

    def __getitem__(self, name: str) -> Gateway:
        return self.gateways[name]

    def kill(self) -> None:
        for g in self.gateways.values():
            g.kill()

    def stop(self) -> None:
        for g in self.gateways.values():
            g.stop()


PREFILL = "prefill"
DECODE = "decode"


class Pair(Cluster):
    """A prefill and a decode gateway, linked."""

    def __init__(self, workdir: Path, settings: Settings) -> None:
        super().__init__(workdir, [PREFILL, DECODE], settings)
        self.prefill = self.gateways[PREFILL]
        self.decode = self.gateways[DECODE]
