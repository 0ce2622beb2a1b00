"""When a request stops: stop token ids, EOS, max_tokens, max_model_len, and stop strings."""

from __future__ import annotations

from graphrt.core.request import Request


def token_stop_reason(req: Request, token: int, max_model_len: int) -> str | None:
    """Checked after each appended token; the stopping token stays in token_ids."""
    p = req.params
    if token in req.ending_token_ids:
        return "stop"
    if len(req.output_token_ids) >= p.max_tokens:
        return "length"
    if req.num_tokens >= max_model_len:
        return "length"
    return None


def find_stop_string(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index where the earliest stop string begins at or after ``start``, or None."""
    hits = [i for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(hits) if hits else None


class Detokenizer:
    """A request's output text, kept whole and cut before any stop string.

    Decoded incrementally: each update decodes only the tokens since the last complete piece of
    text, with the tokens before them as context (a tokenizer may decode a token differently at
    the start of a text, e.g. dropping its leading space), and appends the difference. Re-decoding
    the whole output every step cost time quadratic in its length (about 40 µs a request and step
    at 250 tokens, 160 at 1,000). Tokens that may end inside a multi-byte character wait for the rest of it (at
    most three more); where a window holds bytes that are no character, the whole output is
    decoded. The text is then the same as one decode of all the tokens, and ``finish`` makes it
    so whatever the tokens."""

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.text = ""
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.streamed = 0  # characters already handed to a stream
        self._context = 0  # tokens [_context, _read) decode to _context_text, the end of text
        self._read = 0
        self._context_text = ""
        self._stopped = False

    def update(self, token_ids: list[int]) -> bool:
        """Take the output's new tokens; returns True when a stop string ended it."""
        if self.tokenizer is None or self._stopped:
            return self._stopped
        window = self.tokenizer.decode(token_ids[self._context :])
        if window.endswith("\ufffd") and len(token_ids) - self._read < 4:
            return False  # the last tokens may end inside a character: wait for the rest of it
        old = len(self.text)
        if "\ufffd" not in window and window.startswith(self._context_text):
            text = self.text + window[len(self._context_text) :]
        else:  # bytes that are no character (a tokenizer may then render their neighbours
            text = self.tokenizer.decode(token_ids)  # differently too), or a changed context
        self._context, self._read = self._read, len(token_ids)
        self._context_text = self.tokenizer.decode(token_ids[self._context : self._read])
        cut = find_stop_string(text, self.stops, old) if self.stops else None
        self.text = text if cut is None else text[:cut]
        self._stopped = cut is not None
        return self._stopped

    def finish(self, token_ids: list[int]) -> None:
        """The final text: one decode of all the tokens (those still waiting for a character's end
        included), cut before a stop string."""
        if self.tokenizer is not None and not self._stopped:
            text = self.tokenizer.decode(token_ids)
            cut = find_stop_string(text, self.stops, len(self.text)) if self.stops else None
            self.text = text if cut is None else text[:cut]

    def stream_delta(self, finished: bool) -> str:
        """New text that is safe to show: while running, hold back what could begin a stop string."""
        end = len(self.text) if finished or not self.stops else max(self.streamed, len(self.text) - self._hold)
        delta = self.text[self.streamed : end]
        self.streamed = end
        return delta
