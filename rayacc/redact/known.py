"""Secrets known by where they came from (`KNOWN`, filled by `origins`), masked by
exact value: one automaton over them; rayacc's own identifiers (`OWN`), which the patterns
never take for one."""

from __future__ import annotations

from rayacc.redact.keys import MASK


class SecretValues:
    """Values known to be secret by where they came from, masked by exact value: one
    automaton (Aho–Corasick) over them, so a text is read once whatever they are. A value
    shorter than `MIN_LENGTH` is not registered (it would mask ordinary words)."""

    MIN_LENGTH = 6

    def __init__(self) -> None:
        self._values: set[str] = set()
        self._machine: tuple[list[dict[str, int]], list[int]] | None = None

    def add(self, value: object) -> None:
        text = (
            str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
        )
        if isinstance(text, str):
            text = text.strip()
            if len(text) >= self.MIN_LENGTH and text != MASK and text not in self._values:
                self._values.add(text)
                self._machine = None

    def __contains__(self, value: str) -> bool:
        return value in self._values

    def __len__(self) -> int:
        return len(self._values)

    @property
    def longest(self) -> int:
        return max(map(len, self._values), default=0)

    def clear(self) -> None:
        self._values.clear()
        self._machine = None

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Where a registered value stands in `text` (the longest ending at each place)."""
        if not self._values or not any(v in text for v in self._values):
            return []  # the common case, in C
        goto, depth_out = self._automaton()
        spans, node = [], 0
        fail = self._fail
        for i, ch in enumerate(text):
            while node and ch not in goto[node]:
                node = fail[node]
            node = goto[node].get(ch, 0)
            if depth_out[node]:
                spans.append((i + 1 - depth_out[node], i + 1))
        return spans

    def _automaton(self) -> tuple[list[dict[str, int]], list[int]]:
        if self._machine is not None:
            return self._machine
        goto: list[dict[str, int]] = [{}]
        depth: list[int] = [0]
        out: list[int] = [0]
        for value in self._values:
            node = 0
            for ch in value:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    out.append(0)
                node = nxt
            out[node] = len(value)
        fail = [0] * len(goto)
        queue = list(goto[0].values())
        for node in queue:  # breadth first: a node's failure link is known before its children's
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0) if goto[f].get(ch, 0) != child else 0
                out[child] = max(out[child], out[fail[child]])
                queue.append(child)
        self._fail = fail
        self._machine = (goto, out)
        return self._machine


KNOWN = SecretValues()
"""This process's secrets by origin: every boundary of the process masks them (the console's
streams, MLflow, files), so they are one registry per process, filled before anything is
written (`origins.register_run`)."""


class OwnValues(SecretValues):
    """rayacc's own identifiers (a saved view's key, a run's id, a folder it made): never a
    secret, whatever shape they have. The patterns' second net passes over them (a view key
    after `…Key=` read as an API key broke the link the summary exists to give); a value by
    origin is still masked."""

    MIN_LENGTH = 4


OWN = OwnValues()
"""This process's own identifiers, registered where rayacc makes or prints them."""
