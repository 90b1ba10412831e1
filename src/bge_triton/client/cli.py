"""`bge-triton embed` / `bge-triton health`: embed texts (JSON lines on stdout) or check the server's health."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from bge_triton import flags
from bge_triton.client.core import ClientSettings
from bge_triton.client.errors import KitError
from bge_triton.client.retry import RetryPolicy
from bge_triton.client.sync import EmbeddingClient

__all__ = ["build_parser", "main", "settings_from_args"]


def build_parser() -> argparse.ArgumentParser:
    """The CLI's flags; one ClientSettings is built from them."""
    parser = flags.parser("bge-triton", "Embed texts (JSON lines on stdout) or check a running server's health "
                          "through the client SDK.")
    common = argparse.ArgumentParser(add_help=False)
    flags.add_url(common)
    flags.add_model(common, help="the served model's name (the text endpoint; --tensor calls NAME_onnx)")
    common.add_argument("--tensor", metavar="TOKENIZER", default=None, help="tensor mode: tokenize here with this "
                        "tokenizer (a directory or hub id) and call NAME_onnx (default: off, the server tokenizes)")
    common.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="per-request timeout")
    common.add_argument("--retries", type=int, default=3, help="retries on overload and connection errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    embed = flags.subcommand(sub, "embed", "embed TEXT... and print one JSON line per text", parents=[common])
    embed.add_argument("--query", action="store_true", help="embed as search queries (instruction prepended)")
    embed.add_argument("--no-truncate", action="store_true", help="fail over-long texts instead of truncating")
    embed.add_argument("--digits", type=int, default=6, help="round vector components to this many digits")
    embed.add_argument("texts", nargs="+", metavar="TEXT", help="texts to embed ('-' reads lines from stdin)")
    flags.subcommand(sub, "health", "print server and model readiness, the model spec and a canary embedding as "
                     "JSON", parents=[common])
    return parser


def settings_from_args(args: argparse.Namespace) -> ClientSettings:
    """The one settings object for this command."""
    url = flags.server_url(args.url)
    return ClientSettings(url=url.address, model=args.model, protocol=url.protocol,
                          mode="tensor" if args.tensor else "text", tokenizer=args.tensor,
                          timeout_s=args.timeout, retry=RetryPolicy(max_attempts=max(1, args.retries + 1)),
                          truncate=not getattr(args, "no_truncate", False))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 kit error, 2 usage)."""
    args = flags.parse(build_parser(), argv)
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
