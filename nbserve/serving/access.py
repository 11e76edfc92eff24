"""Who may use a launched server: the API keys for /v1 (/stats, /metrics) and the chat UI's login.

`decide_access` is the whole decision, apart from the share tunnel: a share link must never be
an open endpoint, so `share=True` without keys generates one, whether or not the tunnel opens.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Access:
    """api_keys: protect /v1, /stats, /metrics and the UI (none: open). ui_password: also
    accepted by the UI's login. generated_key: the key made for a share link, to print once."""

    api_keys: list[str]
    ui_password: str | None = None
    generated_key: str | None = None

    @property
    def ui_login(self) -> bool:
        """Whether the chat UI asks for a login (any user name; a key or the password)."""
        return bool(self.api_keys) or self.ui_password is not None


def decide_access(*, share: bool, api_keys: list[str], ui_password: str | None,
                  ui: bool) -> Access:
    """The access of a launch given `share`, its (checked) `api_keys` and `ui_password`."""
    if ui_password is not None:
        if not isinstance(ui_password, str) or not ui_password.strip():
            raise ValueError("ui_password must be a non-empty string, e.g. "
                             "launch(share=True, ui_password='a long passphrase')")
        if not ui:
            raise ValueError("ui_password protects the chat UI, but ui=False: drop one of them "
                             "(api_keys= protects /v1)")
    generated = None
    if share and not api_keys:
        generated = "nb-" + secrets.token_urlsafe(24)
        api_keys = [generated]
    return Access(list(api_keys), ui_password, generated)
