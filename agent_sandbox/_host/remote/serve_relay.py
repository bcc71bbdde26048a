"""The framing of `worker serve`'s hot path (`POST /run`), without h11's per-event machinery.

A remote call crosses `worker serve` twice: the host's request goes on to the worker on its
Unix socket, and the worker's SSE response comes back to the host. With h11 on both sides
that was some fifteen h11 events per call (header lists validated four times, the state
machine at every chunk), most of the relay's CPU, and so most of what a remote warm call
costs beyond a local one (`benchmarks/bench_remote.py`). The shapes here are fixed and
known, so they are written and read directly:

* to the worker: one request, built as bytes (`run_request`);
* from the worker: `ResponseReader`, a sans-IO reader of one response, strict and bounded:
  a status line and headers (at most `HEAD_MAX` bytes), then a chunked body whose pieces it
  passes on as they arrive (never more buffered than what one read brought), a size line of
  at most 16 hex digits, CRLF after every chunk, no trailers, nothing after the end. The
  worker's user code can write to that socket, so anything else is an `UpstreamError` and
  the worker is discarded, as h11's `RemoteProtocolError` did;
* to the host: the response's head (`SSE_HEAD`) and chunks framed here (`chunk`, `END`).
  The host parses every byte with h11 all the same (and judges every event).

Requests from the host still go through h11 (`remote/serve.py`), as do all other routes.
"""

from __future__ import annotations

import re
import socket

import h11

__all__ = [
    "END",
    "HEAD_MAX",
    "SSE_HEAD",
    "ResponseReader",
    "UpstreamError",
    "chunk",
    "connect_unix",
    "next_request_parser",
    "run_request",
]

#: The most a response head from the worker may take.
HEAD_MAX = 65536
#: The head of a `/run` response to the host (as h11 writes it for these headers).
SSE_HEAD = (
    b"HTTP/1.1 200 \r\n"
    b"content-type: text/event-stream\r\n"
    b"cache-control: no-store\r\n"
    b"x-accel-buffering: no\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
#: The end of a chunked body (no trailers).
END = b"0\r\n\r\n"

_HEX = frozenset(b"0123456789abcdefABCDEF")
# The head's grammar as h11 reads it (RFC 9110/9112: a token name, a value of visible
# characters and inner blanks, optional blanks around it; `HTTP/1.1`, three digits, an
# optional reason after one space), so the relay never accepts a head h11 frames otherwise.
_VCHAR = rb"[\x21-\x7e\x80-\xff]"
_STATUS_LINE = re.compile(rb"HTTP/1\.1 [0-9]{3}(?: [ \t\x21-\x7e\x80-\xff]*)?")
_HEADER_FIELD = re.compile(
    rb"([-!#$%&'*+.^_`|~0-9a-zA-Z]+):[ \t]*((?:"
    + _VCHAR
    + rb"+(?:[ \t]+"
    + _VCHAR
    + rb"+)*)?)[ \t]*"
)
# Where the reader is in the chunked body.
_SIZE, _DATA, _DATA_CRLF, _LAST_CRLF, _DONE = range(5)


def connect_unix(path: str) -> socket.socket | None:
    """A connection to the worker's socket, or None."""
    inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        inner.settimeout(5.0)
        inner.connect(path)
    except OSError:
        inner.close()
        return None
    return inner


def next_request_parser(old: h11.Connection) -> h11.Connection:
    """After a response written outside h11: a fresh server-side parser for the host's next
    request, fed whatever of it `old` had already received."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=65536)
    data, closed = old.trailing_data
    if data:
        conn.receive_data(bytes(data))
    if closed:
        conn.receive_data(b"")
    return conn


class UpstreamError(Exception):
    """The worker broke the framing of its response."""


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (nothing for empty data: an empty chunk ends the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


def run_request(token: str, body: bytes) -> bytes:
    """`POST /run` to the worker, head and body in one piece."""
    return (
        b"POST /run HTTP/1.1\r\nhost: worker\r\nauthorization: Bearer %b\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
        % (token.encode("ascii"), len(body), body)
    )


class ResponseReader:
    """One response from the worker, fed as it arrives; see the module's docstring."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.status: int | None = None
        self.chunked = False
        self.close = False  # the worker said it closes the connection after this response
        self.done = False
        self._state = _SIZE
        self._left = 0
        self._head_checked = 0  # bytes of the head already checked for bare CR and LF

    def feed(self, data: bytes) -> list[bytes]:
        """The body's bytes that `data` completes (in order); sets `status`, then `done`."""
        if self.done:
            if data:
                raise UpstreamError("the worker sent bytes after the end of its response")
            return []
        self.buf += data
        if self.status is None:
            self._no_bare_line_ends()
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > HEAD_MAX:
                    raise UpstreamError("the worker's response head is too large")
                return []
            head = bytes(self.buf[:end])
            del self.buf[: end + 4]
            self._head(head)
        if self.status != 200 or not self.chunked:
            return []  # the caller refuses the call; the body is never read (on any feed)
        return self._body()

    def _no_bare_line_ends(self) -> None:
        """Every CR and LF in the head so far is one half of a CRLF. h11 (which the host
        runs on what the relay passes on) also ends a head at a bare LF, so a head with
        one would be framed two ways; the worker writes CRLF, so anything else is refused.
        Each byte is checked once (a head fed a byte at a time stays linear)."""
        buf = self.buf
        i = self._head_checked
        n = len(buf)
        while i < n:
            cr = buf.find(b"\r", i)
            lf = buf.find(b"\n", i, cr if cr >= 0 else n)
            if lf >= 0:
                raise UpstreamError("the worker's response head has a bare LF")
            if cr < 0:
                i = n
                break
            if cr + 1 >= n:
                i = cr  # its LF has not arrived yet
                break
            if buf[cr + 1] != 0x0A:
                raise UpstreamError("the worker's response head has a bare CR")
            i = cr + 2
            if i >= 4 and buf[i - 4 : i] == b"\r\n\r\n":
                break  # the end of the head: the body is not a head's business
        self._head_checked = i

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status = lines[0]
        if not _STATUS_LINE.fullmatch(status):
            raise UpstreamError("the worker's response has no valid status line")
        for line in lines[1:]:
            field = _HEADER_FIELD.fullmatch(line)
            if field is None:
                raise UpstreamError("the worker's response has a malformed header")
            name, value = field.group(1).lower(), field.group(2).lower()
            if name == b"transfer-encoding":
                if value != b"chunked" or self.chunked:
                    raise UpstreamError("the worker's response has an unexpected encoding")
                self.chunked = True
            elif name == b"connection" and value == b"close":
                self.close = True
        if self.chunked and any(line.lower().startswith(b"content-length:") for line in lines[1:]):
            raise UpstreamError("the worker's response has both a length and chunks")
        self.status = int(status[9:12])

    def _body(self) -> list[bytes]:
        out: list[bytes] = []
        buf = self.buf
        while buf:
            if self._state == _DATA:
                piece = bytes(buf[: self._left])
                del buf[: len(piece)]
                self._left -= len(piece)
                out.append(piece)
                if self._left:
                    break
                self._state = _DATA_CRLF
            elif self._state in (_DATA_CRLF, _LAST_CRLF):
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise UpstreamError("the worker's chunk does not end with CRLF")
                del buf[:2]
                if self._state == _LAST_CRLF:
                    self._state = _DONE
                    self.done = True
                    if buf:
                        raise UpstreamError("the worker sent bytes after the end of its response")
                    break
                self._state = _SIZE
            else:  # _SIZE
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 18:
                        raise UpstreamError("the worker's chunk size line is too long")
                    break
                line = bytes(buf[:end])
                if not line or len(line) > 16 or not _HEX.issuperset(line):
                    raise UpstreamError("the worker's chunk size line is malformed")
                del buf[: end + 2]
                size = int(line, 16)
                if size:
                    self._state, self._left = _DATA, size
                else:
                    self._state = _LAST_CRLF
        return out
