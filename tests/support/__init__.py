"""Helpers shared by the tests: rank launchers, tiny models, SP reference cases."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout's root (where setup.cfg, examples/ and schemas/ live)."""
