"""The client: calls on a cluster's coordinator, moving to another replica when one is down,
and generations that resume on another replica from the ids already received."""

from __future__ import annotations

import json
import secrets
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, TypeVar, Union

import grpc

from ._proto import client_pb2, client_pb2_grpc, common_pb2
from .config import ClientConfig, PathOrBytes, read_ca, split_addresses
from .errors import BrigadeError
from .types import (
    ClusterStatus,
    Deployment,
    DoneEvent,
    Event,
    ModelInfo,
    Plan,
    PromptEvent,
    TokenEvent,
)

__all__ = ["Client", "Generation", "COORDINATOR_NAME", "PROTOCOL_VERSION"]

#: The name in every coordinator's certificate (issued by the cluster CA).
COORDINATOR_NAME = "coordinator.brigade"
#: The protocol version stated on every call (metadata ``brigade-protocol``).
PROTOCOL_VERSION = 2

# Codes for which a stream is worth resuming on another replica: the replica or the pipeline
# failed, not the request (the Rust SDK's list).
_TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
    }
)
# Resumptions of one stream before its error is raised.
_MAX_RESUMES = 8
# How long a replica gets to accept a connection before the next one is tried.
_CONNECT_TIMEOUT_S = 5.0

_CHANNEL_OPTIONS = [
    ("grpc.ssl_target_name_override", COORDINATOR_NAME),
    ("grpc.max_receive_message_length", 64 << 20),
    # a replica that vanished without closing its connections is noticed within a minute
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # a replica that comes back is reconnected to quickly, not after minutes of backoff
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]

T = TypeVar("T")
Message = Mapping[str, str]

_ACTIVATION_DTYPES = {
    "": "WIRE_DTYPE_UNSPECIFIED",
    "f32": "WIRE_DTYPE_F32",
    "f16": "WIRE_DTYPE_F16",
    "bf16": "WIRE_DTYPE_BF16",
}
_CARRIERS = {"": "CARRIER_UNSPECIFIED", "quic": "CARRIER_QUIC", "grpc": "CARRIER_GRPC"}


class Client:
    """A connection to a brigade cluster's coordinator: any replica of its raft group.

    ``address`` is ``"host:port"``, a comma-separated list, or a list of addresses (tried in
    order); ``ca`` the cluster CA's PEM as bytes or a path (``ca.pem`` in the coordinator's data
    dir); ``api_key`` is sent as ``authorization: Bearer KEY``. ``timeout`` bounds each unary
    call in seconds. Thread-safe; close it (or use ``with``) to release the connections.
    """

    def __init__(
        self,
        address: Union[str, Sequence[str]],
        *,
        ca: PathOrBytes,
        api_key: Optional[str] = None,
        timeout: float = 60.0,
    ) -> None:
        self._addresses = split_addresses(address)
        if not self._addresses:
            raise BrigadeError(None, "no coordinator address")
        self._credentials = grpc.ssl_channel_credentials(root_certificates=read_ca(ca))
        self._metadata: tuple[tuple[str, str], ...] = (("brigade-protocol", str(PROTOCOL_VERSION)),)
        if api_key:
            self._metadata += (("authorization", f"Bearer {api_key}"),)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}
        self._at = 0

    @classmethod
    def from_config(cls, config: ClientConfig, *, timeout: float = 60.0) -> Client:
        return cls(config.addresses, ca=config.ca_pem, api_key=config.api_key, timeout=timeout)

    @classmethod
    def from_env(
        cls,
        address: Union[str, Sequence[str], None] = None,
        *,
        ca: Optional[PathOrBytes] = None,
        api_key: Optional[str] = None,
        timeout: float = 60.0,
    ) -> Client:
        """Explicit values, else ``BRIGADE_COORDINATOR``/``BRIGADE_CA``/``BRIGADE_API_KEY``,
        else the client config file (``$BRIGADE_CONFIG`` or ``~/.config/brigade/client.toml``)."""
        return cls.from_config(ClientConfig.resolve(address, ca, api_key), timeout=timeout)

    # connections

    @property
    def address(self) -> str:
        """The replica this client talks to now."""
        return self._addresses[self._at]

    def _channel(self, i: int) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(i)
            if ch is None:
                ch = grpc.secure_channel(self._addresses[i], self._credentials, _CHANNEL_OPTIONS)
                self._channels[i] = ch
            return ch

    def _stub(self) -> tuple[int, Any]:
        """The replica in use now and a stub on its channel."""
        i = self._at
        return i, client_pb2_grpc.ClientStub(self._channel(i))  # type: ignore[no-untyped-call]

    def _drop(self, i: int) -> None:
        with self._lock:
            ch = self._channels.pop(i, None)
        if ch is not None:
            ch.close()

    def _move_on(self, failed: int) -> None:
        """Moves to the next replica that accepts a connection (trying each once, the failed one
        last, on fresh connections); stays on the failed one when none does."""
        self._drop(failed)
        n = len(self._addresses)
        if n == 1:
            return  # nowhere else to go: the next call connects afresh
        for k in range(1, n + 1):
            i = (failed + k) % n
            try:
                grpc.channel_ready_future(self._channel(i)).result(timeout=_CONNECT_TIMEOUT_S)
            except grpc.FutureTimeoutError:
                self._drop(i)
                continue
            self._at = i
            return
        self._at = failed

    def _unary(self, call: Callable[[Any, float], T], timeout: Optional[float] = None) -> T:
        """Runs a unary call; while replicas answer UNAVAILABLE (down, or no leader elected yet)
        it tries the others, a few times, with a growing pause. Any replica serves any call."""
        tries = 0
        while True:
            i, stub = self._stub()
            try:
                return call(stub, timeout if timeout is not None else self.timeout)
            except grpc.RpcError as e:
                err = BrigadeError.from_rpc(e)
                if err.code != grpc.StatusCode.UNAVAILABLE or tries >= 2 * len(self._addresses) + 4:
                    raise err from None
                tries += 1
                time.sleep(0.15 * tries)
                self._move_on(i)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # generation

    def generate(
        self,
        model: str,
        prompt: Union[str, Sequence[int]],
        *,
        max_tokens: int = 128,
        temperature: float = 0.8,
        seed: Optional[int] = None,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        stop: Union[str, Sequence[str], None] = None,
        json_schema: Union[dict[str, Any], str, None] = None,
        grammar: Optional[str] = None,
        logprobs: Optional[int] = None,
    ) -> Generation:
        """Generates from ``prompt`` (text, or token ids) with deployment ``model``.

        Returns a :class:`Generation`: iterate it for text pieces, or call ``events()`` for
        typed events; ``ids``, ``text`` and ``done`` fill in as it streams. ``max_tokens=0``
        runs until an end-of-generation token or a full context; ``temperature=0`` is greedy;
        the penalties are llama.cpp's (``repeat_penalty`` over the last ``repeat_last_n`` ids,
        OpenAI's ``frequency_penalty`` and ``presence_penalty``); ``seed=None`` picks a random
        seed (``Generation.seed``); ``stop`` (a string or up to 16) ends the answer before the
        earliest stop string found (``done.stop == "stop"``), and no text piece holds any of it.
        ``json_schema`` (a dict or JSON text) or ``grammar`` (llguidance's Lark syntax) is what
        the answer must be, enforced token by token (it ends where it is complete);
        ``logprobs=N`` gives each :class:`TokenEvent` its log-probability and the N (0 to 20)
        most likely alternatives.
        Raises :class:`BrigadeError` (e.g. ``NOT_FOUND`` for an unknown model) before returning
        when the call is refused.
        """
        options, seed = _options(
            max_tokens,
            temperature,
            seed,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            repeat_last_n,
            frequency_penalty,
            presence_penalty,
            ignore_eos,
            stop,
            json_schema,
            grammar,
            logprobs,
        )
        if isinstance(prompt, str):
            req = client_pb2.GenerateRequest(model=model, prompt=prompt, options=options)
        else:
            req = client_pb2.GenerateRequest(model=model, prompt_ids=list(prompt), options=options)
        return Generation(self, "Generate", req, seed)

    def chat(
        self,
        model: str,
        messages: Sequence[Message],
        *,
        max_tokens: int = 128,
        temperature: float = 0.8,
        seed: Optional[int] = None,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        stop: Union[str, Sequence[str], None] = None,
        json_schema: Union[dict[str, Any], str, None] = None,
        grammar: Optional[str] = None,
        logprobs: Optional[int] = None,
    ) -> Generation:
        """A conversation (``[{"role": "user", "content": "…"}, …]``) rendered with the model's
        chat template; otherwise as :meth:`generate`."""
        options, seed = _options(
            max_tokens,
            temperature,
            seed,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            repeat_last_n,
            frequency_penalty,
            presence_penalty,
            ignore_eos,
            stop,
            json_schema,
            grammar,
            logprobs,
        )
        try:
            msgs = [client_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        except (KeyError, TypeError) as e:
            raise BrigadeError(None, f"each message needs `role` and `content`: {e}") from None
        req = client_pb2.ChatRequest(model=model, messages=msgs, options=options)
        return Generation(self, "Chat", req, seed)

    # the cluster

    def list_models(self) -> list[ModelInfo]:
        r = self._unary(lambda s, t: s.ListModels(client_pb2.ListModelsRequest(), timeout=t, metadata=self._metadata))
        return [ModelInfo.from_pb(m) for m in r.models]

    def deploy(
        self,
        name: str,
        model: str = "embedded",
        *,
        device_map: str = "",
        objective: str = "latency",
        ctx: int = 0,
        sessions: int = 0,
        driver: str = "",
        activation_dtype: str = "",
        carrier: str = "",
        headroom: float = 0.10,
        ubatch: int = 0,
        wait_s: int = 300,
        cpu_moe: Optional[int] = None,
    ) -> Deployment:
        """Deploys ``model`` (a path on the coordinator's machine, or ``"embedded"``) as
        ``name``: placed by the planner, or by hand with ``device_map="NODE:DEVICE:N,…"``.
        Waits up to ``wait_s`` seconds for every stage to be ready (0: does not wait).
        ``cpu_moe``: split layers of a mixture of experts (llama.cpp's ``--n-cpu-moe``), the
        routed experts of the first N layers in their node's RAM (0: whole layers; at least the
        model's layers: every layer); ``None``: the coordinator searches the split, as
        ``brigade deploy`` does."""
        req = client_pb2.DeployRequest(
            name=name,
            model=model,
            objective=objective,
            ctx=ctx,
            device_map=device_map,
            sessions=sessions,
            activation_dtype=_choice(_ACTIVATION_DTYPES, activation_dtype, "activation_dtype"),
            carrier=_choice(_CARRIERS, carrier, "carrier"),
            driver=driver,
            wait_s=wait_s,
            headroom=headroom,
            ubatch=ubatch,
            **_split(cpu_moe),
        )
        r = self._unary(lambda s, t: s.Deploy(req, timeout=t, metadata=self._metadata), self.timeout + wait_s)
        return Deployment.from_pb(r.deployment)

    def plan(
        self,
        model: str = "embedded",
        *,
        device_map: str = "",
        objective: str = "latency",
        ctx: int = 0,
        sessions: int = 0,
        driver: str = "",
        headroom: float = 0.10,
        cpu_moe: Optional[int] = None,
    ) -> Plan:
        """What :meth:`deploy` would do, without doing it."""
        req = client_pb2.DeployRequest(
            model=model,
            objective=objective,
            ctx=ctx,
            device_map=device_map,
            sessions=sessions,
            driver=driver,
            headroom=headroom,
            **_split(cpu_moe),
        )
        r = self._unary(lambda s, t: s.Plan(req, timeout=t, metadata=self._metadata))
        return Plan.from_pb(r)

    def undeploy(self, name: str) -> None:
        req = client_pb2.UndeployRequest(name=name)
        self._unary(lambda s, t: s.Undeploy(req, timeout=t, metadata=self._metadata))

    def status(self) -> ClusterStatus:
        """Nodes with their measured devices, links, deployments with their stages, replicas."""
        r = self._unary(
            lambda s, t: s.ClusterStatus(client_pb2.ClusterStatusRequest(), timeout=t, metadata=self._metadata)
        )
        return ClusterStatus.from_pb(r)


def _choice(table: dict[str, str], value: str, what: str) -> str:
    if value not in table:
        raise BrigadeError(None, f"{what} {value!r}: one of {', '.join(k for k in table if k)}")
    return table[value]


def _split(cpu_moe: Optional[int]) -> dict[str, Any]:
    """The request's split-layer fields: ``None`` searched, else the first N layers' experts."""
    if cpu_moe is None:
        return {"cpu_moe_auto": True}
    if cpu_moe < 0:
        raise BrigadeError(None, f"cpu_moe {cpu_moe}: a number of layers, 0 or more")
    return {"cpu_moe": min(cpu_moe, 2**32 - 1)}


def _options(
    max_tokens: int,
    temperature: float,
    seed: Optional[int],
    top_k: int,
    top_p: float,
    min_p: float,
    repeat_penalty: float,
    repeat_last_n: int,
    frequency_penalty: float,
    presence_penalty: float,
    ignore_eos: bool,
    stop: Union[str, Sequence[str], None],
    json_schema: Union[dict[str, Any], str, None] = None,
    grammar: Optional[str] = None,
    logprobs: Optional[int] = None,
) -> tuple[client_pb2.GenerateOptions, int]:
    if not 0 <= max_tokens < 1 << 32:
        raise BrigadeError(None, f"max_tokens {max_tokens}: 0 (no limit) or a token count below 2^32")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stops):
        raise BrigadeError(None, f"stop {stop!r}: a string or a list of strings")
    seed = secrets.randbits(63) if seed is None else seed
    sampling = common_pb2.Sampling(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        seed=seed,
    )
    options = client_pb2.GenerateOptions(max_tokens=max_tokens, sampling=sampling, ignore_eos=ignore_eos, stop=stops)
    if json_schema is not None:
        options.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    if grammar is not None:
        options.grammar = grammar
    if logprobs is not None:
        if not 0 <= logprobs <= 20:
            raise BrigadeError(None, f"logprobs {logprobs}: 0 to 20 alternatives per token")
        options.logprobs = logprobs
    return options, seed


class Generation:
    """One generation's stream. Iterating yields the text pieces (never an empty one); or
    iterate :meth:`events` for :class:`PromptEvent`, :class:`TokenEvent` and
    :class:`DoneEvent` (use one of the two, once). As it streams, ``prompt_ids``, ``ids`` (the
    generated token ids) and ``text`` grow; ``done`` is the final event once it has arrived.

    When the coordinator replica serving it dies (or the stream breaks before its final
    event), the stream moves to another replica and asks again with ``resume_ids`` = the ids
    received so far: the cluster continues the same session, and the caller sees a pause,
    never a gap or a repeat.
    """

    def __init__(self, client: Client, method: str, request: Any, seed: int) -> None:
        self._client = client
        self._method = method
        self._request = request
        self._first_resume_ids = list(request.options.resume_ids)
        self.seed = seed
        self.prompt_ids: list[int] = []
        self.ids: list[int] = []
        self.text = ""
        self.done: Optional[DoneEvent] = None
        self.resumes = 0
        self._cancelled = False
        self._call: Any = None
        self._started = False
        self._events = self._run()
        # the first event arrives now, so that a refused request raises here
        self._first: Optional[Event] = next(self._events, None)

    def _open(self) -> None:
        i, stub = self._client._stub()
        self._replica = i
        req = self._request
        if self.ids:
            req = type(req)()
            req.CopyFrom(self._request)
            del req.options.resume_ids[:]
            req.options.resume_ids.extend(self._first_resume_ids + self.ids)
        self._call = getattr(stub, self._method)(req, metadata=self._client._metadata)

    def _run(self) -> Iterator[Event]:
        self._open()
        while True:
            try:
                for ev in self._call:
                    kind = ev.WhichOneof("event")
                    if kind == "prompt":
                        if self._started:
                            continue  # a resumed stream states the prompt again
                        self._started = True
                        self.prompt_ids = list(ev.prompt.ids)
                        yield PromptEvent(self.prompt_ids)
                    elif kind == "token":
                        self.ids.append(ev.token.id)
                        self.text += ev.token.text
                        t = ev.token
                        yield TokenEvent(
                            t.id,
                            t.text,
                            t.index,
                            t.logprob if t.HasField("logprob") else None,
                            [(x.id, x.logprob) for x in t.top_logprobs],
                        )
                    elif kind == "done":
                        self.done = DoneEvent.from_pb(ev.done)
                        self.text += self.done.text_tail
                        yield self.done
                        return
                failure = BrigadeError(None, "the stream ended without a final event")
            except grpc.RpcError as e:
                failure = BrigadeError.from_rpc(e)
                if self._cancelled or failure.code not in _TRANSIENT:
                    raise failure from None
            if self.resumes >= _MAX_RESUMES:
                raise failure
            self.resumes += 1
            time.sleep(0.1 * self.resumes)
            self._client._move_on(self._replica)
            self._open()

    def events(self) -> Iterator[Event]:
        """The typed events, in order; ends after the :class:`DoneEvent`."""
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        yield from self._events

    def __iter__(self) -> Iterator[str]:
        for ev in self.events():
            if isinstance(ev, TokenEvent) and ev.text:
                yield ev.text
            elif isinstance(ev, DoneEvent) and ev.text_tail:
                yield ev.text_tail

    def result(self) -> str:
        """Streams to the end; the whole generated text."""
        for _ in self.events():
            pass
        return self.text

    def cancel(self) -> None:
        """Stops the generation (the cluster ends the session); a no-op once it is done."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.done is None:
            self.cancel()
