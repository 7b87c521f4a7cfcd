"""The package version, written only here: setup.py and the CMake build of ``_C`` read it."""

__version__ = "0.1.0"
