"""brigade serve driven by the official `openai` Python package (and httpx, which it brings).

Run by tests/serve.rs against servers it started:
    python openai_client.py CASE --url URL --bin BRIGADE [--model-file PATH] [--key KEY]
Every check is an assert; the script prints `ok: N checks` at the end, and the Rust side
requires that line, so a script that checked nothing cannot pass.
"""

import argparse
import concurrent.futures
import json
import pathlib
import subprocess
import time

import httpx
import openai

from checks import check, run


def run_json(args, *extra):
    """`brigade run ... --json` on the same model: the single-session reference."""
    cmd = [args.bin, "run", "--temp", "0", "--json", *extra]
    if args.model_file:
        cmd += ["-m", args.model_file]
    if args.ctx:
        cmd += ["-c", str(args.ctx)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def client(args, key=None):
    return openai.OpenAI(base_url=args.url + "/v1", api_key=key or args.key or "none", max_retries=0, timeout=300)


def raw(args):
    """An httpx client for requests the official client would refuse to send (with the key)."""
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    return httpx.Client(base_url=args.url, timeout=300, headers=headers)


def model_id(c):
    models = c.models.list().data
    check(len(models) == 1, f"one model: {models}")
    return models[0].id


def case_openai(args):
    c = client(args)
    model = model_id(c)
    prompt, n = "Once upon a time", 24
    ref = run_json(args, "-p", prompt, "-n", str(n))

    r = c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    check(r.choices[0].text == ref["text"], f"completion {r.choices[0].text!r} != run {ref['text']!r}")
    check(r.usage.prompt_tokens == len(ref["prompt_ids"]), f"prompt tokens {r.usage}")
    check(r.usage.completion_tokens == len(ref["generated_ids"]), f"completion tokens {r.usage}")
    check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "total")
    check(r.choices[0].finish_reason == ("length" if len(ref["generated_ids"]) == n else "stop"), "finish")

    text, usage, finish = "", None, None
    for ch in c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                   stream_options={"include_usage": True}):
        if ch.usage:
            usage = ch.usage
        for choice in ch.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    check(text == ref["text"], f"streamed completion {text!r}")
    check(usage is not None and usage.completion_tokens == len(ref["generated_ids"]), f"streamed usage {usage}")
    check(finish == r.choices[0].finish_reason, "streamed finish")

    # a stop string in the middle of the greedy text: the text before it, finish "stop"
    words = ref["text"].split(" ")
    stop = " " + words[len(words) // 2]
    cut = ref["text"][: ref["text"].index(stop)]
    r = c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stop=[stop, "@@@"])
    check(r.choices[0].text == cut and r.choices[0].finish_reason == "stop", f"stop {stop!r}: {r.choices[0]}")

    # chat: the template (ChatML: this model has none) rendered, then as `run -p` of that text
    rendered = "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\n"
    ref = run_json(args, "-p", rendered, "-n", "20")
    msgs = [{"role": "user", "content": "Tell me a story"}]
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0)
    check(r.choices[0].message.content == ref["text"], f"chat {r.choices[0].message.content!r} != {ref['text']!r}")
    check(r.choices[0].message.role == "assistant", "role")
    check(r.usage.prompt_tokens == len(ref["prompt_ids"]), f"chat prompt tokens {r.usage}")
    check(r.usage.completion_tokens == len(ref["generated_ids"]), f"chat completion tokens {r.usage}")
    text, usage = "", None
    for ch in c.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.usage:
            usage = ch.usage
        for choice in ch.choices:
            text += choice.delta.content or ""
    check(text == ref["text"], f"streamed chat {text!r}")
    check(usage.prompt_tokens == len(ref["prompt_ids"]), f"streamed chat usage {usage}")

    # sampling: the same seed gives the same text; penalties are accepted
    kw = dict(model=model, prompt=prompt, max_tokens=16, temperature=1.0, top_p=0.9, seed=42,
              presence_penalty=0.5, frequency_penalty=0.5)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    check(a.choices[0].text == b.choices[0].text, "same seed, same text")


def case_smollm2(args):
    c = client(args)
    model = model_id(c)
    q = "What is the capital of France?"
    ref = run_json(args, "--chat", "-p", q, "-n", "16")
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0)
    check(r.choices[0].message.content == ref["text"], f"{r.choices[0].message.content!r} != {ref['text']!r}")
    check(r.usage.prompt_tokens == len(ref["prompt_ids"]), f"usage {r.usage} vs {len(ref['prompt_ids'])}")
    check(r.usage.completion_tokens == len(ref["generated_ids"]), f"usage {r.usage}")


def case_concurrent(args):
    c = client(args)
    model = model_id(c)
    jobs = [(f"Once upon a time, {name} went to the", 8 + 3 * i)
            for i, name in enumerate(["Tim", "Lily", "Sam", "Ben", "Anna", "Max", "Sue", "Tom",
                                      "Mia", "Joe", "Kim", "Dan", "Eve", "Lucy", "Jack", "Zoe"])]
    refs = [run_json(args, "-p", p, "-n", str(n))["text"] for p, n in jobs]

    def one(k):
        p, n = jobs[k]
        text, finish = "", None
        for ch in c.completions.create(model=model, prompt=p, max_tokens=n, temperature=0, stream=True):
            for choice in ch.choices:
                text += choice.text
                finish = choice.finish_reason or finish
        return text, finish

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    for k, ((text, finish), ref) in enumerate(zip(got, refs)):
        check(finish in ("stop", "length"), f"client {k}: finished ({finish})")
        check(text == ref, f"client {k}: {text!r} != {ref!r}")


def expect_error(resp, status, what):
    check(resp.status_code == status, f"{what}: status {resp.status_code} != {status}: {resp.text[:300]}")
    err = resp.json()["error"]
    check(isinstance(err["message"], str) and "type" in err and "code" in err, f"{what}: shape {err}")
    return err["message"]


def case_bad(args):
    h = {"Authorization": f"Bearer {args.key}"}
    with httpx.Client(base_url=args.url, timeout=300) as x:
        model = x.get("/v1/models", headers=h).json()["data"][0]["id"]
        n_ctx = x.get("/v1/models", headers=h).json()["data"][0]["meta"]["n_ctx"]
        post = lambda body, **kw: x.post("/v1/completions", content=body, headers={**h, **kw.pop("headers", {})}, **kw)
        expect_error(post(b'{"model": "' + model.encode() + b'", "prompt": "x"'), 400, "malformed JSON")
        expect_error(post(json.dumps({"model": model, "prompt": {"a": 1}})), 400, "prompt of a wrong type")
        expect_error(post(json.dumps({"model": model, "prompt": "x", "temperature": "hot"})), 400, "wrong type")
        m = expect_error(post(json.dumps({"model": model, "prompt": "x", "max_tokens": -5})), 400, "negative max_tokens")
        check("-5" in m, m)
        m = expect_error(post(json.dumps({"model": model, "prompt": "hello " * 100_000})), 400, "100 000-token prompt")
        check(str(n_ctx) in m and "tokens" in m, f"both numbers: {m}")
        expect_error(post(b"x" * (50 << 20)), 413, "50 MB body")
        m = expect_error(post(json.dumps({"model": "gpt-4o", "prompt": "x"})), 404, "unknown model")
        check(model in m, m)
        expect_error(x.post("/v1/completions", json={"model": model, "prompt": "x"}), 401, "missing key")
        expect_error(x.post("/v1/chat/completions", json={"model": model, "messages": []},
                            headers={"Authorization": "Bearer nope"}), 401, "wrong key")
        expect_error(x.get("/v1/nowhere", headers=h), 404, "unknown route")
        check(x.get("/health").status_code == 200, "health needs no key")
    # and the server still serves, through the official client too
    c = client(args)
    r = c.completions.create(model=model, prompt="Once", max_tokens=4, temperature=0)
    check(len(r.choices[0].text) > 0 and r.usage.completion_tokens == 4, f"a good request after: {r}")
    try:
        client(args, key="wrong").models.list()
        check(False, "a wrong key is refused")
    except openai.AuthenticationError:
        check(True, "")


def case_disconnect(args):
    """--parallel 1: a client that goes away mid-stream frees the one slot at once."""
    c = client(args)
    model = model_id(c)
    with httpx.Client(base_url=args.url, timeout=300) as x:
        busy = lambda: x.get("/health").json()["slots_processing"]
        stream = c.completions.create(model=model, prompt="Once upon a time", max_tokens=1500, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        got = 0
        for _ in stream:
            got += 1
            if got == 5:
                break
        check(busy() == 1, "the long stream holds the slot")
        t0 = time.time()
        stream.close()
        while busy() != 0:
            check(time.time() - t0 < 3, "the slot is freed within 3 s of the disconnect")
            time.sleep(0.02)
        freed = time.time() - t0
        t0 = time.time()
        r = c.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
        check(r.usage.completion_tokens == 4, "the next request is served")
        check(time.time() - t0 < 10, "without waiting for the 1500 tokens")
        print(f"slot freed {freed * 1e3:.0f} ms after the disconnect")


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "tags", "alive"],
    "additionalProperties": False,
}


def case_structured(args):
    """response_format and grammars on the embedded model (a 260K-parameter model that has never
    seen JSON): every answer is what was asked, at every temperature and seed."""
    import jsonschema

    c = client(args)
    model = model_id(c)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    temps = [0.0, 0.4, 0.8, 1.2]
    for seed in range(20):
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a person."}],
                                      max_tokens=300, temperature=temps[seed % 4], seed=seed, response_format=fmt)
        text = r.choices[0].message.content
        check(r.choices[0].finish_reason == "stop", f"seed {seed}: finish {r.choices[0].finish_reason}: {text!r}")
        jsonschema.validate(json.loads(text), PERSON)
        check(True, "")
    # streamed, and on /v1/completions (response_format as llama-server takes it there)
    text = ""
    for ch in c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=300,
                                        temperature=1.0, seed=3, response_format=fmt, stream=True):
        for choice in ch.choices:
            text += choice.delta.content or ""
    jsonschema.validate(json.loads(text), PERSON)
    r = c.completions.create(model=model, prompt="Once upon a time", max_tokens=300, temperature=0.9, seed=5,
                             extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    # llama.cpp's `json_schema` field, and any JSON object
    r = c.completions.create(model=model, prompt="Once", max_tokens=300, temperature=0.5, seed=6,
                             extra_body={"json_schema": PERSON})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON please"}], max_tokens=60,
                                  temperature=0.7, seed=1, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    check(text.startswith("{"), f"json_object: {text!r}")
    if r.choices[0].finish_reason == "stop":
        check(isinstance(json.loads(text), dict), f"json_object: {text!r}")
    # a grammar in llguidance's Lark syntax, as llama.cpp's llguidance builds take it
    grammar = '%llguidance {}\nstart: ("yes" | "no") ", " /[0-9]{1,3}/\n'
    for seed in range(4):
        r = c.completions.create(model=model, prompt="Answer:", max_tokens=50, temperature=1.2, seed=seed,
                                 extra_body={"grammar": grammar})
        word, num = r.choices[0].text.split(", ")
        check(word in ("yes", "no") and num.isdigit() and len(num) <= 3, f"grammar: {r.choices[0].text!r}")
    # what cannot be compiled is a 400 naming the field; the server keeps serving
    with raw(args) as x:
        post = lambda path, body: x.post(path, json={"model": model, **body})
        chat = {"messages": [{"role": "user", "content": "x"}]}
        bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}
        for path, body, field in [
            ("/v1/chat/completions", {**chat, "response_format": bad_schema}, "response_format"),
            ("/v1/chat/completions", {**chat, "response_format": {"type": "xml"}}, "response_format"),
            ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema"}}, "response_format"),
            ("/v1/completions", {"prompt": "x", "grammar": "root ::= \"yes\""}, "grammar"),
            ("/v1/completions", {"prompt": "x", "grammar": "%llguidance {}\nstart: nowhere"}, "grammar"),
            ("/v1/completions", {"prompt": "x", "json_schema": PERSON, "response_format": {"type": "json_object"}},
             "json_schema"),
        ]:
            resp = post(path, body)
            m = expect_error(resp, 400, f"{field}: {body}")
            check(resp.json()["error"]["param"] == field, f"param of {body}: {resp.json()}")
            check(field in m, f"{field} named: {m}")
    r = c.completions.create(model=model, prompt="Once", max_tokens=4, temperature=0)
    check(r.usage.completion_tokens == 4, "a good request after")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                   "b": {"type": "integer", "minimum": -999, "maximum": 999}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Adds two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def streamed_calls(stream):
    """The calls and content of a streamed chat answer, put together by index as clients do."""
    calls, content, finish = {}, "", None
    for ch in stream:
        for choice in ch.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += d.id or ""
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


def valid_calls(calls, names, what):
    """Each call names one of `names` and its arguments follow that function's schema."""
    import jsonschema

    check(len(calls) >= 1, f"{what}: no call")
    for c in calls:
        check(c["name"] in names, f"{what}: calls {c['name']!r}")
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
        check(c["id"].startswith("call_") and len(c["id"]) > 8, f"{what}: id {c['id']!r}")


def as_dicts(message):
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


def case_tools(args):
    """Tool calls on the embedded model (never trained on tools): forced calls always valid, at any
    temperature, streamed and not; `auto` is a call or an answer; a history of calls and results;
    bad tools are 400s. `--style hermes`: the server runs tests/serve/hermes.jinja, whose calls are
    <tool_call> blocks; otherwise the model's template shows no tools (the generic JSON style)."""
    c = client(args)
    model = model_id(c)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    temps = [0.0, 0.5, 1.0, 1.2]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(8):
        r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=200,
                                      parallel_tool_calls=False, temperature=temps[seed % 4], seed=seed)
        ch = r.choices[0]
        check(ch.finish_reason == "tool_calls", f"seed {seed}: finish {ch.finish_reason}: {ch.message}")
        check(not ch.message.content, f"seed {seed}: content {ch.message.content!r}")
        valid_calls(as_dicts(ch.message), ["get_weather"], f"named, seed {seed}")
    # required, one call at most
    for seed in range(6):
        r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
        ch = r.choices[0]
        check(ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, f"required {seed}: {ch}")
        valid_calls(as_dicts(ch.message), ["get_weather", "add"], f"required, seed {seed}")
    # streamed, several calls allowed: the same calls as the whole answer of the same seed (an
    # answer that runs into max_tokens says `length`, with the calls it completed)
    for seed in range(3):
        kw = dict(model=model, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=200,
                  temperature=0.8, seed=seed)
        calls, content, finish = streamed_calls(c.chat.completions.create(stream=True, **kw))
        check(finish in ("tool_calls", "length") and content == "", f"stream {seed}: {finish} {content!r}")
        valid_calls(calls, ["get_weather", "add"], f"stream {seed}")
        whole = as_dicts(c.chat.completions.create(**kw).choices[0].message)
        check([(x["name"], x["arguments"]) for x in calls] == [(x["name"], x["arguments"]) for x in whole],
              f"stream {seed}: {calls} != {whole}")
    # the tools are in the prompt
    plain = c.chat.completions.create(model=model, messages=msgs, max_tokens=1, temperature=0)
    with_tools = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=1, temperature=0)
    check(with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20,
          f"tools rendered: {with_tools.usage.prompt_tokens} vs {plain.usage.prompt_tokens} prompt tokens")
    none = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=1,
                                     temperature=0)
    check(none.usage.prompt_tokens == plain.usage.prompt_tokens, "tool_choice none renders no tools")
    # auto: each answer is calls or text, never both broken
    kinds = set()
    for seed in range(12):
        r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=120, temperature=1.0,
                                      seed=seed)
        ch = r.choices[0]
        if ch.message.tool_calls:
            check(ch.finish_reason in ("tool_calls", "length"), f"auto {seed}: {ch}")
            valid_calls(as_dicts(ch.message), ["get_weather", "add"], f"auto {seed}")
            kinds.add("call")
        else:
            check(ch.finish_reason in ("stop", "length") and isinstance(ch.message.content, str), f"auto {seed}: {ch}")
            kinds.add("text")
    if args.style != "hermes":
        # the generic style chooses between its two shapes: over 12 seeds, both come
        check(kinds == {"call", "text"}, f"auto gave only {kinds}")
    # a conversation with an earlier call and its result
    history = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 degrees, sunny"},
    ]
    r = c.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="required",
                                  max_tokens=200, temperature=0.3, seed=4)
    valid_calls(as_dicts(r.choices[0].message), ["get_weather", "add"], "after a result")
    check(r.usage.prompt_tokens > with_tools.usage.prompt_tokens, "the history is in the prompt")
    # the same history with no tools in play: the calls and results are still shown
    r = c.chat.completions.create(model=model, messages=history, tool_choice="none", tools=TOOLS, max_tokens=4,
                                  temperature=0)
    check(r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > plain.usage.prompt_tokens + 10,
          f"history without tools: {r.usage}")
    # bad tools: 400 naming the field; the server keeps serving
    with raw(args) as x:
        base = {"model": model, "messages": msgs}
        bad_params = {"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}
        for body, field in [
            ({**base, "tools": [bad_params], "tool_choice": "required"}, "tools"),
            ({**base, "tools": [bad_params]}, "tools"),
            ({**base, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
            ({**base, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice"),
            ({**base, "tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
            ({**base, "tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ]:
            resp = x.post("/v1/chat/completions", json=body)
            m = expect_error(resp, 400, f"{field}: {body}")
            check(resp.json()["error"]["param"] == field, f"param of {body}: {resp.json()}")
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
    check(r.usage.completion_tokens >= 1, "a good request after")


def case_logprobs(args):
    """logprobs / top_logprobs on both endpoints, streamed and not: one entry per generated token,
    the greedy choice is the most likely alternative, the tokens spell the text; bad values are
    400s naming the field."""
    import math

    c = client(args)
    model = model_id(c)
    msgs = [{"role": "user", "content": "Tell me a story."}]
    kw = dict(model=model, messages=msgs, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    r = c.chat.completions.create(**kw)
    entries = r.choices[0].logprobs.content
    check(len(entries) == r.usage.completion_tokens, f"{len(entries)} entries for {r.usage.completion_tokens} tokens")
    text = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
    check(text == r.choices[0].message.content, f"tokens spell {text!r} != {r.choices[0].message.content!r}")
    for e in entries:
        check(len(e.top_logprobs) == 3, f"3 alternatives: {e}")
        check(e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob,
              f"the greedy token is the most likely: {e}")
        lps = [t.logprob for t in e.top_logprobs]
        check(lps == sorted(lps, reverse=True) and lps[0] <= 0 and sum(math.exp(x) for x in lps) <= 1 + 1e-5, f"{lps}")
    # streamed: the same entries, spread over the chunks
    streamed = []
    for ch in c.chat.completions.create(stream=True, **kw):
        for choice in ch.choices:
            if choice.logprobs and choice.logprobs.content:
                streamed += choice.logprobs.content
    check([(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries], "streamed = whole")
    # sampled: the drawn token's own probability, never above the most likely one's
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=1.0, seed=3, logprobs=True,
                                  top_logprobs=1)
    for e in r.choices[0].logprobs.content:
        check(math.isfinite(e.logprob) and e.logprob <= e.top_logprobs[0].logprob + 1e-6, f"sampled: {e}")
    # logprobs without alternatives; and none unless asked
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, logprobs=True)
    check(all(e.top_logprobs == [] for e in r.choices[0].logprobs.content), "no alternatives unless asked")
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
    check(r.choices[0].logprobs is None, "no logprobs unless asked")
    # /v1/completions' shape: parallel lists
    r = c.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
          == r.usage.completion_tokens, f"lengths: {lp}")
    check("".join(lp.tokens) == r.choices[0].text, f"{lp.tokens} spell {r.choices[0].text!r}")
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        check(len(top) <= 2 and max(top.values()) == l and top.get(tok) == l, f"greedy {tok!r} {l} {top}")
    check(lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset), f"offsets {lp.text_offset}")
    text, offsets = "", []
    for ch in c.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=2,
                                   stream=True):
        if ch.choices and ch.choices[0].logprobs:
            text += "".join(ch.choices[0].logprobs.tokens)
            offsets += ch.choices[0].logprobs.text_offset
    check(text == r.choices[0].text, f"streamed tokens {text!r}")
    check(offsets == lp.text_offset, f"streamed offsets {offsets} != {lp.text_offset}")
    with raw(args) as x:
        for path, body, field in [
            ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ("/v1/chat/completions", {"messages": msgs, "top_logprobs": 2}, "top_logprobs"),
            ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
            ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
            ("/v1/completions", {"prompt": "x", "logprobs": "many"}, "logprobs"),
        ]:
            resp = x.post(path, json={"model": model, **body})
            expect_error(resp, 400, f"{field}: {body}")
            check(resp.json()["error"]["param"] == field, f"param of {body}: {resp.json()}")


# a function to copy: what prompt lookup drafts (scripts/bench-spec-cluster.py asks the same)
MERGE = (pathlib.Path(__file__).parent.parent / "fixtures" / "prompts" / "merge_sorted.py").read_text()


def case_speculative(args):
    """A server drafting by prompt lookup answers with plain decoding's text (`brigade run`
    without drafts): a chat that copies code from its prompt, streamed and not, two at once."""
    c = client(args)
    model = model_id(c)
    asks = ["Copy this Python function exactly, then add a docstring to it:\n\n" + MERGE,
            "Rename merge_sorted to merge in this code and show the whole function:\n\n" + MERGE]
    refs = [run_json(args, "--chat", "-p", q, "-n", "120") for q in asks]

    def one(k, stream):
        msgs = [{"role": "user", "content": asks[k]}]
        if not stream:
            r = c.chat.completions.create(model=model, messages=msgs, max_tokens=120, temperature=0)
            return r.choices[0].message.content
        text = ""
        for ch in c.chat.completions.create(model=model, messages=msgs, max_tokens=120, temperature=0, stream=True):
            for choice in ch.choices:
                text += choice.delta.content or ""
        return text

    for k in range(2):
        check(one(k, False) == refs[k]["text"], f"ask {k}: {one(k, False)!r} != {refs[k]['text']!r}")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda k: one(k, True), range(2)))
    for k in range(2):
        check(got[k] == refs[k]["text"], f"ask {k}, streamed beside the other: {got[k]!r}")
    # the copy was drafted: the server's drafts were taken
    metrics = httpx.get(args.url + "/metrics", timeout=30).text
    taken = [line for line in metrics.splitlines() if line.startswith("brigade_deployment_draft_tokens_accepted_total")]
    check(taken and float(taken[0].split()[-1]) > 50, f"drafts taken: {taken}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["openai", "smollm2", "concurrent", "bad", "disconnect", "structured", "tools",
                                     "logprobs", "speculative"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model-file")
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--key")
    ap.add_argument("--style")
    args = ap.parse_args()
    globals()["case_" + args.case](args)


if __name__ == "__main__":
    run(main)
