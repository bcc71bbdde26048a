"""The egress proxy's parsers as fuzz targets (used by `egress_fuzz.py` and replayed by
`test_egress_parsers.py`). Each target takes bytes and may raise only the errors that
mean "refused" (the proxy answers 400 / a SOCKS5 error / a `net.resolve` denial)."""

from __future__ import annotations

from agent_sandbox.providers import _egress

#: What a parser may raise for bad input: the proxy turns each into a refusal.
REFUSALS = (_egress._BadMessage, ValueError)


def head(data: bytes) -> None:
    """A request head as the proxy reads it, then its target and host."""
    end = data.find(b"\r\n\r\n")
    head_bytes = data if end < 0 else data[:end]
    try:
        start, headers = _egress._split_head(head_bytes[: _egress.MAX_HEAD_BYTES])
        method, target, _version = _egress._request_line(start)
        _egress._framing(headers)
        host, port, _path = _egress._parse_target(method.upper(), target)
        assert 0 <= port <= 65535
        _egress.normalise_host(host)
    except REFUSALS:
        return


def socks(data: bytes) -> None:
    """A SOCKS5 greeting then request, as the proxy reads them."""
    greeting = _egress.socks5_greeting(data)
    if greeting is None:
        return
    answer, used = greeting
    assert answer in (b"\x05\x00", b"\x05\xff") and 2 <= used <= len(data)
    request = _egress.socks5_request(data[used:])
    if request is None:
        return
    code, host, port, taken = request
    assert (code in (0, 7, 8) and 0 <= port <= 65535 and taken <= len(data) - used) or code == 8
    if code == 0:
        try:
            _egress.normalise_host(host)
        except ValueError:
            return


def host(data: bytes) -> None:
    """A host as a client spells it: one spelling, stable when read again."""
    text = data.decode("latin-1")
    try:
        spelled = _egress.normalise_host(text)
    except ValueError:
        return
    again = _egress.normalise_host(spelled.text)
    assert again.text == spelled.text and again.judged == spelled.judged, (text, spelled, again)


TARGETS = {"egress_head": head, "egress_socks": socks, "egress_host": host}
