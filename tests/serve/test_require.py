"""A missing optional package of the server is named, with what to install."""

from __future__ import annotations

import importlib

import pytest

from fastdit.serve import require


def test_a_missing_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def without_multipart(name: str, *args: object) -> object:
        if name == "multipart":
            raise ModuleNotFoundError("No module named 'multipart'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_multipart)
    with pytest.raises(ImportError, match=r"needs the package 'python-multipart': pip install python-multipart"):
        require("multipart")
    assert require("json").__name__ == "json"
