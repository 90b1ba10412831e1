"""docs/k8s.md's steps can be followed in their order (the kube play test follows them so): images and overlay, then
the namespace before the Secrets in it, then apply, wait and call; and the order check catches a swapped doc."""
from __future__ import annotations

from pathlib import Path

from tests.deploy import k8s_steps


def test_the_steps_are_complete_and_in_order() -> None:
    assert k8s_steps.order_problems() == []
    found = k8s_steps.steps()
    assert sorted(found) == [1, 2, 3, 4, 5]
    assert [name for name, _, _ in k8s_steps.secrets(found)] == ["triton-admin", "gateway-api-keys"]


def test_secrets_before_their_namespace_are_caught(tmp_path: Path) -> None:
    text = k8s_steps.DOC.read_text()
    namespace = "kubectl apply -f deploy/k8s/base/namespace.yaml\n"
    assert text.count(namespace) == 1
    swapped = text.replace(namespace, "").replace("# 4. Apply", namespace + "# 4. Apply")
    doc = tmp_path / "k8s.md"
    doc.write_text(swapped)
    problems = k8s_steps.order_problems(doc)
    assert problems and problems[0].startswith("the admin key's Secret") and "before create the namespace" in \
        problems[0], problems


def test_the_memo_is_gone_and_no_memo_replaces_it() -> None:
    assert "for the lead" not in k8s_steps.DOC.read_text()
