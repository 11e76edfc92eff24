"""ServerOptions: the server's options in one validated record, for every entry point.

`create_app`, `launch`, `serve`, `nbserve serve` and `app.py` take the same options, and the
command-line flags are generated from the fields below, so an option cannot exist in one entry
point only (tests/test_server_options.py checks that every create_app keyword is a field).

To add an option: the keyword in `create_app` (default None or the field's default) and one line
here, e.g. `strict: bool = field(default=False, metadata=cli("--strict", "what it does"))`.
Fields marked app=False are the launcher's (TLS, the UI password): launch uses them, create_app
does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # imported when used: nbserve.api brings FastAPI, and `import nbserve` stays fast
    from ..api.limits import Limits


def cli(flag: str, help: str, *, repeat: bool = False, parse: Any = None,
        metavar: str | None = None, app: bool = True) -> dict[str, Any]:
    """A field's metadata: its CLI flag and help. A bool field makes a switch (a True default
    takes a --no-... flag); `repeat`: the flag may be given several times (a list); `parse`:
    the argparse type; app=False: not a create_app keyword (the listener's)."""
    return {"flag": flag, "help": help, "repeat": repeat, "parse": parse, "metavar": metavar,
            "app": app}


def suggest(name: str, names: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a close match of a misspelt `name`, else ''."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def limit_item(text: str) -> tuple[str, int | float]:
    """One `--limit NAME=VALUE`, checked against the Limits fields (an argparse type)."""
    from ..api.limits import Limits

    name, sep, value = text.partition("=")
    name = name.strip().replace("-", "_")
    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Limits)}
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. max_tokens=1024), got "
                                         f"{text!r}")
    if name not in defaults:
        raise argparse.ArgumentTypeError(f"unknown limit {name!r}{suggest(name, defaults)}; "
                                         f"limits: {', '.join(defaults)}")
    kind = type(defaults[name])
    try:
        return name, kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"limit {name} needs {what}, got {value!r}") from None


@dataclass(frozen=True)
class ServerOptions:
    """How the server answers (the same for create_app, launch, serve and the CLI).

    Values are checked when the record is made: a bad one raises ValueError (TypeError for a
    wrong kind) naming it. Sequences may be given as one string or a list; `limits` as a
    `Limits` or a dict of its fields.
    """

    api_keys: tuple[str, ...] = field(default=(), metadata=cli(
        "--api-key", "require this key (Authorization: Bearer KEY) on every route but "
        "/health and the docs; repeat for several", repeat=True, metavar="KEY"))
    cors_origins: tuple[str, ...] = field(default=(), metadata=cli(
        "--cors-origin", "a browser origin allowed to call the API (e.g. https://app.example); "
        "repeat for several", repeat=True, metavar="ORIGIN"))
    # None stands for Limits(): __post_init__ puts a Limits in its place
    limits: Limits = field(default=cast("Limits", None), metadata=cli(
        "--limit", "raise or lower a request limit, e.g. max_tokens=1024 (a field of Limits); "
        "repeat for several", repeat=True, parse=limit_item, metavar="NAME=VALUE"))
    rate_limit_per_minute: float | None = field(default=None, metadata=cli(
        "--rate-limit-per-minute", "requests per minute per API key (per client address "
        "without keys) on every route but /health, the docs, /stats and /metrics; default: "
        "no limit", parse=float, metavar="N"))
    ui: bool = field(default=True, metadata=cli("--no-ui", "serve only the API (no chat UI)"))
    log_messages: bool = field(default=False, metadata=cli(
        "--log-messages", "put message contents in the request log lines"))
    accept_unknown_fields: bool = field(default=False, metadata=cli(
        "--accept-unknown-fields", "accept request fields the API does not know, logging each "
        "name once (default: a 400 naming the field)"))
    ui_password: str | None = field(default=None, metadata=cli(
        "--ui-password", "the chat UI's login also accepts this password (any user name); "
        "API keys, given or generated for --share, work there too", metavar="PASSWORD",
        app=False))
    ssl_certfile: str | None = field(default=None, metadata=cli(
        "--ssl-certfile", "serve HTTPS with this PEM certificate (the file may hold the key "
        "too)", metavar="PATH", app=False))
    ssl_keyfile: str | None = field(default=None, metadata=cli(
        "--ssl-keyfile", "the certificate's private key (PEM, unencrypted)", metavar="PATH",
        app=False))

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: normalize once, here
        put(self, "api_keys", _strings("api_keys", self.api_keys, strip=True))
        put(self, "cors_origins", _strings("cors_origins", self.cors_origins))
        put(self, "limits", _limits(self.limits))
        rate = self.rate_limit_per_minute
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not rate > 0):
            raise ValueError(f"rate_limit_per_minute must be a number > 0 (or None: no limit), "
                             f"got {rate!r}")
        for f in option_fields():
            if isinstance(f.default, bool) and not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")
        for name in ("ssl_certfile", "ssl_keyfile"):
            value = getattr(self, name)
            if value is not None:
                put(self, name, str(Path(value).expanduser()))
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("ssl_keyfile needs ssl_certfile (the certificate it belongs to)")
        if self.ssl_certfile:
            check_tls_files(self.ssl_certfile, self.ssl_keyfile)

    @property
    def tls(self) -> bool:
        """Whether the server speaks HTTPS."""
        return bool(self.ssl_certfile)

    def app_kwargs(self) -> dict[str, Any]:
        """The create_app keywords of this record."""
        return {f.name: getattr(self, f.name) for f in option_fields(app=True)}

    @classmethod
    def from_app_keywords(cls, given: Mapping[str, Any],
                          options: ServerOptions | None) -> ServerOptions:
        """The record create_app serves: `options`, or its keywords; not both (a keyword is
        given when it is neither None nor the field's default)."""
        if options is None:
            return cls(**{k: v for k, v in given.items() if v is not None})
        if not isinstance(options, cls):
            raise TypeError(f"options must be a ServerOptions, got {type(options).__name__}")
        defaults = cls()
        clash = [k for k, v in given.items()
                 if v is not None and getattr(cls(**{k: v}), k) != getattr(defaults, k)]
        if clash:
            raise ValueError(f"create_app got options= and {', '.join(clash)}: pass either "
                             "options= or keywords (dataclasses.replace(options, ...) merges)")
        return options


def option_fields(app: bool | None = None) -> list[dataclasses.Field]:
    """ServerOptions' fields; app=True: those create_app takes, app=False: the listener's."""
    return [f for f in dataclasses.fields(ServerOptions)
            if app is None or f.metadata["app"] == app]


def option_names() -> list[str]:
    return [f.name for f in option_fields()]


# ----------------------------------------------------------------------------- the CLI


def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerOptions field (what `nbserve serve` and app.py accept)."""
    for f in option_fields():
        meta = f.metadata
        kw: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        if isinstance(f.default, bool):
            kw["action"] = "store_false" if f.default else "store_true"
        else:
            kw.update(default=None, metavar=meta["metavar"])
            if meta["repeat"]:
                kw["action"] = "append"
            if meta["parse"] is not None:
                kw["type"] = meta["parse"]
        parser.add_argument(meta["flag"], **kw)


def cli_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerOptions values given on the command line (as launch keywords)."""
    given = {}
    for f in option_fields():
        value = getattr(args, f.name, None)
        if value is None or value == f.default:
            continue
        given[f.name] = dict(value) if f.name == "limits" else value
    return given


# ----------------------------------------------------------------------------- checks


def _strings(name: str, value: Any, *, strip: bool = False) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value or ())
    if not all(isinstance(v, str) and v.strip() for v in items):
        raise ValueError(f"{name} must be a non-empty string or a list of them, got {value!r}")
    return tuple(v.strip() if strip else v for v in items)


def _limits(value: Any) -> Limits:
    from ..api.limits import Limits

    if value is None:
        return Limits()
    if isinstance(value, Limits):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"limits must be a Limits or a dict of its fields, got "
                        f"{type(value).__name__}")
    names = [f.name for f in dataclasses.fields(Limits)]
    for key in value:
        if key not in names:
            raise ValueError(f"unknown limit {key!r}{suggest(str(key), names)}; limits: "
                             f"{', '.join(names)}")
    return Limits(**value)


class _EncryptedKey(Exception):
    pass


def _no_password() -> str:
    raise _EncryptedKey  # without this, OpenSSL would prompt for it on the terminal


def check_tls_files(certfile: str, keyfile: str | None) -> None:
    """Raise ValueError, saying what is wrong, unless the files make a usable certificate."""
    for what, path in (("ssl_certfile", certfile), ("ssl_keyfile", keyfile)):
        if path is None:
            continue
        p = Path(path)
        if not p.exists():
            raise ValueError(f"{what}: no such file: {path}")
        if not p.is_file():
            raise ValueError(f"{what}: {path} is not a file")
        try:
            with p.open("rb") as f:
                f.read(1)
        except OSError as exc:
            raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_password)
    except _EncryptedKey:
        raise ValueError(f"the private key in {keyfile or certfile} is encrypted; nbserve needs "
                         "it unencrypted (openssl pkey -in KEY -out PLAIN_KEY)") from None
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise ValueError(f"the key in {keyfile or certfile} does not belong to the "
                             f"certificate in {certfile}") from None
        files = f"ssl_certfile {certfile}" + (f" and ssl_keyfile {keyfile}" if keyfile else "")
        raise ValueError(f"{files} are not a PEM certificate and its private key "
                         f"({exc.reason or exc})") from None
