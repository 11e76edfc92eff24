"""Gradio share links for any local port: the whole app (UI and /v1), with a deadline.

`gradio.networking.setup_tunnel` works for any port, not only for `Blocks.launch`; where the
share service cannot be reached it fails fast or hangs, so it runs in a thread with a deadline.
"""

from __future__ import annotations

import secrets
import threading
from types import ModuleType

SHARE_DEADLINE_S = 8.0


def open_share_link(port: int, deadline: float | None = None) -> tuple[str | None, str]:
    """(public url, "") or (None, why not); gives up after `deadline` s (SHARE_DEADLINE_S)."""
    from gradio import networking, tunneling

    deadline = SHARE_DEADLINE_S if deadline is None else deadline
    urls: list[str] = []
    errors: list[Exception] = []
    abandoned = threading.Event()

    def work() -> None:
        try:
            urls.append(networking.setup_tunnel("127.0.0.1", port, secrets.token_urlsafe(32),
                                                None, None))
        except Exception as exc:  # noqa: BLE001 -- offline, blocked, binary download failed
            errors.append(exc)
        if abandoned.is_set():  # answered too late: close the tunnel nobody will use
            close_share_links(port, tunneling)

    t = threading.Thread(target=work, name="nbserve-share", daemon=True)
    t.start()
    t.join(deadline)
    if t.is_alive():
        abandoned.set()
        return None, f"no answer from the share service within {deadline:g} s"
    if errors:
        exc = errors[0]
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        return None, f"{exc}{cause}"
    return urls[0], ""


def close_share_links(port: int, tunneling: ModuleType | None = None) -> None:
    """Close the tunnels opened for `port` (their frpc processes end)."""
    if tunneling is None:
        from gradio import tunneling as gradio_tunneling

        tunneling = gradio_tunneling
    for tunnel in list(tunneling.CURRENT_TUNNELS):
        if tunnel.local_port == port:
            if tunnel.proc is not None:
                tunnel.proc.terminate()
                tunnel.proc = None
            tunneling.CURRENT_TUNNELS.remove(tunnel)
