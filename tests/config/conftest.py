import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _run_from_repo_root(monkeypatch):
    """The recipes, tools/plan.py and docs/planner.md are addressed relative to the repository root."""
    monkeypatch.chdir(ROOT)
