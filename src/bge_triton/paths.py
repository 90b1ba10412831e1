"""Where the kit's files are: the shipped model repository (package data) and the working folders.

One module answers "where is X" for the whole kit, so nothing looks for a checkout: the canonical
configs and the text endpoint's files travel in the wheel (bge_triton/model_repository), and the
state a command writes (exports, server state, caches, reports) goes under the current directory
unless a flag says otherwise.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
#: the committed Triton configs + the text endpoint's python files (what ships; package data)
CANONICAL_REPOSITORY = PACKAGE_DIR / "model_repository"
#: the folder that holds the ``bge_triton`` package (``src/`` in a checkout, site-packages when installed):
#: what a python-backend stub needs on its PYTHONPATH to import the kit
IMPORT_ROOT = PACKAGE_DIR.parent
#: working state of the kit's commands (exports, server state, caches), relative to the current directory
STATE_DIR = Path.cwd() / ".kit"
#: default folder of the reports the benchmark commands write, relative to the current directory
REPORTS_DIR = Path.cwd() / "reports"

__all__ = ["PACKAGE_DIR", "CANONICAL_REPOSITORY", "IMPORT_ROOT", "STATE_DIR", "REPORTS_DIR"]
