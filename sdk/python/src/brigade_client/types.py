"""Typed views of the client API's messages (``proto/brigade/v1/client.proto``): plain frozen
dataclasses, so that callers never touch generated protobuf classes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ._proto import client_pb2, common_pb2, raft_pb2

__all__ = [
    "PromptEvent",
    "TokenEvent",
    "DoneEvent",
    "Event",
    "HopTiming",
    "Timings",
    "KernelRate",
    "Device",
    "Link",
    "Node",
    "Stage",
    "Deployment",
    "Replica",
    "RaftStatus",
    "ClusterStatus",
    "ModelInfo",
    "Plan",
]


def _enum_name(enum: Any, value: int, prefix: str) -> str:
    """``STOP_REASON_EOS`` → ``eos``; an unknown number → ``unspecified``."""
    try:
        name: str = enum.Name(value)
    except ValueError:
        return "unspecified"
    return name[len(prefix) :].lower() if name.startswith(prefix) else name.lower()


def _deployment_state(value: int) -> str:
    """The name the CLI and the Rust SDK give a deployment's state (``re-placing``, not
    ``replacing``)."""
    name = _enum_name(common_pb2.DeploymentState, value, "DEPLOYMENT_STATE_")
    return "re-placing" if name == "replacing" else name


@dataclass(frozen=True)
class HopTiming:
    """Where a decoded token's time went in one stage: compute, and the hop to the next."""

    stage: int
    node: str
    device: str
    compute_s: float
    transfer_s: float
    bytes_per_token: int

    @classmethod
    def from_pb(cls, m: common_pb2.HopTiming) -> HopTiming:
        return cls(m.stage, m.node, m.device, m.compute_s, m.transfer_s, m.bytes_per_token)


@dataclass(frozen=True)
class Timings:
    prompt_tokens: int
    generated_tokens: int
    prompt_s: float
    generate_s: float
    prompt_tokens_per_s: float
    generate_tokens_per_s: float
    ttft_s: float
    hops: list[HopTiming]

    @classmethod
    def from_pb(cls, m: common_pb2.Timings) -> Timings:
        return cls(
            m.prompt_tokens,
            m.generated_tokens,
            m.prompt_s,
            m.generate_s,
            m.prompt_tokens_per_s,
            m.generate_tokens_per_s,
            m.ttft_s,
            [HopTiming.from_pb(h) for h in m.hops],
        )


@dataclass(frozen=True)
class PromptEvent:
    """The prompt's ids as the model's tokenizer encoded it (the first event)."""

    ids: list[int]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; ``text`` may be empty while a character is incomplete. With
    ``logprobs``: its log-probability under the model, and the most likely ``(id, logprob)``."""

    id: int
    text: str
    index: int
    logprob: Optional[float] = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class DoneEvent:
    """The last event: why generation stopped (``length``, ``eos``, ``context``, ``cancelled``),
    the timings, and text held back at the end (incomplete UTF-8)."""

    stop: str
    timings: Optional[Timings]
    text_tail: str

    @classmethod
    def from_pb(cls, m: common_pb2.Done) -> DoneEvent:
        timings = Timings.from_pb(m.timings) if m.HasField("timings") else None
        return cls(_enum_name(common_pb2.StopReason, m.stop, "STOP_REASON_"), timings, m.text_tail)


Event = Union[PromptEvent, TokenEvent, DoneEvent]


@dataclass(frozen=True)
class KernelRate:
    weight_type: str
    decode_bytes_per_s: float
    prompt_flops: float


@dataclass(frozen=True)
class Device:
    """A compute device of a node with the figures its worker measured."""

    name: str
    kind: str
    model: str
    memory_total: int
    memory_free: int
    mem_bandwidth: float
    flops: float
    threads: int
    features: str
    kernels: list[KernelRate] = field(default_factory=list)

    @classmethod
    def from_pb(cls, m: common_pb2.Device) -> Device:
        return cls(
            m.name,
            _enum_name(common_pb2.DeviceKind, m.kind, "DEVICE_KIND_"),
            m.model,
            m.memory_total,
            m.memory_free,
            m.mem_bandwidth,
            m.flops,
            m.threads,
            m.features,
            [KernelRate(k.weight_type, k.decode_bytes_per_s, k.prompt_flops) for k in m.kernels],
        )


@dataclass(frozen=True)
class Link:
    """A measured link between two workers (``from`` is a keyword, hence ``source``)."""

    source: str
    target: str
    latency_s: float
    bandwidth: float
    measured_at_ms: int

    @classmethod
    def from_pb(cls, m: common_pb2.LinkFigures) -> Link:
        return cls(getattr(m, "from"), m.to, m.latency_s, m.bandwidth, m.measured_at_ms)


@dataclass(frozen=True)
class Node:
    name: str
    address: str
    state: str
    devices: list[Device]
    heartbeat_age_ms: int
    version: str

    @classmethod
    def from_pb(cls, m: client_pb2.NodeInfo) -> Node:
        return cls(
            m.name,
            m.address,
            _enum_name(common_pb2.NodeState, m.state, "NODE_STATE_"),
            [Device.from_pb(d) for d in m.devices],
            m.heartbeat_age_ms,
            m.version,
        )


@dataclass(frozen=True)
class Stage:
    """One stage of a deployment: layers ``[layer_start, layer_end)`` on ``node``'s ``device``."""

    index: int
    node: str
    device: str
    layer_start: int
    layer_end: int
    state: str
    error: str
    weight_bytes: int
    kv_bytes: int
    fetched_bytes: int
    predicted_s: float
    measured_s: float
    address: str

    @classmethod
    def from_pb(cls, m: client_pb2.StageInfo) -> Stage:
        return cls(
            m.index,
            m.node,
            m.device,
            m.layer_start,
            m.layer_end,
            _enum_name(common_pb2.StageState, m.state, "STAGE_STATE_"),
            m.error,
            m.weight_bytes,
            m.kv_bytes,
            m.fetched_bytes,
            m.predicted_s,
            m.measured_s,
            m.address,
        )


@dataclass(frozen=True)
class Deployment:
    """A deployed model; ``state`` is loading, re-placing, ready, degraded or failed."""

    name: str
    source: str
    model_id: str
    generation: int
    state: str
    stages: list[Stage]
    n_layers: int
    n_ctx: int
    sessions: int
    activation_dtype: str
    carrier: str
    objective: str
    predicted_decode_s: float
    measured_decode_s: float
    tokens_generated: int
    driver: str
    plan_text: str
    error: str

    @classmethod
    def from_pb(cls, m: client_pb2.DeploymentInfo) -> Deployment:
        return cls(
            m.name,
            m.source,
            m.model_id,
            m.generation,
            _deployment_state(m.state),
            [Stage.from_pb(s) for s in m.stages],
            m.n_layers,
            m.n_ctx,
            m.sessions,
            _enum_name(common_pb2.WireDtype, m.activation_dtype, "WIRE_DTYPE_"),
            _enum_name(common_pb2.Carrier, m.carrier, "CARRIER_"),
            m.objective,
            m.predicted_decode_s,
            m.measured_decode_s,
            m.tokens_generated,
            m.driver,
            m.plan_text,
            m.error,
        )


@dataclass(frozen=True)
class Replica:
    id: int
    address: str
    role: str
    match_index: int
    is_self: bool


@dataclass(frozen=True)
class RaftStatus:
    """The coordinator replicas as the replica that answered sees them (leader 0: none known)."""

    id: int
    term: int
    leader: int
    leader_address: str
    commit_index: int
    applied_index: int
    role: str
    replicas: list[Replica]

    @classmethod
    def from_pb(cls, m: raft_pb2.RaftStatus) -> RaftStatus:
        return cls(
            m.id,
            m.term,
            m.leader,
            m.leader_address,
            m.commit_index,
            m.applied_index,
            m.role,
            [Replica(r.id, r.address, r.role, r.match_index, r.is_self) for r in m.replicas],
        )


@dataclass(frozen=True)
class ClusterStatus:
    protocol: int
    version: str
    nodes: list[Node]
    links: list[Link]
    deployments: list[Deployment]
    raft: Optional[RaftStatus]

    @classmethod
    def from_pb(cls, m: client_pb2.ClusterStatusResponse) -> ClusterStatus:
        return cls(
            m.protocol,
            m.version,
            [Node.from_pb(n) for n in m.nodes],
            [Link.from_pb(link) for link in m.links],
            [Deployment.from_pb(d) for d in m.deployments],
            RaftStatus.from_pb(m.raft) if m.HasField("raft") else None,
        )

    def deployment(self, name: str) -> Optional[Deployment]:
        """The deployment of that name, if there is one."""
        return next((d for d in self.deployments if d.name == name), None)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    state: str
    n_layers: int
    n_ctx: int
    created_ms: int

    @classmethod
    def from_pb(cls, m: client_pb2.ModelInfo) -> ModelInfo:
        return cls(m.name, m.source, _deployment_state(m.state), m.n_layers, m.n_ctx, m.created_ms)


@dataclass(frozen=True)
class Plan:
    """What a deploy would do: the planner's explanation and its JSON output."""

    text: str
    json: Any

    @classmethod
    def from_pb(cls, m: client_pb2.PlanResponse) -> Plan:
        return cls(m.plan_text, json.loads(m.plan_json) if m.plan_json else None)
