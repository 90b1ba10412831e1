"""docs/k8s.md's steps, in their order, from a fresh clone, with `podman kube play` in place of a cluster: the images
this repository builds (deploy/build-images.sh, on the local stand-ins of the registry images: deploy/standins/
README.md says how each differs from the real one) tagged with the doc's registry, the doc's overlay of
deploy/k8s/overlays/gpu written as the doc writes it, the namespace's Secrets, the Deployments, the doc's curl.

Runs exactly as `kubectl kustomize` renders that overlay: every container's command, args, env and volume
mounts, the pod and container securityContext (runAsUser/runAsGroup, readOnlyRootFilesystem, dropped
capabilities), init containers before the main one, the ConfigMap (canary.sh) and the two key Secrets.
Checked: the export init container completes (kube play fails when an init container fails), the Triton
pod's startup command (verify-ready.sh: the served model against its export's reference vectors) and readiness
command (canary.sh), run with `podman exec` in the container with the container's env, pass, the admin API
refuses a call without its key, the root filesystem is read-only, and the gateway answers an embedding with its
key (the doc's curl) and 401 without one.

What the test changes, and why (each change is made in `adapt()` below, nothing else is):
- step 1 tags the images (`--registry`) where the doc pushes them (`--push`): no registry here, and kube play finds
  the tagged local images; the GPU resource requests of the gpu overlay are stripped - the stand-ins run on CPUs;
- the encoder: served as the CPU variant's python model (bge_triton.server.cpu_variant, one instance, no CPU
  lock file since /models is read-only in the Triton container), because the stand-in server image has no
  onnxruntime backend (the NGC image has it; the stand-in carries ONNX Runtime 1.19.2 as a Python module for this
  model instead). One added init container, on the kit image, renders the variant in place after the export.
  On a GPU cluster the encoder is the onnxruntime backend of the NGC image and none of this applies;
- the export's --model: synthetic:bge-small-zh, as there is no model hub here, and CANARY_DIM follows it
  (512 dims instead of BGE-Large's 1024);
- replicas 1 and restartPolicy OnFailure: podman 4.3 applies the pod's restart policy to init containers, so
  `Always` restarts a finished export forever (Kubernetes never restarts a successful init container);
- emptyDirs become hostPath folders of mode 0777 (the kubelet's emptyDir mode) under the test's tmp dir:
  podman 4.3 turns an emptyDir into a podman volume named after it, shared by every pod that uses the name
  (both pods have a `tmp`), and copies the image's folder at the mount point into it (/dev/shm: root, 0755, so
  uid 1000 cannot create the python backend's shared memory); `medium: Memory` is not tmpfs here either;
- names prefixed per run: ConfigMap and Secret volumes become podman volumes named after the object;
- Secrets become podman secrets in the two forms podman 4.3 reads: a JSON map of base64 values for env
  secretKeyRef, a Secret object for secret volumes (its `data` values written to the files undecoded, so they
  are given plain), with the volume's `items` applied by the test (4.3 ignores
  `items`, which the gateway's key file name depends on, and crashes on an unset `optional`: set to false,
  Kubernetes' default);
- `$(VAR)` in command and args is expanded from the container's env by the test, as the kubelet does (podman
  4.3 passes it through);
- Service DNS: the gateway pod gets a hostAliases entry `triton` -> the Triton pod's IP;
- every container port is published on 127.0.0.1, on a free port (hostIP/hostPort: podman 4.3 publishes a port
  without one on the host's same port, so two runs, or a Triton already on 8001, would collide);
- probes: podman 4.3 runs no readiness or startup probes; the test runs them itself (see above).
A real cluster checks what kube play cannot: GPU scheduling, the HPA and prometheus-adapter, NetworkPolicies,
PodDisruptionBudgets, rolling updates (docs/k8s.md).
"""
from __future__ import annotations

import base64
import copy
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from tests.deploy import k8s_steps
from tests.deploy.ci import must_run
from tests.deploy.stack import REPO, free_ports, why_podman_cannot_run
from tests.deploy.stack import http_raw as http

K8S = REPO / "deploy" / "k8s"
STANDINS = REPO / "deploy" / "standins"
STANDIN_IMAGES = ("docker.io/library/python:3.11-slim", "nvcr.io/nvidia/tritonserver:24.10-py3")
MODEL, MODEL_DIM = "synthetic:bge-small-zh", 512
EXPORTER = ["bge-triton", "export"]  # the export init container's command
PREFIX = f"kp{os.getpid()}"
START_TIMEOUT_S = 900  # generous: progress-bounded waits on a busy 2-core machine


SKIP = why_podman_cannot_run(("kubectl",))
must_run(SKIP, "the kube play tests")
pytestmark = [pytest.mark.deploy, pytest.mark.timeout(3600),
              pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


def podman(*args: str, timeout: float = 600, check: bool = True, stdin: bytes | None = None) -> str:
    proc = subprocess.run(["podman", *args], input=stdin, capture_output=True, timeout=timeout)
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:4])}... exit {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}")
    return out


# ---------------------------------------------------------------- docs/k8s.md's steps


def bash(script: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 3600) -> str:
    """Run lines of the doc in bash (-e: the first failing line fails the step); stdout, or the failure with output."""
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"exit {proc.returncode} of:\n{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def clone(tmp: Path) -> Path:
    """A fresh clone of the commit under test (the doc's steps run from a clone's root)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
    bash(f"git clone -q --no-checkout {REPO} clone && git -C clone checkout -q {head.stdout.strip()}", tmp, timeout=300)
    return tmp / "clone"


def steps_1_and_2(checkout: Path, found: dict[int, list[str]]) -> str:
    """Steps 1-2 as written, but `--registry` for `--push` (no registry here: the images are tagged with the
    registry's names and stay local, where kube play finds them); the stand-ins first when podman lacks them.
    Returns the registry the doc names."""
    if not all(subprocess.run(["podman", "image", "exists", i]).returncode == 0 for i in STANDIN_IMAGES):
        bash(f"bash {checkout / 'deploy/standins/build.sh'}", checkout, timeout=1800)
    lines = [line.replace("build-images.sh --push", "build-images.sh --registry") for line in found[1] + found[2]]
    bash("\n".join(lines), checkout, env={"LOADTEST": "0"})
    return bash("\n".join(found[1][:1]) + '\nprintf %s "$REGISTRY"', checkout)


# ---------------------------------------------------------------- manifests -> kube play


RENDER_CPU_VARIANT = """
import shutil, tempfile
from pathlib import Path
from bge_triton.server.cpu_variant import CpuVariant, render_cpu_variant
repo = Path("/models")
out = render_cpu_variant(repo, Path(tempfile.mkdtemp()) / "cpu", CpuVariant(cpu_lock=False))
for src in sorted(out.rglob("*")):
    if src.is_file() and not src.is_symlink():  # configs and model files of the variant; links are the export's
        dst = repo / src.relative_to(out)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        print("cpu variant:", dst)
"""


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command/args: defined variables only, $$ escapes."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def adapt(docs: list[dict], registry: str, secret_values: dict[tuple[str, str], str],
          ports: dict[tuple[str, str], int], volumes: Path) -> tuple[list[dict], dict[str, dict[str, str]]]:
    """The rendered overlay as podman 4.3 can play it (the module docstring lists every change).
    registry: the one the overlay's `images:` named (every image must come from it); secret_values: (Secret, key)
    -> value; ports: (Deployment, port name) -> host port on 127.0.0.1;
    volumes: the folder that holds the emptyDirs.
    Returns the Deployments + ConfigMaps, and the podman secrets to create: name -> {"kind": env|volume, key: value}."""
    out = [copy.deepcopy(d) for d in docs if d["kind"] in ("Deployment", "ConfigMap")
           and d["metadata"].get("namespace") == "bge-triton"]  # not the adapter rules (namespace monitoring)
    renamed = {d["metadata"]["name"]: f"{PREFIX}-{d['metadata']['name']}" for d in out if d["kind"] == "ConfigMap"}
    podman_secrets: dict[str, dict[str, str]] = {}
    for d in out:
        original = d["metadata"]["name"]
        d["metadata"]["name"] = f"{PREFIX}-{original}"
        d["metadata"].pop("namespace", None)
        if d["kind"] != "Deployment":
            continue
        d["spec"]["replicas"] = 1
        pod = d["spec"]["template"]["spec"]
        pod["restartPolicy"] = "OnFailure"
        for v in pod["volumes"]:
            v["name"] = f"{d['metadata']['name']}-{v['name']}"
            if "emptyDir" in v:  # a fresh folder, mode 0777 as the kubelet makes an emptyDir's
                folder = volumes / v["name"]
                folder.mkdir(parents=True)
                folder.chmod(0o777)
                del v["emptyDir"]
                v["hostPath"] = {"path": str(folder), "type": "Directory"}
            if "configMap" in v:
                v["configMap"]["name"] = renamed[v["configMap"]["name"]]
            if "secret" in v:
                src = v["secret"]
                keys = [key for secret, key in secret_values if secret == src["secretName"]]
                # podman 4.3 ignores `items`: the podman secret holds the items' paths as its keys
                items = src.pop("items", None) or [{"key": k, "path": k} for k in keys]
                name = f"{PREFIX}-{src['secretName']}"
                podman_secrets[name] = {"kind": "volume", **{i["path"]: secret_values[(src["secretName"], i["key"])]
                                                            for i in items}}
                src["secretName"] = name
                src.setdefault("optional", False)  # Kubernetes' default; podman 4.3 dereferences it unset (panic)
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert c["image"].startswith(f"{registry}/"), f"{c['name']}: {c['image']} is not from the overlay's"
            for section in ("requests", "limits"):
                c.get("resources", {}).get(section, {}).pop("nvidia.com/gpu", None)
            for m in c.get("volumeMounts", []):
                m["name"] = f"{d['metadata']['name']}-{m['name']}"
            env: dict[str, str] = {}
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    value = secret_values[(ref["name"], ref["key"])]
                    ref["name"] = f"{PREFIX}-{ref['name']}"
                    podman_secrets.setdefault(ref["name"], {"kind": "env"})[ref["key"]] = value
                    env[e["name"]] = value
                else:
                    env[e["name"]] = e.get("value", "")
                if e["name"] == "CANARY_DIM":
                    e["value"] = str(MODEL_DIM)
            for key in ("command", "args"):
                if key in c:
                    c[key] = [expand(str(a), env) for a in c[key]]
                    if c[key][:2] == EXPORTER:  # the export's --model-id (what it exports)
                        c[key][c[key].index("--model-id") + 1] = MODEL
            for p in c.get("ports", []):  # podman 4.3 publishes a port without hostPort as hostPort = containerPort
                assert (original, p.get("name")) in ports, f"no host port for {original}'s port {p.get('name')}"
                p["hostPort"], p["hostIP"] = ports[(original, p["name"])], "127.0.0.1"
        if any(c["name"] == "export" for c in pod.get("initContainers", [])):
            export = next(c for c in pod["initContainers"] if c["name"] == "export")
            pod["initContainers"].append({
                "name": "cpu-variant", "image": export["image"],
                "command": ["python3", "-c", RENDER_CPU_VARIANT.strip() + "\n"],
                "env": [{"name": "HOME", "value": "/tmp"}], "securityContext": copy.deepcopy(export["securityContext"]),
                "volumeMounts": [dict(m) for m in export["volumeMounts"] if m["mountPath"] in ("/models", "/tmp")]})
    return out, podman_secrets


class _Dumper(yaml.SafeDumper):
    """No anchors or aliases (podman's YAML reader rejected them), block style for multi-line strings."""

    def ignore_aliases(self, data: object) -> bool:
        return True


_Dumper.add_representer(str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v,
                                                             style="|" if "\n" in v else None))


def dump(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, allow_unicode=True, sort_keys=False)


def create_secret(name: str, spec: dict[str, str]) -> None:
    kind, data = spec["kind"], {k: v for k, v in spec.items() if k != "kind"}
    if kind == "env":  # podman 4.3 reads env secrets as a JSON map of base64 values
        payload = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    else:  # and writes a secret volume's `data` values into the files as they are, without decoding them
        payload = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": data}
    podman("secret", "create", name, "-", stdin=json.dumps(payload).encode())


def play(path: Path) -> None:
    """`podman kube play` with every container's log in one file beside the YAML: init containers are removed
    when they exit, and their output with them; the file keeps it for the failure message."""
    log = path.with_suffix(".log")
    try:
        podman("kube", "play", "--log-driver=k8s-file", f"--log-opt=path={log}", str(path), timeout=START_TIMEOUT_S)
    except AssertionError as err:
        lines = log.read_text(errors="replace").splitlines()[-60:] if log.exists() else ["(no log)"]
        raise AssertionError(f"{err}\ncontainer output (last 60 lines):\n" + "\n".join(lines)) from None


def pod_ip(pod: str) -> str:
    infra = json.loads(podman("pod", "inspect", pod))
    infra_id = (infra[0] if isinstance(infra, list) else infra)["InfraContainerID"]
    nets = json.loads(podman("inspect", infra_id))[0]["NetworkSettings"]["Networks"]
    return next(n["IPAddress"] for n in nets.values() if n.get("IPAddress"))


def container_running(name: str) -> bool:
    return podman("inspect", "--format", "{{.State.Running}}", name, check=False).strip() == "true"


def wait_http(url: str, container: str, ok: Callable[[int, bytes], bool], what: str) -> None:
    """Poll until ok(status, body), failing at once (with the logs) when the container stops."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        status, body = http("GET", url)
        if ok(status, body):
            return
        if not container_running(container):
            pytest.fail(f"{container} stopped before {what}:\n{podman('logs', container, check=False)[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: no answer within {START_TIMEOUT_S} s (last {status} {body[:300]!r}):\n"
                        f"{podman('logs', container, check=False)[-4000:]}")
        time.sleep(2)


# ---------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """docs/k8s.md's steps, in their order, from a fresh clone: 1-2 build and tag the images and write the overlay,
    3 the namespace (none in podman) and the Secrets (as podman secrets, with values made as the doc makes them),
    4 apply (kube play of what `kubectl kustomize` renders, adapted) and wait, 5 call (the doc's curl, on the host
    port kube play published instead of the port-forward)."""
    problems = k8s_steps.order_problems()
    assert not problems, "docs/k8s.md's steps cannot be followed in order: " + "; ".join(problems)
    found = k8s_steps.steps()
    tmp = tmp_path_factory.mktemp("kube-play")
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    checkout = clone(tmp)
    registry = steps_1_and_2(checkout, found)
    timings["steps 1-2: clone, images (build or cache), overlay"] = time.monotonic() - t0
    tagged = [f"{registry}/{n}:{t}" for n, t in re.findall(r"newName: \S+/(\S+)\n\s+newTag: \"(\S+)\"",
                                                            (checkout / "images.yaml").read_text())]
    docs = [d for d in yaml.safe_load_all(bash("kubectl kustomize my-bge", checkout)) if d]
    values = {(name, key): bash(f'printf %s "{expr}"', checkout) for name, key, expr in k8s_steps.secrets(found)}
    assert set(values) == {("triton-admin", "key"), ("gateway-api-keys", "keys")}, values
    admin_key, gateway_key = values[("triton-admin", "key")], values[("gateway-api-keys", "keys")]
    # every container port on a free one: two runs side by side (or a local Triton on 8001) must not collide
    triton_port, grpc_port, metrics_port, gateway_port = free_ports(4)
    ports = {("triton", "http"): triton_port, ("triton", "grpc"): grpc_port, ("triton", "metrics"): metrics_port,
             ("gateway", "http"): gateway_port}
    played, podman_secrets = adapt(docs, registry, values, ports, tmp / "volumes")
    names = {d["metadata"]["name"]: d for d in played}
    triton, gateway = names[f"{PREFIX}-triton"], names[f"{PREFIX}-gateway"]
    gateway_pod = gateway["spec"]["template"]["spec"]
    configmaps = [d for d in played if d["kind"] == "ConfigMap"]
    files = {"triton": tmp / "triton.yaml", "gateway": tmp / "gateway.yaml"}
    made_secrets: list[str] = []
    state = {"admin_key": admin_key, "gateway_key": gateway_key, "triton_port": triton_port,
             "gateway_port": gateway_port, "timings": timings, "checkout": checkout, "steps": found,
             "triton_ctr": f"{triton['metadata']['name']}-pod-0-triton",
             "gateway_ctr": f"{gateway['metadata']['name']}-pod-0-gateway", "triton": triton}
    try:
        for name, spec in podman_secrets.items():
            create_secret(name, spec)
            made_secrets.append(name)
        files["triton"].write_text(dump([*configmaps, triton]))
        t0 = time.monotonic()
        play(files["triton"])  # returns after the init containers
        timings["triton pod: kube play (export + cpu variant init containers)"] = time.monotonic() - t0
        wait_http(f"http://127.0.0.1:{triton_port}/v2/health/ready", state["triton_ctr"],
                  lambda s, _: s == 200, "Triton ready (/v2/health/ready)")
        timings["triton pod: ready after kube play"] = time.monotonic() - t0
        gateway_pod["hostAliases"] = [{"ip": pod_ip(f"{triton['metadata']['name']}-pod-0"), "hostnames": ["triton"]}]
        files["gateway"].write_text(dump([*configmaps, gateway]))
        t0 = time.monotonic()
        play(files["gateway"])
        timings["gateway pod: kube play"] = time.monotonic() - t0
        wait_http(f"http://127.0.0.1:{gateway_port}/ready", state["gateway_ctr"], lambda s, _: s == 200,
                  "gateway ready (/ready: a canary embedding through Triton)")
        timings["gateway pod: ready after kube play"] = time.monotonic() - t0
        yield state
    finally:
        print("\nkube play timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
        for path in files.values():
            if path.exists():
                podman("kube", "down", str(path), check=False, timeout=300)
        volumes = [d["metadata"]["name"] for d in configmaps] + made_secrets  # 4.3: volumes named after them
        for volume in volumes:
            if subprocess.run(["podman", "volume", "exists", volume]).returncode == 0:
                podman("volume", "rm", "-f", volume, check=False)
        for name in made_secrets:
            podman("secret", "rm", name, check=False)
        for image in tagged:  # step 1's registry names (the images keep their local names)
            podman("rmi", image, check=False)


def test_export_init_container_completed_and_triton_serves_the_export(cluster: dict) -> None:
    """kube play returns only after the init containers exited 0; the models are the export's, served."""
    status, body = http("POST", f"http://127.0.0.1:{cluster['triton_port']}/v2/repository/index")
    assert status == 403, (status, body)  # the admin API wants the key (the $(VAR)s of the args, expanded)
    status, body = http("POST", f"http://127.0.0.1:{cluster['triton_port']}/v2/repository/index",
                        headers={"triton-admin-key": cluster["admin_key"]})
    assert status == 200, (status, body)
    models = {m["name"]: m.get("state") for m in json.loads(body)}
    assert models == {"bge_large_zh": "READY", "bge_large_zh_onnx": "READY"}
    report = podman("exec", cluster["triton_ctr"], "cat", "/models/bge_large_zh_onnx/1/export_report.json")
    report = json.loads(report)
    assert report["model"] == MODEL and report["fidelity"]["passed"] is True
    user = podman("exec", cluster["triton_ctr"], "id", "-u").strip()
    assert user == str(cluster["triton"]["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
    touch = subprocess.run(["podman", "exec", cluster["triton_ctr"], "touch", "/kit-rootfs-probe"],
                           capture_output=True, text=True)
    assert touch.returncode != 0 and "Read-only file system" in touch.stderr


def test_triton_probe_commands_pass(cluster: dict) -> None:
    """The pod's startupProbe (verify-ready.sh: the served model against its export's reference vectors) and
    readinessProbe (canary.sh, from the ConfigMap) exec commands, in the container, with its env, in that order."""
    server = next(c for c in cluster["triton"]["spec"]["template"]["spec"]["containers"] if c["name"] == "triton")
    for kind, says in (("startupProbe", ""), ("readinessProbe", f"embeddings of {MODEL_DIM} dims from bge_large_zh")):
        probe = server[kind]
        proc = subprocess.run(["podman", "exec", cluster["triton_ctr"], *probe["exec"]["command"]],
                              capture_output=True, text=True, timeout=probe["timeoutSeconds"] * 4)
        assert proc.returncode == 0, f"{kind}: {proc.stdout}{proc.stderr}"
        assert says in proc.stdout, proc.stdout


def test_gateway_answers_with_its_key_only(cluster: dict) -> None:
    url = f"http://127.0.0.1:{cluster['gateway_port']}/v1/embeddings"
    body = {"model": "bge_large_zh", "input": ["检索增强生成", "kube play"]}
    status, answer = http("POST", url, body, {"Authorization": f"Bearer {cluster['gateway_key']}"})
    assert status == 200, answer[:500]
    data = json.loads(answer)
    vectors = [d["embedding"] for d in data["data"]]
    assert [len(v) for v in vectors] == [MODEL_DIM, MODEL_DIM]
    assert all(abs(sum(x * x for x in v) - 1.0) < 1e-2 for v in vectors)
    assert data["usage"]["prompt_tokens"] > 2
    status, answer = http("POST", url, body)
    assert status == 401, answer[:300]
    status, answer = http("POST", url, body, {"Authorization": "Bearer " + "x" * 43})
    assert status == 401, answer[:300]
    user = podman("exec", cluster["gateway_ctr"], "id", "-u").strip()
    assert user == "10001"


def test_step_5_the_docs_call_answers_with_the_secrets_key(cluster: dict) -> None:
    """docs/k8s.md's step 5 as written: the key read from the gateway's Secret, the curl through the gateway (on the
    host port kube play published where the doc port-forwards 8080)."""
    lines = cluster["steps"][5]
    (read_key,) = [line for line in lines if line.startswith("KEY=")]
    assert "get secret gateway-api-keys" in read_key and "{.data.keys}" in read_key, read_key
    (curl,) = [line for line in lines if line.startswith("curl ")]
    out = bash(curl.replace("127.0.0.1:8080", f"127.0.0.1:{cluster['gateway_port']}"), cluster["checkout"],
               env={"KEY": cluster["gateway_key"]}, timeout=120)
    (item,) = json.loads(out)["data"]
    assert len(item["embedding"]) == MODEL_DIM
