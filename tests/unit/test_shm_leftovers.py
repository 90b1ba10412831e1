"""The session's /dev/shm clean-up (tests/conftest.py): only new, old enough files that no live process uses go."""
from __future__ import annotations

import mmap
from pathlib import Path

from conftest import leftovers


def _file(root: Path, name: str) -> Path:
    """A file made now: its ctime cannot be set back, so the tests pass min_age_s=0 where age should not matter."""
    p = root / name
    p.write_bytes(b"\0" * 4096)
    return p


def test_only_new_unused_leftovers_are_named(tmp_path: Path) -> None:
    stale = _file(tmp_path, "triton_python_backend_shm_region_dead")
    marker = _file(tmp_path, "bge_triton_minilm_123.query")
    before = _file(tmp_path, "triton_python_backend_shm_region_before")
    other = _file(tmp_path, "someone_elses_region")
    opened = _file(tmp_path, "triton_python_backend_shm_region_open")
    mapped = _file(tmp_path, "triton_python_backend_shm_region_mapped")
    with open(opened, "rb"), open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        f.close()  # only the mapping holds `mapped` now
        found = leftovers({before.name}, tmp_path, min_age_s=0.0)
    assert sorted(p.name for p in found) == sorted([stale.name, marker.name])
    assert other.exists()  # the globs name only Triton's regions and the query markers


def test_a_file_younger_than_the_age_bound_is_kept(tmp_path: Path) -> None:
    _file(tmp_path, "triton_python_backend_shm_region_young")
    assert leftovers(set(), tmp_path, min_age_s=30.0) == []
    assert [p.name for p in leftovers(set(), tmp_path, min_age_s=0.0)] == ["triton_python_backend_shm_region_young"]


def test_a_missing_root_names_nothing(tmp_path: Path) -> None:
    assert leftovers(set(), tmp_path / "absent", min_age_s=0.0) == []
