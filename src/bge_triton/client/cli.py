"""`python -m bge_triton.client`: embed texts (JSON lines on stdout) or check the server's health."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from bge_triton.client.core import ClientSettings
from bge_triton.client.errors import KitError
from bge_triton.client.retry import RetryPolicy
from bge_triton.client.sync import EmbeddingClient

__all__ = ["build_parser", "main", "settings_from_args"]


def build_parser() -> argparse.ArgumentParser:
    """The CLI's flags; one ClientSettings is built from them."""
    parser = argparse.ArgumentParser(prog="python -m bge_triton.client", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None,
                        help="host:port of tritonserver (default 127.0.0.1:8001 gRPC, 127.0.0.1:8000 with --http)")
    common.add_argument("--http", action="store_true", help="use HTTP instead of gRPC")
    common.add_argument("--model", default="bge_large_zh", help="text endpoint NAME (tensor mode calls NAME_onnx)")
    common.add_argument("--tensor", metavar="TOKENIZER_DIR", default=None,
                        help="tensor mode: tokenize here with this tokenizer dir/hub id and call NAME_onnx")
    common.add_argument("--timeout", type=float, default=10.0, help="per-request timeout, seconds")
    common.add_argument("--retries", type=int, default=3, help="retries on overload/connection errors")
    sub = parser.add_subparsers(dest="command", required=True)
    embed = sub.add_parser("embed", parents=[common], help="embed TEXT... and print one JSON line per text")
    embed.add_argument("--query", action="store_true", help="embed as search queries (instruction prepended)")
    embed.add_argument("--no-truncate", action="store_true", help="fail over-long texts instead of truncating")
    embed.add_argument("--digits", type=int, default=6, help="round vector components to this many digits")
    embed.add_argument("texts", nargs="+", metavar="TEXT", help="texts to embed ('-' reads lines from stdin)")
    sub.add_parser("health", parents=[common], help="print server/model readiness and the model spec as JSON")
    return parser


def settings_from_args(args: argparse.Namespace) -> ClientSettings:
    """The one settings object for this command."""
    return ClientSettings(url=args.url, model=args.model, protocol="http" if args.http else "grpc",
                          mode="tensor" if args.tensor else "text", tokenizer=args.tensor,
                          timeout_s=args.timeout, retry=RetryPolicy(max_attempts=max(1, args.retries + 1)),
                          truncate=not getattr(args, "no_truncate", False))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 kit error, 2 usage)."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        client = EmbeddingClient(settings=settings)
        if args.command == "health":
            report = client.health()
            client.close()
            print(json.dumps(report, ensure_ascii=False))
            return 0 if report.get("ok") else 1
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()] if args.texts == ["-"] else args.texts
        with client:
            vectors = client.embed_queries(texts) if args.query else client.embed_documents(texts)
        for text, vector in zip(texts, vectors, strict=True):
            print(json.dumps({"text": text, "dim": len(vector),
                              "embedding": [round(float(x), args.digits) for x in vector]}, ensure_ascii=False))
        return 0
    except KitError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
