"""Where the client looks for its cluster, without one running: explicit values, then the
environment, then the client config file — the Rust SDK's order."""

from __future__ import annotations

from pathlib import Path

import pytest

from brigade_client import BrigadeError, Client, ClientConfig, default_config_path

PEM = b"-----BEGIN CERTIFICATE-----\nnot checked until a call\n-----END CERTIFICATE-----\n"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for k in ("BRIGADE_CONFIG", "BRIGADE_COORDINATOR", "BRIGADE_CA", "BRIGADE_API_KEY", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def write_config(tmp_path: Path, text: str) -> Path:
    (tmp_path / "certs").mkdir(exist_ok=True)
    (tmp_path / "certs" / "ca.pem").write_bytes(PEM)
    p = tmp_path / "client.toml"
    p.write_text(text)
    return p


def test_default_path_follows_the_environment(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert default_config_path() == tmp_path / "home" / ".config" / "brigade" / "client.toml"
    env.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert default_config_path() == tmp_path / "xdg" / "brigade" / "client.toml"
    env.setenv("BRIGADE_CONFIG", str(tmp_path / "c.toml"))
    assert default_config_path() == tmp_path / "c.toml"


def test_the_file_gives_addresses_and_a_ca_relative_to_it(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    p = write_config(tmp_path, 'coordinator = "a:1, b:2,c:3"\nca = "certs/ca.pem"\napi_key = "k1"\n')
    env.setenv("BRIGADE_CONFIG", str(p))
    c = ClientConfig.resolve()
    assert c.addresses == ["a:1", "b:2", "c:3"] and c.ca_pem == PEM and c.api_key == "k1"


def test_explicit_beats_environment_beats_file(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env.setenv("BRIGADE_CONFIG", str(write_config(tmp_path, 'coordinator = "file:1"\nca = "certs/ca.pem"\n')))
    env.setenv("BRIGADE_COORDINATOR", "env:1,env:2")
    env.setenv("BRIGADE_API_KEY", "env-key")
    c = ClientConfig.resolve()
    assert c.addresses == ["env:1", "env:2"] and c.api_key == "env-key" and c.ca_pem == PEM
    c = ClientConfig.resolve(["x:9"], ca=b"other", api_key="mine")
    assert c.addresses == ["x:9"] and c.ca_pem == b"other" and c.api_key == "mine"


def test_missing_pieces_say_what_to_do(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(BrigadeError, match="no coordinator") as e:
        ClientConfig.resolve()
    assert e.value.code is None
    with pytest.raises(BrigadeError, match="no cluster CA"):
        ClientConfig.resolve("a:1")
    with pytest.raises(BrigadeError, match="nope.pem"):
        Client("a:1", ca=tmp_path / "nope.pem")
    with pytest.raises(BrigadeError, match="no coordinator address"):
        Client(" , ", ca=PEM)
    bad = write_config(tmp_path, 'coordinator = 5\nca = "certs/ca.pem"\n')
    with pytest.raises(BrigadeError, match="needs `coordinator"):
        ClientConfig.from_file(bad)
    broken = write_config(tmp_path, "coordinator = \n")
    with pytest.raises(BrigadeError, match="client.toml"):
        ClientConfig.from_file(broken)


def test_arguments_are_checked_before_any_call(env: pytest.MonkeyPatch) -> None:
    c = Client("127.0.0.1:1", ca=PEM)
    with pytest.raises(BrigadeError, match="max_tokens"):
        c.generate("m", "hi", max_tokens=-1)
    with pytest.raises(BrigadeError, match="role"):
        c.chat("m", [{"content": "no role"}])
    with pytest.raises(BrigadeError, match="carrier"):
        c.deploy("m", carrier="pigeon")
    with pytest.raises(BrigadeError, match="a string or a list of strings"):
        c.generate("m", "hi", stop=["ok", 5])  # type: ignore[list-item]
