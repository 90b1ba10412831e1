"""OpenAI-compatible embeddings gateway in front of the Triton text endpoint (extra: gateway).

    bge-triton gateway --triton 127.0.0.1:8001 --model bge_large_zh        # /openapi.json, /docs
    # then: OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="-").embeddings.create(model=..., input=[...])
"""
from bge_triton.extras import require

require("gateway", "bge_triton.gateway")

from bge_triton.gateway.app import create_app  # noqa: E402
from bge_triton.gateway.settings import GatewaySettings, build_parser, settings_from_args  # noqa: E402

__all__ = ["create_app", "GatewaySettings", "build_parser", "settings_from_args"]
