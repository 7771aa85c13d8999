"""Every endpoint of the OpenAPI document, fuzzed by schemathesis (valid and invalid bodies):
never a 5xx, every refusal in the API's own error shape, and the server healthy afterwards.

The budget is bounded for CI (max_examples per operation, no shrinking, derandomized so a
failure reproduces); the engine is the ScriptedEngineCore, which has a real tokenizer and a
real continuous-batching loop but no model, so each request costs microseconds of "compute".
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from reliability_util import assert_error_body, healthy, scripted_server

MAX_EXAMPLES = int(os.environ.get("TIERMOE_FUZZ_EXAMPLES", "25"))  # per operation and mode (CI budget)
STATUSES: dict = {}


@pytest.fixture(scope="module")
def fuzz_server():
    # a small context and body limit keep every generated request cheap; 16 choices of a
    # 1024-token context is the most any one request can ask for
    with scripted_server(max_model_len=1024, max_num_seqs=64, max_body_bytes=256 * 1024) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.update(base_url=fuzz_server.url)
    schema.config.generation.update(modes=["positive", "negative"], max_examples=MAX_EXAMPLES, no_shrink=True,
                                    deterministic=True, database="none")
    return schema


def test_openapi_document_covers_every_route(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    paths = doc["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                 "/tokenize", "/detokenize", "/v1/models", "/health", "/metrics", "/stats"):
        assert path in paths, path
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/ChatCompletionRequest")
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"] and "max_tokens" in chat["properties"]
    # /v1/messages is documented by the model its route validates with, structured output included
    ref = paths["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    messages = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"output_config", "output_format"} <= set(messages["properties"]), sorted(messages["properties"])


# (method, path) of every operation; test_openapi_document_covers_every_route checks the
# document has no operation missing from this list
OPERATIONS = [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("GET", "/health"), ("GET", "/ping"), ("GET", "/metrics"), ("GET", "/stats"),
]


def test_operation_list_is_complete(api_schema):
    ops = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert ops == set(OPERATIONS)


# GET operations take no body (a model id in the path at most: any string is valid), so there is
# nothing to make invalid
CASES = [(m, p, mode) for m, p in OPERATIONS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
         if m == "POST" or mode is GenerationMode.POSITIVE]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_endpoint_fuzzed(api_schema, fuzz_server, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate], derandomize=True, database=None)
    def fuzz(case):
        if isinstance(case.body, dict) and mode is GenerationMode.POSITIVE:
            # else nearly every valid body stops at the 404 for the model or the context check
            if isinstance(case.body.get("model"), str):
                case.body["model"] = "scripted"
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                if isinstance(case.body.get(key), int) and not isinstance(case.body[key], bool):
                    case.body[key] = 1 + abs(case.body[key]) % 16
        response = case.call(timeout=30)
        STATUSES.setdefault((method, path, mode.value), []).append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code < 500, (path, response.status_code, response.text[:300])
        if response.status_code >= 400:
            assert_error_body(path, response)

    fuzz()


def test_still_healthy_after_fuzzing(fuzz_server):
    assert healthy(fuzz_server.url)
    stats = httpx.get(fuzz_server.url + "/stats").json()
    assert stats["engine"]["running"] == 0 and stats["engine"]["waiting"] == 0
    # the fuzzing reached past validation: valid bodies were served on the generating routes.
    # Which route gets a 200 depends on the generator's draws (schemathesis/hypothesis versions
    # differ between installs), so one served route is the robust check.
    routes = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
    seen = {path: STATUSES.get(("POST", path, "positive")) for path in routes}
    assert any(200 in (codes or ()) for codes in seen.values()), seen
