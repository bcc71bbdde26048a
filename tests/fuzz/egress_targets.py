"""The egress proxy's parsers as fuzz targets (used by `egress_fuzz.py` and replayed by
`test_egress_parsers.py`). Each target takes bytes and may raise only the errors that
mean "refused" (the proxy answers 400 / a SOCKS5 error / a `net.resolve` denial)."""

from __future__ import annotations

import h11

from agent_sandbox._host.egress import proxy as _egress

#: What a parser may raise for bad input: the proxy turns each into a refusal.
REFUSALS = (_egress._BadMessage, ValueError, h11.LocalProtocolError)


def head(data: bytes) -> None:
    """A request head as the proxy reads it (h11 and the proxy's checks), then its target
    and host, and the request the proxy would send upstream, rebuilt by h11."""
    try:
        request, framing = _egress.read_request(data[: _egress.MAX_HEAD_BYTES + 4])
        assert framing[0] in ("length", "chunked", "none") and framing[1] >= 0
        method = request.method.decode("ascii")
        host, port, path = _egress._parse_target(method.upper(), request.target.decode("ascii"))
        assert 0 <= port <= 65535
        _egress.normalise_host(host)
        out = h11.Connection(h11.CLIENT)
        out.send(
            h11.Request(
                method=request.method,
                target=path.encode("ascii"),
                headers=[("host", "example.test"), *_egress._end_to_end(request.headers)],
            )
        )
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
