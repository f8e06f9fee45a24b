#!/usr/bin/env python3
"""The official OpenAI Python SDK, unchanged, against a kvmesh router's HTTP front.

Usage: openai_sdk.py BASE_URL (e.g. http://127.0.0.1:8080), with the router in front of at least
one worker of the default model. tests/integration/test_openai.c runs it against its own cluster
(test openai::the_official_python_sdk_works_unchanged); `make openai-sdk-venv` makes
build/venv-openai with the package from PyPI. Exits 0 when every check holds, 77 (skipped, with a
message) when the `openai` package is missing, 1 otherwise.
"""
import json
import sys
import urllib.request

try:
    import openai
except ImportError:
    print("skipped: the python package 'openai' is not installed (make openai-sdk-venv)")
    sys.exit(77)


def check(cond, what):
    if not cond:
        print("FAIL:", what)
        sys.exit(1)


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def main():
    base = sys.argv[1].rstrip("/")
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

    check(client.models.list().data[0].id, "models.list")

    # completions: logprobs, echo (with logprobs too), n with a seed, a list of prompts, token ids
    r = client.completions.create(model="default", prompt="The capital of France is",
                                  max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    check("Paris" in r.choices[0].text, "greedy completion: %r" % r.choices[0].text)
    check(len(lp.tokens) == 4 and len(lp.token_logprobs) == 4, "completion logprobs")
    check(all(len(t) == 3 for t in lp.top_logprobs), "3 alternatives per token")
    check(lp.text_offset[0] == 0, "text_offset")
    r = client.completions.create(model="default", prompt="Hello", max_tokens=2, temperature=0,
                                  echo=True)
    check(r.choices[0].text.startswith("Hello"), "echo")
    r = client.completions.create(model="default", prompt="The sky is blue", max_tokens=2,
                                  temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    check(lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:]),
          "echo with logprobs: the prompt's, the first null: %s" % lp.token_logprobs)
    check("".join(lp.tokens).startswith("The sky is blue") and lp.text_offset[0] == 0,
          "echo with logprobs: the prompt's tokens first: %s" % lp.tokens)
    a = client.completions.create(model="default", prompt="Once upon a time", max_tokens=5,
                                  temperature=1, n=3, seed=42)
    b = client.completions.create(model="default", prompt="Once upon a time", max_tokens=5,
                                  temperature=1, n=3, seed=42)
    check([c.text for c in a.choices] == [c.text for c in b.choices], "seeded n reproducible")
    check([c.index for c in a.choices] == [0, 1, 2], "choice indexes")
    r = client.completions.create(model="default", prompt=["Hello", "The sky is"], max_tokens=2,
                                  temperature=0)
    check(len(r.choices) == 2, "a list of prompts")
    tok = post(base + "/tokenize", {"prompt": "Hello"})
    r2 = client.completions.create(model="default", prompt=tok["tokens"], max_tokens=2,
                                   temperature=0)
    check(r2.choices[0].text == r.choices[0].text, "token ids give what the text gives")
    det = post(base + "/detokenize", {"tokens": tok["tokens"]})
    check(det["prompt"] == "Hello", "detokenize")
    with urllib.request.urlopen(base + "/health", timeout=10) as h:
        check(h.status == 200, "/health")

    # chat: logprobs, top_logprobs, logit_bias, n streamed with usage
    msgs = [{"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    check(len(content) == 3, "chat logprobs: one entry per token")
    check(content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob,
          "alternatives most likely first")
    check(abs(content[0].logprob - content[0].top_logprobs[0].logprob) < 1e-6,
          "greedy: the chosen token is the most likely")
    tok_id = post(base + "/tokenize", {"prompt": content[0].token,
                                       "add_special_tokens": False})["tokens"][0]
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=1,
                                       temperature=0, logit_bias={str(tok_id): -100})
    check(r.choices[0].message.content != content[0].token, "logit_bias -100 bans the token")
    chunks = list(client.chat.completions.create(
        model="default", messages=msgs, max_tokens=3, n=2, seed=3, stream=True, logprobs=True,
        stream_options={"include_usage": True}))
    finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    check(finishes == [0, 1], "each streamed choice finishes once: %s" % finishes)
    check(chunks[-1].usage and chunks[-1].usage.completion_tokens == 6, "usage chunk")
    check(any(c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content
              for c in chunks), "streamed logprobs")

    # the grammar extensions through extra_body, as with vLLM; tools with n > 1
    import re
    r = client.completions.create(model="default", prompt="Call me at", max_tokens=20,
                                  temperature=0, extra_body={"guided_regex": r"\d{3}-\d{4}"})
    check(re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text), "guided_regex: %r" % r.choices[0].text)
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=10,
        temperature=0, extra_body={"guided_grammar": 'root ::= ("yes" | "no") "!"'})
    check(r.choices[0].message.content in ("yes!", "no!"), "guided_grammar: %r" % r.choices[0])
    try:
        client.chat.completions.create(model="default", messages=msgs, max_tokens=1,
                                       extra_body={"guided_grammar": "root ::= root"})
        check(False, "a left-recursive grammar accepted")
    except openai.BadRequestError as e:
        check("left recursion" in str(e.body), "left recursion named: %s" % e.body)
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Weather in Lisbon?"}],
        max_tokens=60, temperature=0.8, seed=5, n=2, tools=tools, tool_choice="required")
    check(len(r.choices) == 2, "n=2 with tools")
    for c in r.choices:
        check(c.finish_reason == "tool_calls" and c.message.tool_calls, "choice %d: a call" % c.index)
        check("city" in json.loads(c.message.tool_calls[0].function.arguments), "its arguments")

    # refusals are BadRequestError naming the field
    for kwargs, param in (({"suffix": "x"}, "suffix"), ({"n": 100}, "n")):
        try:
            client.completions.create(model="default", prompt="x", max_tokens=1, **kwargs)
            check(False, "%s accepted" % kwargs)
        except openai.BadRequestError as e:
            check(e.body and e.body.get("param") == param, "400 names %s: %s" % (param, e.body))
    print("ok: openai", openai.__version__, json.dumps({"checks": "all"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
