"""Where the server's token comes from (``pinpriq.auth``), with real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from pinpriq.auth import TOKEN_VARIABLE, TokenError, load_token, tokens_match


def test_no_token_anywhere_is_none() -> None:
    assert load_token(None, {}) is None


def test_a_token_file_loses_one_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"s3cret\n\n")
    assert load_token(str(path), {}) == b"s3cret\n"
    path.write_bytes(b"s3cret\r\n")
    assert load_token(str(path), {}) == b"s3cret"


def test_the_environment_gives_the_token() -> None:
    assert load_token(None, {TOKEN_VARIABLE: "from-env"}) == b"from-env"


@pytest.mark.parametrize(
    ("content", "environ", "message"),
    [
        (b"\n", {}, "holds an empty token"),
        (None, {TOKEN_VARIABLE: ""}, f"{TOKEN_VARIABLE} holds an empty token"),
        (b"x", {TOKEN_VARIABLE: "y"}, "not both"),
    ],
)
def test_unusable_tokens_are_refused(
    tmp_path: Path, content: bytes | None, environ: dict[str, str], message: str
) -> None:
    path = None
    if content is not None:
        (tmp_path / "token").write_bytes(content)
        path = str(tmp_path / "token")
    with pytest.raises(TokenError, match=message):
        load_token(path, environ)


def test_an_unreadable_token_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(TokenError, match=f"cannot read the token file {missing}"):
        load_token(str(missing), {})


def test_tokens_match_exactly() -> None:
    assert tokens_match(b"abc", b"abc")
    assert not tokens_match(b"abd", b"abc")
    assert not tokens_match(b"ab", b"abc")
