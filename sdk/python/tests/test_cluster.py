"""The SDK against a live `brigade cluster local`: greedy output equal to `brigade run`'s,
typed events and status, chat, deploy and undeploy, and the errors callers get."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMOLLM2, LocalCluster, Procs, brigade, free_port, reference, wait_until

from brigade_client import BrigadeError, Client, DoneEvent, PromptEvent, StatusCode, TokenEvent

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generate_equals_run(client: Client, prompt: str) -> None:
    want = reference(prompt, 24)
    g = client.generate("stories", prompt, max_tokens=24, temperature=0)
    pieces = list(g)
    assert g.ids == want["generated_ids"]
    assert g.prompt_ids == want["prompt_ids"]
    assert "".join(pieces) == want["text"] == g.text
    assert all(pieces), "no empty text pieces"
    assert g.done is not None and g.done.stop == "length"


def test_events_are_typed_and_in_order(client: Client) -> None:
    g = client.generate("stories", "Once upon a time", max_tokens=12, temperature=0)
    events = list(g.events())
    assert isinstance(events[0], PromptEvent) and events[0].ids == g.prompt_ids
    tokens = [e for e in events[1:-1] if isinstance(e, TokenEvent)]
    assert [t.index for t in tokens] == list(range(12)) and len(tokens) == len(events) - 2
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.timings is not None
    assert done.timings.generated_tokens == 12
    # one hop per stage: the deployment spans both workers
    assert sorted(h.node for h in done.timings.hops) == ["w1", "w2"]


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                   "maximum": 120}, "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


def test_structured_output_and_logprobs_through_the_cluster(client: Client) -> None:
    """A JSON schema or a grammar enforced on the last stage, at any temperature; each token's
    log-probability with its alternatives; a format that cannot be used is the caller's error."""
    import json

    import jsonschema

    for seed, temp in [(1, 0.0), (2, 0.8), (3, 1.2)]:
        g = client.generate("stories", "Once upon a time", max_tokens=200, temperature=temp, seed=seed,
                            json_schema=PERSON)
        text = "".join(g)
        assert g.done is not None and g.done.stop == "eos", (g.done, text)
        jsonschema.validate(json.loads(text), PERSON)
    g = client.generate("stories", "Answer:", max_tokens=20, temperature=1.0, seed=4,
                        grammar='%llguidance {}\nstart: ("yes" | "no") "!"\n')
    assert "".join(g) in ("yes!", "no!")
    g = client.generate("stories", "Once upon a time", max_tokens=8, temperature=0, logprobs=3)
    tokens = [e for e in g.events() if isinstance(e, TokenEvent)]
    assert len(tokens) == 8
    for t in tokens:
        assert t.logprob is not None and t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0] == (t.id, t.logprob), "greedy: the most likely id"
    plain = [e for e in client.generate("stories", "Once", max_tokens=2).events() if isinstance(e, TokenEvent)]
    assert all(t.logprob is None and t.top_logprobs == [] for t in plain)
    for bad in [dict(json_schema={"type": "strnig"}), dict(json_schema="{not json"),
                dict(grammar="start: nowhere"), dict(json_schema=PERSON, grammar="start: \"a\"")]:
        with pytest.raises(BrigadeError) as e:
            list(client.generate("stories", "Once", max_tokens=4, **bad))
        assert e.value.code == StatusCode.INVALID_ARGUMENT, (bad, e.value)
    with pytest.raises(BrigadeError):
        client.generate("stories", "Once", logprobs=21)


def test_seeded_sampling_repeats(client: Client) -> None:
    a = client.generate("stories", "Once upon a time", max_tokens=16, temperature=1.0, seed=7).result()
    b = client.generate("stories", "Once upon a time", max_tokens=16, temperature=1.0, seed=7)
    assert b.result() == a and b.seed == 7


def test_from_env_reads_the_client_config(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("BRIGADE_COORDINATOR", "BRIGADE_CA", "BRIGADE_API_KEY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("BRIGADE_CONFIG", str(cluster.config))
    with Client.from_env() as c:
        assert c.address in cluster.config.read_text()
        assert [m.name for m in c.list_models()] == ["stories"]


def test_status_shows_nodes_devices_and_stages(client: Client) -> None:
    s = client.status()
    assert s.protocol == 2
    assert sorted(n.name for n in s.nodes) == ["w1", "w2"]
    assert all(n.state == "up" and n.devices and n.devices[0].kind == "cpu" for n in s.nodes)
    assert all(n.devices[0].mem_bandwidth > 0 for n in s.nodes), "measured figures"
    d = s.deployment("stories")
    assert d is not None and d.state == "ready" and d.source == "embedded"
    assert [(st.node, st.layer_start, st.layer_end) for st in d.stages] == [("w1", 0, 3), ("w2", 3, 5)]
    assert s.raft is not None and s.raft.role == "leader"


def test_unknown_model_is_not_found(client: Client) -> None:
    with pytest.raises(BrigadeError) as e:
        client.generate("no-such-model", "hi", max_tokens=4)
    assert e.value.code == StatusCode.NOT_FOUND
    assert "no-such-model" in e.value.message


def test_deploy_chat_undeploy(client: Client) -> None:
    assert SMOLLM2.is_file(), f"{SMOLLM2} is missing: run tests/fetch-smollm2.sh or set BRIGADE_SMOLLM2"
    d = client.deploy("smol", str(SMOLLM2), ctx=512, sessions=2)
    try:
        assert d.state == "ready", d.error
        assert d.n_layers == 30 and d.stages and d.stages[0].layer_start == 0 and d.stages[-1].layer_end == 30
        assert client.status().deployment("smol") is not None
        question = "What is 2+2?"
        want = reference(question, 16, "-m", str(SMOLLM2), "--chat")
        g = client.chat("smol", [{"role": "user", "content": question}], max_tokens=16, temperature=0)
        assert g.result() == want["text"]
        assert g.ids == want["generated_ids"]
        with pytest.raises(BrigadeError) as e:
            client.deploy("smol", str(SMOLLM2), ctx=512)
        assert e.value.code == StatusCode.ALREADY_EXISTS
    finally:
        client.undeploy("smol")
    assert client.status().deployment("smol") is None
    with pytest.raises(BrigadeError) as e:
        client.chat("smol", [{"role": "user", "content": "hi"}])
    assert e.value.code == StatusCode.NOT_FOUND


def test_split_layers_are_asked_or_searched(client: Client) -> None:
    moe = Path(__file__).resolve().parents[3] / "tests/fixtures/families/qwen3moe/qwen3moe-tiny-F16.gguf"
    # asked for: planned with the experts of the first 2 layers in RAM; not asked: searched
    # (on CPUs alone, whole layers)
    assert client.plan(str(moe), ctx=64, cpu_moe=2).json["cpu_moe"] == 2
    assert client.plan(str(moe), ctx=64, cpu_moe=10**12).json["cpu_moe"] == 3
    assert client.plan(str(moe), ctx=64).json["cpu_moe"] == 0
    with pytest.raises(BrigadeError, match="a number of layers"):
        client.plan(str(moe), cpu_moe=-1)


def test_chat_needs_a_template(client: Client) -> None:
    # the embedded stories model has no chat template: the refusal reaches the caller
    with pytest.raises(BrigadeError) as e:
        client.chat("stories", [{"role": "user", "content": "hi"}], max_tokens=4).result()
    assert e.value.code == StatusCode.FAILED_PRECONDITION and "chat template" in e.value.message, e.value.code


def test_api_keys(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "keyed"
    p = procs.spawn(
        "keyed-coordinator",
        "coordinator",
        "--listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(data),
        "--api-key",
        "k-right",
    )
    wait_until("the coordinator to listen", 60, lambda: (data / "coordinator.addr").exists(), p)
    ca = data / "ca.pem"
    with Client(f"127.0.0.1:{port}", ca=ca, api_key="k-right") as c:
        assert c.status().nodes == []
    for key in ("k-wrong", None):
        with Client(f"127.0.0.1:{port}", ca=ca.read_bytes(), api_key=key) as c:
            with pytest.raises(BrigadeError) as e:
                c.status()
            assert e.value.code == StatusCode.UNAUTHENTICATED
            assert "API key" in e.value.message


def test_an_untrusted_ca_is_refused(cluster: LocalCluster, tmp_path: Path) -> None:
    # another cluster's CA: the coordinator's certificate does not verify
    other = tmp_path / "other"
    brigade("coordinator", "init", "--data-dir", str(other))
    addr = cluster.config.read_text().split('"')[1]
    with Client(addr, ca=other / "ca.pem", timeout=10) as c:
        with pytest.raises(BrigadeError) as e:
            c.status()
        assert e.value.code == StatusCode.UNAVAILABLE
