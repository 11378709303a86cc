"""Packaging lives in pyproject.toml; this file lets older pip versions install the project in editable mode."""
from setuptools import setup

setup()
