"""Fixtures shared by every test directory."""

from tests.tiny_models import tiny_model_dir  # noqa: F401  (registers the session fixture)
