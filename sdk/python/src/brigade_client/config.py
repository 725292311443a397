"""Where a cluster is and how to trust it: explicit values, the environment
(``BRIGADE_COORDINATOR``, ``BRIGADE_CA``, ``BRIGADE_API_KEY``), or the client config file that
``brigade cluster local`` writes (``$BRIGADE_CONFIG``, else ``~/.config/brigade/client.toml``) —
in that order, as the Rust SDK and the CLI resolve them."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from .errors import BrigadeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the dependency exists only on older Pythons
    import tomli as tomllib

__all__ = ["ClientConfig", "default_config_path", "split_addresses"]

PathOrBytes = Union[str, "os.PathLike[str]", bytes]


def split_addresses(value: Union[str, Sequence[str]]) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2"]`` as a list of non-empty addresses."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    return [p.strip() for p in parts if p.strip()]


def read_ca(ca: PathOrBytes) -> bytes:
    """The CA's PEM: given as bytes, or as a path to read."""
    if isinstance(ca, bytes):
        return ca
    try:
        return Path(ca).read_bytes()
    except OSError as e:
        raise BrigadeError(None, f"cluster CA {ca}: {e.strerror or e}") from e


def default_config_path() -> Optional[Path]:
    """``$BRIGADE_CONFIG``, else ``$XDG_CONFIG_HOME/brigade/client.toml``
    (``~/.config/brigade/client.toml``)."""
    if os.environ.get("BRIGADE_CONFIG"):
        return Path(os.environ["BRIGADE_CONFIG"])
    base = os.environ.get("XDG_CONFIG_HOME")
    if base:
        return Path(base) / "brigade" / "client.toml"
    home = os.environ.get("HOME")
    return Path(home) / ".config" / "brigade" / "client.toml" if home else None


@dataclass(frozen=True)
class ClientConfig:
    """Coordinator addresses (``host:port``, tried in order), the cluster CA's PEM, an API key."""

    addresses: list[str]
    ca_pem: bytes
    api_key: Optional[str] = None

    @classmethod
    def from_file(cls, path: Union[str, "os.PathLike[str]"]) -> ClientConfig:
        """Reads a client config file: ``coordinator = "host:port[,host:port…]"``,
        ``ca = "path"`` (relative to the file), optionally ``api_key``."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as e:
            raise BrigadeError(None, f"{path}: {e.strerror or e}") from e
        except tomllib.TOMLDecodeError as e:
            raise BrigadeError(None, f"{path}: {e}") from e
        coordinator, ca, key = data.get("coordinator"), data.get("ca"), data.get("api_key")
        if not isinstance(coordinator, str) or not isinstance(ca, str):
            raise BrigadeError(None, f"{path}: needs `coordinator = \"host:port\"` and `ca = \"path\"`")
        if key is not None and not isinstance(key, str):
            raise BrigadeError(None, f"{path}: `api_key` must be a string")
        ca_path = Path(ca) if Path(ca).is_absolute() else path.parent / ca
        return cls(split_addresses(coordinator), read_ca(ca_path), key or os.environ.get("BRIGADE_API_KEY"))

    @classmethod
    def resolve(
        cls,
        coordinator: Union[str, Sequence[str], None] = None,
        ca: Optional[PathOrBytes] = None,
        api_key: Optional[str] = None,
    ) -> ClientConfig:
        """Explicit values first, then the environment, then the client config file."""
        file_path = default_config_path()
        file = cls.from_file(file_path) if file_path is not None and file_path.exists() else None
        given = coordinator if coordinator is not None else os.environ.get("BRIGADE_COORDINATOR")
        addresses = split_addresses(given) if given is not None else (file.addresses if file else [])
        if not addresses:
            raise BrigadeError(
                None,
                "no coordinator: give an address (or set BRIGADE_COORDINATOR, or run "
                "`brigade cluster local`, which writes a client config)",
            )
        ca_given = ca if ca is not None else os.environ.get("BRIGADE_CA")
        if ca_given is not None:
            ca_pem = read_ca(ca_given)
        elif file is not None:
            ca_pem = file.ca_pem
        else:
            raise BrigadeError(
                None, "no cluster CA to trust: give ca= (the coordinator's data dir has ca.pem) or set BRIGADE_CA"
            )
        key = api_key or os.environ.get("BRIGADE_API_KEY") or (file.api_key if file else None)
        return cls(addresses, ca_pem, key)
