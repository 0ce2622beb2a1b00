"""When a request stops: stop token ids, EOS, max_tokens, max_model_len, and stop strings."""

from __future__ import annotations

from graphrt.core.request import Request


def token_stop_reason(req: Request, token: int, max_model_len: int) -> str | None:
    """Checked after each appended token; the stopping token stays in token_ids."""
    p = req.params
    if token in p.stop_token_ids:
        return "stop"
    if not p.ignore_eos and token in req.eos_token_ids:
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
    """A request's output text, kept whole and cut before any stop string."""

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.text = ""
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.streamed = 0  # characters already handed to a stream

    def update(self, token_ids: list[int]) -> bool:
        """Re-decode the output; returns True when a stop string ended it."""
        if self.tokenizer is None:
            return False
        old = len(self.text)
        text = self.tokenizer.decode(token_ids)
        cut = find_stop_string(text, self.stops, old) if self.stops else None
        self.text = text if cut is None else text[:cut]
        return cut is not None

    def stream_delta(self, finished: bool) -> str:
        """New text that is safe to show: while running, hold back what could begin a stop string."""
        end = len(self.text) if finished or not self.stops else max(self.streamed, len(self.text) - self._hold)
        delta = self.text[self.streamed : end]
        self.streamed = end
        return delta
