"""How the egress proxy's refusal reaches the code: first in the client library's error.

The proxy sends its refusal (a status line, a tunnel's reason phrase) between the markers of
`_denial.refusal_line`, with the token the host made for this worker (its boot
configuration: `WorkerSetup.egress["token"]`, given here by `_net.configure`). Always on,
not a judgement: `__str__` of requests', urllib's, http.client's, httpx's and aiohttp's
error classes (`_CLIENT_ERRORS`), and the tunnels of http.client and urllib3 (a bare
`OSError`, rewritten in place), put a refusal marked with that token first, the library's
words after, and the client's chained exceptions the same way (`_clean_chain`). A marker
without the token (a server's words: it cannot know the token) is left as it is. Each
refusal found is noted on the client's error for the worker's report to the host
(`proxy_refusals`), by which alone the host takes the call's error for a refusal its proxy
recorded (docs/denials.md, "What the host checks").

The token never appears in a text rewritten here (`_denial.refusal_first` removes the
marker); a text rewritten in place keeps the refusal marked with a token of this module's
own, good for that refusal only (`_relayed`), for a library that quotes it later.

Standard library only: the worker imports this before arming.
"""

from __future__ import annotations

from agent_sandbox._denial import (
    REFUSAL_START,
    find_refusal,
    new_token,
    refusal_first,
    refusal_line,
)
from agent_sandbox.guards import _patch

TYPE_CHECKING = False  # (not `typing`'s: the worker's start does not import typing)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["configure", "install", "proxy_refusals"]

#: The host's refusal token for this worker ("" without an egress proxy: nothing is found).
_token = ""


def configure(token: str) -> None:
    global _token
    _token = token


#: The clients' error classes whose text can carry the egress proxy's refusal (each class
#: that words its own `__str__`, or the base of those that inherit it): their `__str__` puts
#: the refusal first (`_refusal_first_str`). Missing ones (a client not installed, another
#: version's names) are skipped.
_CLIENT_ERRORS = (
    ("requests.exceptions", "RequestException.__str__"),
    ("urllib.error", "URLError.__str__"),
    ("http.client", "HTTPException.__str__"),
    ("httpx._exceptions", "HTTPError.__str__"),
    ("aiohttp.client_exceptions", "ClientError.__str__"),
    ("aiohttp.client_exceptions", "ClientResponseError.__str__"),
    ("aiohttp.client_exceptions", "ClientConnectorError.__str__"),
)


_REFUSAL_ATTR = "_agent_sandbox_proxy_refusal"  # (on a client's error: the refusal found)
#: Tokens of texts this guard rewrote in place (`_tunnel_wrapper`), one per rewrite, with
#: the refusal each was made for, the latest 64: never the host's token, which stays out
#: of every text the code is shown. A relay token marks only its own refusal, so one the
#: code shows (http.client's bare `OSError`) lets nobody mark another.
_relayed: dict[str, str] = {}


def _first(text: str, keep_marked: str = "") -> str | None:
    """`refusal_first` of a refusal marked with the host's token, or with a relay token
    around the very refusal it was made for; None for any other text."""
    first = refusal_first(text, (_token,), keep_marked=keep_marked) if _token else None
    for relay, refusal in reversed(_relayed.items()) if first is None else ():
        found = find_refusal(text, (relay,))
        if found is not None and found[2] == refusal:
            return refusal_first(text, (relay,), keep_marked=keep_marked)
    return first


def proxy_refusals(chain: Any) -> list[str]:
    """The proxy's refusals found marked with a genuine token in the texts of `chain`'s
    exceptions, each as the proxy's line with the host's token, for the worker's error
    report: the host takes the error for a refusal its proxy recorded only by these."""
    out: list[str] = []
    for exc in chain if _token else ():
        refusal = getattr(exc, "__dict__", {}).get(_REFUSAL_ATTR)
        line = refusal_line(refusal, token=_token) if isinstance(refusal, str) else ""
        if line and line not in out:
            out.append(line)
    return out


def _refusal_first_str(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A client's error whose text carries the proxy's refusal, marked with this worker's
    token, says the refusal first (rule, target, hint), then its own words; any other text
    (a marker without the token: a server's words), and the exception's type, stay."""
    text = wrapped(*args, **kwargs)
    if isinstance(text, str) and REFUSAL_START in text:
        first = _first(text)
        if first is not None:
            instance.__dict__[_REFUSAL_ATTR] = first.split("\n", 1)[0]
            _clean_chain(instance)
            return first
    return text


def _clean_chain(exc: BaseException) -> None:
    """The client's own exceptions behind `exc` (its causes, contexts and exception
    arguments: urllib3's, httpcore's), whose classes word no `__str__` of their own, put
    refusal-first in place too, so that no traceback of them shows the marked line."""
    todo, seen = [exc.__cause__, exc.__context__, *exc.args], {id(exc)}
    while todo and len(seen) < 32:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        todo += [item.__cause__, item.__context__, *item.args]
        texts = [a for a in item.args if isinstance(a, str)]
        if len(texts) == 1 and (first := _first(texts[0])) is not None:
            item.args = tuple(first if a is texts[0] else a for a in item.args)


def _tunnel_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """http.client's refused `CONNECT` raises a bare `OSError("Tunnel connection failed:
    403 <refusal>")`, whose class cannot be patched: its message is put refusal-first in
    place (the same exception, type and traceback), the refusal kept marked (a token of this
    guard's) in the words that follow, for a library quoting it in its own (urllib3)."""
    try:
        return wrapped(*args, **kwargs)
    except OSError as exc:
        if len(exc.args) == 1 and isinstance(exc.args[0], str):
            relay = new_token()
            first = _first(exc.args[0], keep_marked=relay)
            if first is not None:
                _relayed[relay] = first.split("\n", 1)[0]
                while len(_relayed) > 64:
                    del _relayed[next(iter(_relayed))]
                exc.args = (first,)
                exc.__dict__[_REFUSAL_ATTR] = _relayed[relay]
        raise


def install() -> None:
    for home, dotted in _CLIENT_ERRORS:
        _patch.wrap_later(home, dotted, _refusal_first_str)
    _patch.wrap_later("http.client", "HTTPConnection._tunnel", _tunnel_wrapper)
    _patch.wrap_later("urllib3.connection", "HTTPConnection._tunnel", _tunnel_wrapper)
