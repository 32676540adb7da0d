"""conftest's HEAVY_FIRST names files that exist: a renamed or retired file would silently lose its
place at the front of the schedule (planted: a misspelled name fails it)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HEAVY_FIRST


def test_heavy_first_names_existing_files() -> None:
    tests = Path(__file__).resolve().parent
    missing = [name for name in HEAVY_FIRST if not (tests / name).is_file()]
    assert not missing, f"HEAVY_FIRST names files that are gone: {missing}"
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)
