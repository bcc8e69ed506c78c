"""Scheduler tests: an isolated user profile directory."""
import pytest


@pytest.fixture(autouse=True)
def _profile_dir(tmp_path, monkeypatch):
    """No test sees (or writes) the user's real profile directory."""
    monkeypatch.setenv("MEGALOOM_PROFILE_DIR", str(tmp_path / "profiles"))
