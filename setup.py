"""Thin shim so that tools which still call ``setup.py`` work; metadata lives in pyproject.toml."""

from setuptools import setup

setup()
