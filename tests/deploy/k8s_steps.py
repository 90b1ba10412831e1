"""The numbered steps of docs/k8s.md ("## Steps"), read for the tests that follow them: tests/deploy/test_kube_play.py
runs them in their order (podman kube play in place of a cluster), tests/unit/test_k8s_steps.py checks the order.
"""
from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "k8s.md"
# What each step must hold, in the order a user runs them and the kube play test follows them
ORDER = (
    ("build and push the images", "bash deploy/build-images.sh --push"),
    ("write the overlay with the registry's images", "my-bge/kustomization.yaml"),
    ("create the namespace", "kubectl apply -f deploy/k8s/base/namespace.yaml"),
    ("the admin key's Secret, in the namespace", "kubectl -n bge-triton create secret generic triton-admin"),
    ("the gateway keys' Secret, in the namespace", "kubectl -n bge-triton create secret generic gateway-api-keys"),
    ("apply the overlay", "kubectl apply -k my-bge"),
    ("wait for Triton", "rollout status deploy/triton"),
    ("wait for the gateway", "rollout status deploy/gateway"),
    ("reach the gateway", "port-forward svc/gateway 8080:8080"),
    ("call it with the key", "curl -fsS http://127.0.0.1:8080/v1/embeddings"),
)
SECRET = re.compile(r'create secret generic (\S+) --from-literal=(\w+)="(\$\([^"]+\))"')


def steps(doc: Path = DOC) -> dict[int, list[str]]:
    """Step number -> its command lines (comment lines dropped, `\\` continuations joined), from the first ```bash
    block after "## Steps"."""
    text = doc.read_text()
    start = text.index("## Steps")
    block = text[text.index("```bash\n", start) + len("```bash\n"):]
    block = block[:block.index("```")]
    out: dict[int, list[str]] = {}
    number = 0
    for line in block.replace("\\\n", " ").splitlines():
        head = re.match(r"#\s*(\d+)\.", line)
        if head:
            number = int(head.group(1))
            out[number] = []
        elif line.strip() and not line.lstrip().startswith("#"):
            out.setdefault(number, []).append(line.strip())
    return out


def where(found: dict[int, list[str]], text: str) -> tuple[int, int]:
    """(step, line) of the first command line holding `text`; KeyError when none does."""
    for number in sorted(found):
        for i, line in enumerate(found[number]):
            if text in line:
                return number, i
    raise KeyError(f"no step of {DOC.name} runs `{text}`")


def order_problems(doc: Path = DOC) -> list[str]:
    """What is missing from the steps or out of ORDER (empty when they can be followed as the test does)."""
    found = steps(doc)
    problems, last, previous = [], (0, -1), ""
    for what, text in ORDER:
        try:
            here = where(found, text)
        except KeyError as exc:
            problems.append(f"{what}: {exc}")
            continue
        if here < last:
            problems.append(f"{what} (`{text}`, step {here[0]}) comes before {previous}")
        last, previous = max(last, here), what
    return problems


def secrets(found: dict[int, list[str]]) -> list[tuple[str, str, str]]:
    """(Secret name, key, the shell expression the doc makes its value with) of each `create secret` line."""
    return [m.groups() for lines in found.values() for line in lines for m in [SECRET.search(line)] if m]
