"""Unit tests of API keys and the rate limit (nbserve/api/auth.py): KeyAuth on starlette
Requests built from a bare ASGI scope, RateLimiter on a fake monotonic clock. No server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.requests import Request

from nbserve.api import auth
from nbserve.api.auth import KeyAuth, RateLimiter
from nbserve.api.errors import APIError


def request(authorization: str | None = None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": headers})


KEYS = KeyAuth(["sk-alpha", "sk-beta", "sk-gamma"])


# ----------------------------------------------------------------------------- KeyAuth


def test_the_right_key_of_several_names_its_index() -> None:
    assert KEYS.check(request("Bearer sk-alpha")) == "key0"
    assert KEYS.check(request("Bearer sk-beta")) == "key1"
    assert KEYS.check(request("Bearer sk-gamma")) == "key2"


def test_the_scheme_is_case_insensitive_and_the_key_may_carry_spaces_around() -> None:
    assert KEYS.check(request("bearer sk-beta")) == "key1"
    assert KEYS.check(request("BEARER   sk-gamma  ")) == "key2"


def test_a_missing_header_is_a_401_asking_for_a_key() -> None:
    with pytest.raises(APIError) as err:
        KEYS.check(request())
    e = err.value
    assert (e.status, e.code, e.type) == (401, "missing_api_key", "invalid_request_error")
    assert e.headers == {"WWW-Authenticate": "Bearer"}
    assert "Authorization: Bearer" in e.message


@pytest.mark.parametrize("header", [
    "Bearer sk-delta",  # not a key of the server
    "Bearer sk-alph",  # a prefix of a key
    "Bearer sk-alpha2",  # a key plus more
    "Bearer SK-ALPHA",  # keys are case-sensitive
    "Basic sk-alpha",  # the right key under the wrong scheme
    "Token sk-alpha",
    "sk-alpha",  # no scheme at all
    "Bearer",  # a scheme without a key
    "Bearer ",
])
def test_a_wrong_key_or_scheme_is_a_401_invalid_api_key(header: str) -> None:
    with pytest.raises(APIError) as err:
        KEYS.check(request(header))
    e = err.value
    assert (e.status, e.code) == (401, "invalid_api_key")
    assert e.headers == {"WWW-Authenticate": "Bearer"}
    assert "sk-alpha" not in e.message  # the answer never echoes a key


def test_keys_must_be_non_empty_strings() -> None:
    for bad in ([""], ["  "], ["sk-ok", None], [42]):
        with pytest.raises(ValueError, match="api_keys must be non-empty strings"):
            KeyAuth(bad)


def test_no_keys_means_auth_is_off() -> None:
    assert not KeyAuth([])
    assert KeyAuth(["sk-x"])
    assert KeyAuth(iter(["sk-x"])).check(request("Bearer sk-x")) == "key0"  # any iterable


# ----------------------------------------------------------------------------- RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """auth.py's view of time.monotonic, and only its (asyncio and the rest keep theirs)."""
    c = Clock()
    monkeypatch.setattr(auth, "time", SimpleNamespace(monotonic=c))
    return c


def refused(limiter: RateLimiter, client: str) -> APIError:
    with pytest.raises(APIError) as err:
        limiter.check(client)
    return err.value


def test_a_full_bucket_serves_its_capacity_at_once_then_429s(clock: Clock) -> None:
    limiter = RateLimiter(per_minute=3)
    for _ in range(3):
        limiter.check("key0")
    e = refused(limiter, "key0")
    assert (e.status, e.code, e.type) == (429, "rate_limit_exceeded", "rate_limit_error")
    assert e.headers == {"Retry-After": "20"}  # one token every 60/3 = 20 s
    assert "at most 3 requests per minute" in e.message and "Retry in 20 s" in e.message


def test_clients_have_buckets_of_their_own(clock: Clock) -> None:
    limiter = RateLimiter(per_minute=1)
    limiter.check("key0")
    limiter.check("key1")
    refused(limiter, "key0")
    refused(limiter, "key1")


def test_the_bucket_refills_continuously(clock: Clock) -> None:
    limiter = RateLimiter(per_minute=6)  # a token every 10 s
    for _ in range(6):
        limiter.check("c")
    clock.now += 4.0
    assert refused(limiter, "c").headers["Retry-After"] == "6"
    clock.now += 6.0  # 10 s since the bucket emptied: one token
    limiter.check("c")
    assert refused(limiter, "c").headers["Retry-After"] == "10"
    clock.now += 25.0  # two and a half tokens
    limiter.check("c")
    limiter.check("c")
    assert refused(limiter, "c").headers["Retry-After"] == "5"


def test_a_refused_request_costs_no_token(clock: Clock) -> None:
    limiter = RateLimiter(per_minute=60)  # a token a second
    for _ in range(60):
        limiter.check("c")
    for _ in range(5):  # hammering while empty does not push the next token further away
        refused(limiter, "c")
    clock.now += 1.0
    limiter.check("c")


def test_the_bucket_never_holds_more_than_its_capacity(clock: Clock) -> None:
    limiter = RateLimiter(per_minute=2)
    limiter.check("c")
    clock.now += 3600.0  # an hour idle refills to 2, not to 120
    limiter.check("c")
    limiter.check("c")
    refused(limiter, "c")


def test_a_sub_second_wait_is_announced_as_one_second(clock: Clock) -> None:
    limiter = RateLimiter(per_minute=600)  # a token every 0.1 s
    for _ in range(600):
        limiter.check("c")
    clock.now += 0.05
    assert refused(limiter, "c").headers["Retry-After"] == "1"


def test_per_minute_must_be_positive() -> None:
    for bad in (0, -1, None):
        with pytest.raises(ValueError, match="rate_limit_per_minute must be > 0"):
            RateLimiter(bad)


def test_past_max_clients_full_buckets_are_forgotten_but_limited_ones_kept(clock: Clock) -> None:
    limiter = RateLimiter(per_minute=2, max_clients=3)  # a token every 30 s
    limiter.check("busy")
    limiter.check("busy")  # empty
    for i in range(5):
        limiter.check(f"visitor{i}")  # one token left each
    clock.now += 30.0  # the visitors are full again; "busy" has one token of two
    limiter.check("newcomer")  # 7 clients > 3: the full buckets are forgotten
    # The table is private, but its size is the whole point of max_clients.
    assert set(limiter._buckets) == {"busy", "newcomer"}
    # "busy" was not forgotten (that would have handed it a full bucket): one token, not two.
    limiter.check("busy")
    assert refused(limiter, "busy").headers["Retry-After"] == "30"
    # A forgotten client starts over with a full bucket, as a new one would.
    limiter.check("visitor0")
    limiter.check("visitor0")
    refused(limiter, "visitor0")
