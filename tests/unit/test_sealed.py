"""Secrets sealed at rest (``conductor.sealed``): what a key seals, only that key (or a rotation list
holding it) opens; values stored before a key was set still open."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet

from conductor.sealed import SEALED_PREFIX, SealError, seal, unseal

SECRET = "whsec_c2VjcmV0LXNpZ25pbmcta2V5LW9mLTMyLWJ5dGVzISE="


def test_a_sealed_secret_opens_with_its_key_only() -> None:
    key, other = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    sealed = seal(SECRET, key)
    assert sealed.startswith(SEALED_PREFIX) and SECRET[6:] not in sealed and len(sealed) <= 512
    assert unseal(sealed, key) == SECRET
    with pytest.raises(SealError, match="does not open"):
        unseal(sealed, other)
    with pytest.raises(SealError, match="not set"):
        unseal(sealed, "")


def test_keys_rotate_the_first_seals_and_any_opens() -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    sealed_before = seal(SECRET, old)
    rotation = f"{new}, {old}"
    assert unseal(sealed_before, rotation) == SECRET
    sealed_after = seal(SECRET, rotation)
    assert unseal(sealed_after, new) == SECRET
    with pytest.raises(SealError):
        unseal(sealed_after, old)


def test_without_a_key_values_are_stored_as_given_and_old_plaintext_still_opens() -> None:
    assert seal(SECRET, "") == SECRET
    assert unseal(SECRET, Fernet.generate_key().decode()) == SECRET


def test_a_key_that_is_not_a_fernet_key_is_refused_clearly() -> None:
    with pytest.raises(SealError, match="Fernet keys"):
        seal(SECRET, "correct horse battery staple")


def test_a_malformed_key_stops_the_settings_from_loading() -> None:
    from pydantic import ValidationError

    from conductor.settings import Settings

    with pytest.raises(ValidationError, match="Fernet keys"):
        Settings(secrets_key="not-a-key")
    key = Fernet.generate_key().decode()
    assert Settings(secrets_key=f"{key}, {Fernet.generate_key().decode()}").secrets_key.startswith(key)


def test_what_needs_sealing_again() -> None:
    from conductor.sealed import needs_sealing

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    assert not needs_sealing(SECRET, "")  # no key: nothing to do
    assert needs_sealing(SECRET, old)  # plaintext stored before the key
    assert not needs_sealing(seal(SECRET, old), old)
    assert needs_sealing(seal(SECRET, old), f"{new},{old}")  # a rotation: sealed with a key not first
    assert not needs_sealing(seal(SECRET, f"{new},{old}"), f"{new},{old}")
