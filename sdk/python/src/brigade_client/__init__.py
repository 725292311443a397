"""Python client of a brigade cluster.

>>> from brigade_client import Client
>>> client = Client.from_env()  # the config `brigade cluster local` writes, or BRIGADE_* vars
>>> for piece in client.generate("stories", "Once upon a time", max_tokens=32, temperature=0):
...     print(piece, end="")

Layout: ``client`` (:class:`Client`, :class:`Generation`: the calls, failover across
coordinator replicas, resumed streams), ``config`` (addresses, CA and API key from arguments,
the environment or the client config file), ``types`` (typed views of the API's messages),
``errors`` (:class:`BrigadeError`), ``_proto`` (stubs generated from ``proto/`` at build time).

Deliberately lacking: an asyncio client, and any model code (the cluster computes).
"""

from grpc import StatusCode

from .client import COORDINATOR_NAME, PROTOCOL_VERSION, Client, Generation
from .config import ClientConfig, default_config_path
from .errors import BrigadeError
from .types import (
    ClusterStatus,
    Deployment,
    Device,
    DoneEvent,
    Event,
    HopTiming,
    KernelRate,
    Link,
    ModelInfo,
    Node,
    Plan,
    PromptEvent,
    RaftStatus,
    Replica,
    Stage,
    Timings,
    TokenEvent,
)

__version__ = "0.1.0"

__all__ = [
    "BrigadeError",
    "Client",
    "ClientConfig",
    "ClusterStatus",
    "COORDINATOR_NAME",
    "Deployment",
    "Device",
    "DoneEvent",
    "Event",
    "Generation",
    "HopTiming",
    "KernelRate",
    "Link",
    "ModelInfo",
    "Node",
    "Plan",
    "PROTOCOL_VERSION",
    "PromptEvent",
    "RaftStatus",
    "Replica",
    "Stage",
    "StatusCode",
    "Timings",
    "TokenEvent",
    "default_config_path",
]
