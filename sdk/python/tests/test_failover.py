"""Resume on failover: a group of three coordinator replicas and one worker, a model slow
enough (about 10 ms a token on one thread) that the replica relaying the stream — the leader —
can be killed mid-generation. The SDK's stream must end with exactly the ids of an undisturbed
`brigade run`: no gap, no repeat."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any, Optional

from conftest import BIN, Procs, brigade, brigade_json, clean_env, free_port, wait_until

from brigade_client import Client, DoneEvent, PromptEvent, TokenEvent

TOKENS = 100
KILL_AFTER = 10
PROMPT = "Once upon a time"


def status(addrs: str, ca: Path) -> Optional[dict[str, Any]]:
    """`brigade status --json` from any replica that answers, or None."""
    r = subprocess.run(
        [str(BIN), "status", "--json", "--coordinator", addrs, "--ca", str(ca)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    if r.returncode != 0:
        return None
    try:
        out: dict[str, Any] = json.loads(r.stdout)
        return out
    except json.JSONDecodeError:
        return None


def test_the_leader_dies_mid_stream_and_the_stream_goes_on(procs: Procs, tmp_path: Path) -> None:
    model = tmp_path / "slow.gguf"
    brigade(
        "synth", "-o", str(model), "--layers", "6", "--hidden", "512", "--ffn", "1536",
        "--heads", "8", "--kv-heads", "8", "--vocab", "512", "--type", "f32",
    )  # fmt: skip
    want = brigade_json(
        "run", "-m", str(model), "-p", PROMPT, "-n", str(TOKENS), "--temp", "0", "--ignore-eos", "--json"
    )["generated_ids"]
    assert len(want) == TOKENS

    # a group bootstrapped together: the CA and token made once, copied to each replica
    token = "brg1-" + secrets.token_hex(24)
    dirs = [tmp_path / f"coordinator-{i}" for i in (1, 2, 3)]
    brigade("coordinator", "init", "--data-dir", str(dirs[0]), "--join-token", token)
    for d in dirs[1:]:
        d.mkdir()
        for f in ("ca.pem", "ca.key", "token", "replica-token"):
            shutil.copy(dirs[0] / f, d / f)
    ports = [free_port() for _ in dirs]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    peers = ",".join(f"{i}={a}" for i, a in enumerate(addrs, 1))
    replicas = {}
    for i, (d, a) in enumerate(zip(dirs, addrs), 1):
        replicas[a] = procs.spawn(
            f"coordinator-{i}",
            "coordinator", "--id", str(i), "--peers", peers, "--listen", a, "--data-dir", str(d),
            "--node-timeout", "2", "--raft-tick-ms", "50",
        )  # fmt: skip
    ca = dirs[0] / "ca.pem"
    joined = ",".join(addrs)
    leader: dict[str, str] = {}

    def has_leader() -> bool:
        s = status(joined, ca)
        leader["address"] = (s or {}).get("raft", {}).get("leader_address", "")
        return bool(leader["address"])

    wait_until("a coordinator leader", 60, has_leader)
    w = tmp_path / "w1"
    procs.spawn(
        "w1",
        "worker", "--coordinator", joined, "--listen", "127.0.0.1:0", "--name", "w1",
        "--join-token", token, "--data-dir", str(w), "--models-dir", str(w / "m"), "-t", "1",
        "--measure", "quick",
    )  # fmt: skip

    def worker_up() -> bool:
        s = status(joined, ca)
        return any(n.get("state") == "up" for n in (s or {}).get("nodes", []))

    wait_until("w1 to be up", 120, worker_up)
    deployed = brigade_json(
        "deploy", "--json", "--coordinator", joined, "--ca", str(ca), "-m", str(model), "--name", "m",
        "--device-map", "w1:cpu:6", "--ctx", "256",
    )  # fmt: skip
    assert deployed["state"] == "ready", deployed
    # the leader may have changed while the worker joined: ask again
    wait_until("a coordinator leader", 60, has_leader)
    first = leader["address"]
    assert first in replicas, f"leader {first} is none of {addrs}"

    # the client talks to the leader first: its stream is the one that breaks
    endpoints = [first] + [a for a in addrs if a != first]
    with Client(endpoints, ca=ca) as client:
        g = client.generate("m", PROMPT, max_tokens=TOKENS, temperature=0, ignore_eos=True)
        assert client.address == first
        events = []
        for ev in g.events():
            events.append(ev)
            if isinstance(ev, TokenEvent) and ev.index + 1 == KILL_AFTER:
                os.kill(replicas[first].popen.pid, signal.SIGKILL)
        assert g.resumes >= 1, "the stream was not broken by the kill: nothing was tested"
        assert client.address != first
    assert g.ids == want, f"the ids differ from an undisturbed run\n{procs.logs()}"
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.index for t in tokens] == list(range(TOKENS)), "a gap or a repeat in the stream"
    assert sum(isinstance(e, PromptEvent) for e in events) == 1, "the prompt event came once"
    assert isinstance(events[-1], DoneEvent) and events[-1].stop == "length"
