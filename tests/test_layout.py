"""The package is arranged by pipeline stage: the public names resolve, and the flat module paths of
the layout before it are gone (the README documents this one)."""
import importlib

import pytest

import autoflash


@pytest.mark.parametrize("name", sorted(autoflash.__all__))
def test_public_names_resolve(name):
    assert getattr(autoflash, name) is not None


@pytest.mark.parametrize("old", ["autoflash.defaults", "autoflash.compiler", "autoflash.reference_bwd",
                                 "autoflash.bench_train", "autoflash._moved"])
def test_old_module_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_pipeline_folders():
    for pkg in ("kernels", "emulation", "reference", "tuning", "dispatch", "bench"):
        assert importlib.import_module(f"autoflash.{pkg}").__doc__
    from autoflash.reference import attention_ref, within_tolerance  # as before it was a package
    assert callable(attention_ref) and callable(within_tolerance)
