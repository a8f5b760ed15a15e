"""The console's boundary: a text stream that masks what is written to it, line by line,
linear in what is written and holding back only a bounded tail."""

from __future__ import annotations

from rayacc.redact.keys import SCHEME_WORDS
from rayacc.redact.known import KNOWN
from rayacc.redact.mask import _apply, _mask_str, _spans
from rayacc.redact.shapes import _PEM_BEGIN, _PEM_END, _line_end


def _word_start(text: str, pos: int) -> int:
    """Where the word holding `text[pos]` starts (`pos` itself after a blank)."""
    return max(text.rfind(" ", 0, pos), text.rfind("\t", 0, pos)) + 1


def _context(text: str, start: int) -> int:
    """Where a masked value starting at `start` begins with its key: the start of its word
    (`password=VALUE`), else the word before it (`--token VALUE`, `password: VALUE`), two
    after a scheme (`Authorization: Bearer VALUE`)."""
    at = _word_start(text, start)
    if at < start:
        return at
    for _ in range(2):
        end = at
        while end > 0 and text[end - 1] in " \t":
            end -= 1
        if end == 0:
            return 0
        at = _word_start(text, end - 1)
        if text[at:end].lower() not in SCHEME_WORDS:
            break
    return at


class RedactingStream:
    """A text stream (stdout, stderr) that masks credentials in what is written to it: the
    console's boundary, for rayacc's own lines and for any library's. Linear in what is
    written; it holds back only a bounded tail: a line not ended yet up to `WINDOW` characters
    (then all but a tail that may go on in the next write), and a private key block to its END
    line up to `MAX_KEY` (docs/design.md, "Secrets"). `release()` writes what is held."""

    WINDOW = 1 << 12
    MAX_KEY = 1 << 16
    _DECIDE = 64
    """Characters after `-----BEGIN ` that tell a private key's header from another."""

    def __init__(self, stream):
        self._stream = stream
        self._partial = ""
        self._key: list[str] | None = None
        """A private key block being held, in pieces (its size in `_key_size`)."""
        self._key_size = 0
        self._dropping = False
        self._tail = ""
        """The last characters searched for an END marker (one may come in two writes)."""

    def write(self, text: str) -> int:
        if not text:
            return 0
        plain = not (self._partial or self._key is not None or self._dropping)
        if plain and text[-1] == "\n" and _PEM_BEGIN not in text:
            self._stream.write(_mask_str(text))  # whole lines, no key block: the common write
            return len(text)
        self._feed(text)
        return len(text)

    def _feed(self, text: str) -> None:
        if self._dropping or self._key is not None:
            text = self._in_block(text)
            if not text:
                return
        old = len(self._partial)
        pending = self._partial + text  # the held part is bounded: a bounded copy
        begin = self._key_begin(pending, max(0, old - len(_PEM_BEGIN) - self._DECIDE))
        if begin == -2:  # a BEGIN not decided yet: held (a few characters)
            self._partial = pending
            return
        if begin >= 0:
            self._emit(pending[:begin])
            self._partial = ""
            self._key, self._key_size, self._tail = [], 0, ""
            rest = self._in_block(pending[begin:])
            if rest:
                self._feed(rest)
            return
        ends = [e for e in (text.rfind("\n"), text.rfind("\r")) if e != -1]
        cut = old + max(ends) + 1 if ends else 0
        if cut:
            self._emit(pending[:cut])
            pending = pending[cut:]
        if len(pending) > self.WINDOW:
            pending = self._spill(pending)
        self._partial = pending

    def _key_begin(self, text: str, start: int) -> int:
        """Where a private key block opens in `text` (searched from `start`): -1 none, -2 a
        BEGIN too short yet to tell."""
        at = text.find(_PEM_BEGIN, start)
        while at != -1:
            head = text[at : at + len(_PEM_BEGIN) + self._DECIDE]
            line = head.split("\n", 1)[0].split("\r", 1)[0]
            if "PRIVATE KEY" in line:
                return at
            if line == head and len(head) < len(_PEM_BEGIN) + self._DECIDE:
                return -2
            at = text.find(_PEM_BEGIN, at + 1)
        return -1

    def _in_block(self, text: str) -> str:
        """Takes `text` into the key block held (or dropped); returns what follows its END
        marker (to go on as ordinary text), or '' while the block goes on."""
        probe = self._tail + text
        end = probe.find(_PEM_END)
        if end == -1:
            self._tail = probe[-(len(_PEM_END) - 1) :]
            if self._dropping:
                return ""
            assert self._key is not None
            self._key.append(text)
            self._key_size += len(text)
            if self._key_size > self.MAX_KEY:
                # not a key's size: its BEGIN line goes out with the rest masked (the block's
                # body is masked to the end of the text), the rest is dropped up to its END
                self._emit("".join(self._key))
                self._key, self._dropping = None, True
            return ""
        at = end - len(self._tail)  # where END starts in `text` (negative: in the tail)
        block = None
        if self._key is not None:
            block = "".join(self._key) + text[: max(at, 0)]
            if at < 0:
                block = block[:at]
        self._key, self._dropping, self._tail = None, False, ""
        rest = probe[end:]
        if block is not None:
            # the block with its END line, masked whole (its END line ends where the line does)
            line_end = _line_end(rest, 0)
            self._emit(block + rest[: line_end + 1])
            return rest[line_end + 1 :]
        return rest

    def _spill(self, pending: str) -> str:
        """A line longer than WINDOW: writes it masked but for a tail, and returns the tail.
        The cut falls at a blank, a secret's length before the end, and before the key of any
        masked value that reaches past it (`_context`), so what goes on in the next write is
        read with its key."""
        cut = _word_start(pending, max(len(pending) - max(KNOWN.longest, 1), 0))
        spans = _spans(pending)
        # latest end first: a value the cut would part from its key moves the cut before both,
        # and what moved it is not met again (one pass)
        for start, end in sorted(spans, key=lambda span: -span[1]):
            if cut <= 0:
                break
            if end > cut:
                cut = min(cut, _context(pending, start))
        if cut <= 0:  # no cut keeps every value with its key: all but a secret's length goes
            cut = len(pending) - max(KNOWN.longest - 1, 0)
            for start, end in spans:
                if start < cut < end:
                    context = _context(pending, start)
                    cut = context if context > 0 else end
        # the spans found with the whole of it are the emitted part's (none reaches past the cut)
        self._stream.write(_apply(pending[:cut], [(a, min(b, cut)) for a, b in spans if a < cut]))
        return pending[cut:]

    def write_data(self, text: str) -> int:
        """Writes what a command was asked to show (a job's logs, Ray's records included),
        masked like any line; a console stream that drops Ray's records keeps this."""
        return RedactingStream.write(self, text)

    def _emit(self, lines: str) -> None:
        if lines:
            self._stream.write(_mask_str(lines))

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def release(self) -> None:
        """Writes what is held back, masked (a key block not closed: masked whole), and
        flushes."""
        held = self._partial
        if self._key is not None:
            held += "".join(self._key)
        self._partial, self._key, self._dropping, self._tail = "", None, False, ""
        self._emit(held)
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
