"""Processes for the SDK's tests: the built `brigade` binary (``BRIGADE_BIN``, default
``target/debug/brigade``) started as a real cluster on loopback. Every wait is bounded, and
every process group started here is killed when its fixture ends, whether the tests passed or
failed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

from brigade_client import Client, ClientConfig

REPO = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("BRIGADE_BIN", REPO / "target" / "debug" / "brigade"))
SMOLLM2 = Path(
    os.environ.get("BRIGADE_SMOLLM2", REPO / "target" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
)


def clean_env() -> dict[str, str]:
    """The environment without a client config or cluster settings of the caller's."""
    env = dict(os.environ)
    for k in ("BRIGADE_CONFIG", "BRIGADE_COORDINATOR", "BRIGADE_CA", "BRIGADE_API_KEY", "BRIGADE_API_KEYS"):
        env.pop(k, None)
    return env


def brigade(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Runs the binary to completion; fails the test with its stderr when it fails."""
    assert BIN.is_file(), f"{BIN} does not exist: build it (cargo build -p brigade-cli) or set BRIGADE_BIN"
    r = subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=timeout, env=clean_env())
    assert r.returncode == 0, f"brigade {' '.join(args)} exited {r.returncode}:\n{r.stderr}"
    return r


def brigade_json(*args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(brigade(*args).stdout)
    return out


def reference(prompt: str, n: int, *extra: str) -> dict[str, Any]:
    """`brigade run` greedy in one process (`generated_ids`, `text`, `prompt_ids`)."""
    return brigade_json("run", "-p", prompt, "-n", str(n), "--temp", "0", "--json", *extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(what: str, timeout: float, check: Callable[[], bool], proc: Optional["Proc"] = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.popen.poll() is not None:
            pytest.fail(f"{proc.name} exited ({proc.popen.returncode}) while waiting for {what}:\n{proc.log_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals the whole process group (the process and any children it started)."""
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


@dataclass
class Procs:
    """Processes started in their own process groups, all killed by :meth:`kill_all`."""

    dir: Path
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, name: str, *args: str) -> Proc:
        assert BIN.is_file(), f"{BIN} does not exist: build it (cargo build -p brigade-cli) or set BRIGADE_BIN"
        log = self.dir / f"{name}.log"
        with open(log, "ab") as out:
            env = clean_env()
            env.setdefault("RUST_LOG", "info")
            popen = subprocess.Popen(
                [str(BIN), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        p = Proc(name, popen, log)
        self.procs.append(p)
        return p

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.log_text()[-4000:]}" for p in self.procs)

    def kill_all(self) -> None:
        for p in self.procs:
            p.kill()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.kill_all()


@dataclass
class LocalCluster:
    """A running `brigade cluster local`: its client config, and the data dir of its processes."""

    config: Path
    data: Path
    proc: Proc

    def client(self) -> Client:
        return Client.from_config(ClientConfig.from_file(self.config))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """`brigade cluster local --workers 2` with the embedded model deployed as `stories`."""
    d = tmp_path_factory.mktemp("cluster")
    ps = Procs(d)
    try:
        p = ps.spawn(
            "cluster-local",
            "cluster",
            "local",
            "--workers",
            "2",
            "--data-dir",
            str(d / "data"),
            "--client-config",
            str(d / "client.toml"),
        )
        wait_until("`cluster ready`", 180, lambda: "cluster ready" in p.log_text(), p)
        yield LocalCluster(d / "client.toml", d / "data", p)
    finally:
        ps.kill_all()


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    with cluster.client() as c:
        yield c
