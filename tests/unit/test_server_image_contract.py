"""The server image covers the models' imports: every python file of every model in model_repository/ imports
only the standard library, numpy, triton_python_backend_utils, modules of its own directory, or what
deploy/Dockerfile.server installs -- and that Dockerfile installs nothing the models do not import."""
from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "src" / "bge_triton" / "model_repository"
_spec = importlib.util.spec_from_file_location("server_image", REPO / "deploy" / "server_image.py")
server_image = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_image)

IN_THE_BASE_IMAGE = {"numpy", "triton_python_backend_utils"}  # NGC's Python has numpy; the backend brings pb_utils


def imports(path: Path) -> set[str]:
    """Top-level modules a file imports anywhere (functions included); relative imports as '.'."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." if node.level else node.module.split(".")[0])
    return found


def siblings(directory: Path) -> set[str]:
    """Modules a model file may import from its own directory: *.py files and packages beside it."""
    return {p.stem for p in directory.glob("*.py")} | {p.name for p in directory.iterdir()
                                                       if (p / "__init__.py").is_file()}


def model_files(root: Path) -> list[Path]:
    """Every python file under root/<model>/<version>/ (model.py and its sibling modules)."""
    return sorted(p for p in root.glob("*/*/**/*.py") if p.relative_to(root).parts[1].isdigit())


def uncovered(root: Path, installed: set[str]) -> dict[str, set[str]]:
    """file -> the modules it imports that the server image would not have."""
    allowed = set(sys.stdlib_module_names) | IN_THE_BASE_IMAGE | installed | {"."}
    out = {}
    for path in model_files(root):
        missing = imports(path) - allowed - siblings(path.parent)
        if missing:
            out[str(path.relative_to(root))] = missing
    return out


def image_imports() -> set[str]:
    return {server_image.import_name(spec) for spec in server_image.image_packages()}


def _model(root: Path, name: str, files: dict[str, str]) -> None:
    (root / name / "1").mkdir(parents=True)
    for file, text in files.items():
        (root / name / "1" / file).write_text(text)


def test_checker_flags_what_the_image_lacks(tmp_path: Path) -> None:
    _model(tmp_path, "text", {
        "model.py": "import json\nimport numpy as np\nimport triton_python_backend_utils as pb_utils\n"
                    "from tokenizers import Tokenizer\nfrom planner import plan\nfrom . import errors\n"
                    "def run():\n    import onnxruntime\n    from torch.utils.dlpack import from_dlpack\n",
        "planner.py": "import collections\n", "errors.py": "",
    })
    _model(tmp_path, "other", {"model.py": "import planner\nimport requests\n"})
    assert uncovered(tmp_path, {"tokenizers"}) == {"text/1/model.py": {"onnxruntime", "torch"},
                                                   "other/1/model.py": {"planner", "requests"}}
    assert uncovered(tmp_path, {"tokenizers", "onnxruntime", "torch", "requests"}) == {
        "other/1/model.py": {"planner"}}  # a sibling of another model's directory is not on this one's path


def test_image_installs_pinned_tokenizers_from_the_lock() -> None:
    specs = server_image.image_packages()
    lock = {ln.split("==")[0].lower(): ln.strip() for ln in (REPO / "requirements.lock").read_text().splitlines()
            if "==" in ln and not ln.startswith("#")}
    assert specs and all("==" in s for s in specs), specs  # pinned, so the image is the one tested
    assert [lock.get(s.split("==")[0].lower()) for s in specs] == specs  # the lock's versions
    assert image_imports() == {"tokenizers"}


def test_image_installs_nothing_the_models_do_not_import() -> None:
    used = set().union(*(imports(p) for p in model_files(MODELS)))
    assert model_files(MODELS), "no python model under model_repository/"
    assert image_imports() - used == set()


def test_every_model_import_is_in_the_server_image() -> None:
    assert uncovered(MODELS, image_imports()) == {}


def _arg_defaults(text: str) -> dict[str, str]:
    return dict(a.partition("=")[::2] for w, a in server_image.instructions(text) if w == "ARG" and "=" in a)


def test_every_dockerfile_takes_its_base_as_an_arg_defaulting_to_the_real_image() -> None:
    real = {"Dockerfile.server": ("TRITON_IMAGE", "nvcr.io/nvidia/tritonserver:24.10-py3"),
            "Dockerfile.kit": ("PYTHON_IMAGE", "docker.io/library/python:3.11-slim"),
            "Dockerfile.gateway": ("PYTHON_IMAGE", "docker.io/library/python:3.11-slim")}
    assert sorted(p.name for p in (REPO / "deploy").glob("Dockerfile.*") if "." not in p.name[11:]) == sorted(real)
    for name, (arg, image) in real.items():
        text = (REPO / "deploy" / name).read_text()
        assert _arg_defaults(text)[arg] == image, name
        bases = server_image.base_images(text)
        stages = {a.split()[-1] for w, a in server_image.instructions(text) if w == "FROM" and " AS " in a.upper()}
        assert bases and all(b == f"${{{arg}}}" or b in stages for b in bases), (name, bases)
        assert bases[0] == f"${{{arg}}}"


def test_compose_passes_the_same_bases_as_the_dockerfiles() -> None:
    compose = (REPO / "docker-compose.yml").read_text()
    assert "TRITON_IMAGE: ${TRITON_IMAGE:-nvcr.io/nvidia/tritonserver:24.10-py3}" in compose
    assert compose.count("PYTHON_IMAGE: ${PYTHON_IMAGE:-docker.io/library/python:3.11-slim}") == 2  # kit, gateway


def test_exporter_image_is_a_cpu_venv_without_the_gpu_extra() -> None:
    kit = (REPO / "deploy" / "Dockerfile.kit").read_text()
    installs = " ".join(server_image.pip_requirements(kit))
    assert "[export]" in installs and "[loadtest]" in installs
    assert "server]" not in installs  # the exporter writes configs through bge_triton.repository: no server extra
    assert "gpu" not in installs and "[all" not in installs and " -e " not in kit
    assert _arg_defaults(kit)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "torch.version.cuda is None" in kit  # the build fails on a CUDA torch
    assert "python -m venv /opt/venv" in kit


def test_gateway_image_installs_the_wheel_and_imports_it_from_its_workdir() -> None:
    text = (REPO / "deploy" / "Dockerfile.gateway").read_text()
    (install,) = [a for w, a in server_image.instructions(text) if w == "RUN" and "pip install" in a]
    assert '"/kit[gateway]"' in install and " -e " not in install
    assert "import bge_triton.gateway" in install and "WORKDIR /kit" in text
