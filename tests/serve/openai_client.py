"""brigade serve driven by the official `openai` Python package (and httpx, which it brings).

Run by tests/serve.rs against servers it started:
    python openai_client.py CASE --url URL --bin BRIGADE [--model-file PATH] [--key KEY]
Every check is an assert; the script prints `ok: N checks` at the end, and the Rust side
requires that line, so a script that checked nothing cannot pass.
"""

import argparse
import concurrent.futures
import json
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
    with httpx.Client(base_url=args.url, timeout=300) as x:
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["openai", "smollm2", "concurrent", "bad", "disconnect", "structured"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model-file")
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--key")
    args = ap.parse_args()
    globals()["case_" + args.case](args)


if __name__ == "__main__":
    run(main)
