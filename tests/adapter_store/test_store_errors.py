"""The store's exit codes: one per failure, fixed (scripts branch on them), never shared."""

from __future__ import annotations

import pytest

from adapter_store import errors


def test_each_failure_has_its_own_documented_code() -> None:
    codes = {
        cls.__name__: cls.exit_code
        for cls in errors.StoreError.__subclasses__()
        if cls.__module__ == errors.__name__
    }
    assert codes == {
        "InvalidInputError": 3,
        "NotFoundError": 4,
        "VersionExistsError": 5,
        "IntegrityError": 6,
        "StoreUnavailableError": 7,
        "StoreAccessError": 8,
        "DiskFullError": 9,
        "ReadOnlyStoreError": 10,
    }
    assert errors.StoreError.exit_code == 1


def test_a_taken_code_is_refused_and_a_derived_error_keeps_its_base_code() -> None:
    with pytest.raises(TypeError, match="exit code 4 is NotFoundError's"):

        class Missing(errors.StoreError, exit_code=4):
            pass

    class Wrapped(errors.NotFoundError):  # as Ray derives a remote error's class
        pass

    assert Wrapped.exit_code == 4 and isinstance(Wrapped("x"), LookupError)
