"""Issue 25 finding 3: /openapi.json is OpenAPI 3.1 generated from the pydantic models the handlers validate
with (never a hand-kept copy), with what the deployment decides written in; /docs is a page over it; the
text pattern in the document says exactly what the validator accepts."""
from __future__ import annotations

import re
import sys

import pytest
import starlette  # noqa: F401 - the extra this test needs
from test_gateway_app import DIM, KEY, make

from bge_triton.gateway.models import VISIBLE_PATTERN, EmbeddingsRequest, TeiEmbedRequest


def test_document_is_generated_from_the_handlers_models() -> None:
    client, _ = make(max_inputs=8)
    with client:
        client.post("/v1/embeddings", json={"model": "minilm", "input": "x"})  # connected: the width is known
        doc = client.get("/openapi.json").json()
    assert doc["openapi"] == "3.1.0"
    assert {p: sorted(ops) for p, ops in doc["paths"].items()} == {
        "/v1/embeddings": ["post"], "/embeddings": ["post"], "/embed": ["post"], "/": ["post"],
        "/v1/models": ["get"], "/v1/models/{name}": ["get"], "/health": ["get"], "/ready": ["get"],
        "/metrics": ["get"]}
    schemas = doc["components"]["schemas"]
    for model in (EmbeddingsRequest, TeiEmbedRequest):  # the same fields, types and defaults as the model's own
        own = model.model_json_schema()
        assert set(schemas[model.__name__]["properties"]) == set(own["properties"])
        assert schemas[model.__name__]["additionalProperties"] is False
        for name, prop in own["properties"].items():
            if name not in ("dimensions", "model", "input", "inputs"):  # the deployment's, checked below
                assert schemas[model.__name__]["properties"][name] == prop
    props = schemas["EmbeddingsRequest"]["properties"]
    assert props["model"]["enum"] == ["minilm", "all-MiniLM-L6-v2"]
    assert props["input"]["anyOf"][1]["maxItems"] == 8 and props["input"]["anyOf"][0]["pattern"] == VISIBLE_PATTERN
    assert props["dimensions"]["anyOf"][0]["const"] == DIM
    post = doc["paths"]["/v1/embeddings"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/EmbeddingsRequest")
    assert {"200", "400", "404", "413", "503", "504"} <= set(post["responses"])
    assert set(post["responses"]["200"]["headers"]) == {"x-tokenization-time", "x-queue-time",
                                                        "x-inference-time", "x-total-time"}
    tei = doc["paths"]["/embed"]["post"]["responses"]
    assert {"413", "422", "429"} <= set(tei) and "retry-after" in tei["429"]["headers"]
    assert "security" not in post and "securitySchemes" not in doc["components"]


def test_document_with_a_key_declares_bearer_auth_and_docs_page() -> None:
    client, _ = make(api_keys=frozenset({KEY}))
    with client:
        doc = client.get("/openapi.json").json()  # no key needed for the document
        page = client.get("/docs")
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert doc["paths"]["/v1/embeddings"]["post"]["security"] == [{"bearer": []}]
    assert "401" in doc["paths"]["/v1/embeddings"]["post"]["responses"]
    assert "security" not in doc["paths"]["/health"]["get"]
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "/openapi.json" in page.text


@pytest.mark.parametrize("start,stop", [(0, 0x3000 + 1), (0xFEFF, 0xFEFF + 1)])
def test_the_text_pattern_says_what_the_validator_accepts(start: int, stop: int) -> None:
    """Every one-character text (the BMP's start, the CJK space, U+FEFF) and a few longer ones: the document's
    pattern matches exactly the texts the handler accepts (a visible character, no NUL)."""
    pattern = re.compile(VISIBLE_PATTERN)
    accepted = lambda t: bool(t.strip()) and "\x00" not in t  # noqa: E731 - the validator's rule
    for code in range(start, stop):
        text = chr(code)
        assert bool(pattern.search(text)) == accepted(text), hex(code)
    for text in ("a\x00b", " \u3000x ", "\x1c\x1d", "\u00a0", "中 文", "\ufeff"):
        assert bool(pattern.search(text)) == accepted(text), repr(text)
    assert sys.maxunicode > 0xFFFF
