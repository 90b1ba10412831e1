"""bge_triton.errors.kind_of: the one label of an outcome in the chaos and soak reports, by type or status code."""
from __future__ import annotations

import asyncio

import pytest

from bge_triton.errors import (
    InputError,
    KitError,
    ModelConfigError,
    Overloaded,
    ServerNotReady,
    ServerUnavailable,
    Timeout,
    kind_of,
)


class _Sub(Overloaded):
    """A subclass defined outside bge_triton.errors is labelled by the kit class it is."""


@pytest.mark.parametrize("exc, kind", [
    (Overloaded("queue full"), "Overloaded"), (Timeout("deadline"), "Timeout"),
    (ServerUnavailable("down"), "ServerUnavailable"), (InputError("empty"), "InputError"),
    (ModelConfigError("unknown model"), "ModelConfigError"), (ServerNotReady("no"), "ServerNotReady"),
    (KitError("other"), "KitError"), (_Sub("x"), "Overloaded"),
    (ValueError("not the kit's"), "raw:ValueError"), (asyncio.TimeoutError(), "raw:TimeoutError"),
])
def test_an_exception_is_labelled_by_its_type_not_its_message(exc: BaseException, kind: str) -> None:
    assert kind_of(exc) == kind


def test_a_timeout_message_on_another_type_is_not_a_timeout() -> None:
    assert kind_of(ServerUnavailable("no answer within timeout_s=5")) == "ServerUnavailable"


@pytest.mark.parametrize("status, kind", [
    ("StatusCode.INVALID_ARGUMENT", "InputError"), ("400", "InputError"), (422, "InputError"),
    ("StatusCode.NOT_FOUND", "ModelConfigError"), (404, "ModelConfigError"),
    ("StatusCode.UNAVAILABLE", "ServerUnavailable"), (503, "ServerUnavailable"),
    ("RESOURCE_EXHAUSTED", "Overloaded"), (429, "Overloaded"), ("StatusCode.DEADLINE_EXCEEDED", "Timeout"),
    ("StatusCode.INTERNAL", "KitError"), (500, "KitError"), ("", "ok"), (None, "ok"), (200, "ok"),
])
def test_a_status_is_labelled_by_the_error_it_stands_for(status: object, kind: str) -> None:
    assert kind_of(status) == kind


def test_a_grpc_status_code_enum() -> None:
    grpc = pytest.importorskip("grpc")
    assert kind_of(grpc.StatusCode.UNAVAILABLE) == "ServerUnavailable"
    assert kind_of(grpc.StatusCode.INVALID_ARGUMENT) == "InputError"
