"""Verify a served model against the reference vectors its export wrote (NAME_onnx/1/reference.json).

`bge-triton verify --url HOST:PORT --model NAME` (gRPC or HTTP, tritonclient) is the command; `check()` is the
same check as a library call (the gateway's /ready); `standalone.py` is the same judgement in one file that
needs only python3 + numpy, the server image's readiness check (deploy/verify-ready.sh). All three print the
same message. docs/export.md, "Verify".
"""
from __future__ import annotations

from pathlib import Path

from .standalone import (
    REFERENCE_FILE,
    ProbeResult,
    Reference,
    Result,
    VerifyError,
    judge,
    load_reference,
    reference_path,
    resolve_reference,
    run_check,
)

__all__ = ["check", "Result", "ProbeResult", "Reference", "VerifyError", "load_reference", "reference_path",
           "judge", "REFERENCE_FILE", "DEFAULT_REPOSITORY"]

#: where `bge-triton export` writes by default and compose mounts: the reference is read from here when no
#: --reference is given (the server's own copy lies in the same files, mounted at /models)
DEFAULT_REPOSITORY = Path("model_repository")


def check(url: str, model: str, reference: str | Path | None = None, repository: str | Path | None = None,
          protocol: str | None = None, timeout_s: float = 30.0) -> Result:
    """Embed the export's probes through `model` at `url` and judge them; never raises for a server fault.

    reference: the export's reference.json; default REPOSITORY/<encoder of model>/1/reference.json with
    REPOSITORY defaulting to ./model_repository. Returns a Result whose `ok` and `message` say the verdict;
    a server that cannot be reached or a missing reference give ok=False, fault="unavailable".
    """
    from .triton import TritonTransport

    try:
        with TritonTransport(url, protocol, timeout_s) as transport:
            path = resolve_reference(transport, model, repository or DEFAULT_REPOSITORY, reference)
            return run_check(transport, model, load_reference(path))
    except VerifyError as err:
        return Result(model, "?", "?", "?", ok=False, fault="unavailable", message=f"verify could not run: {err}")
