"""OpenAI response bodies: whole choices, streamed chunks, usage and log-probabilities."""

from __future__ import annotations

from typing import Any

from graphrt.server.engine_loop import Submission


class Choices:
    """A submission's requests collected to the end (a non-streaming response)."""

    def __init__(self, engine, submission: Submission, chat: bool, echo: list[str] | None, k: int = 0) -> None:
        n = len(submission.streams)
        self.engine, self.submission, self.chat, self.echo, self.k = engine, submission, chat, echo, k
        self.text = [""] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.top_logprobs: list[list[dict]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.prompt_logprobs: list[list | None] = [None] * n
        self.error = False

    async def collect(self) -> None:
        async for index, delta in self.submission.events():
            self.text[index] += delta.text
            self.tokens[index].extend(delta.token_ids)
            self.logprobs[index].extend(delta.logprobs)
            self.top_logprobs[index].extend(delta.top_logprobs)
            self.finish[index] = delta.finish_reason
            self.error |= delta.finish_reason == "error"
            if delta.prompt_logprobs is not None:
                self.prompt_logprobs[index] = delta.prompt_logprobs

    def _prompt_entries(self, i: int) -> list[tuple[str, float | None]]:
        """The echoed prompt's tokens and their log-probabilities (None for the first)."""
        ids = self.submission.streams[i].prompt_token_ids
        given = self.prompt_logprobs[i] or [None] * len(ids)
        decode = self.engine.tokenizer.decode
        return [(decode([t]), None if e is None else e[t], None) for t, e in zip(ids, given)]

    def token_counts(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def bodies(self, finish_names: dict[str, str]) -> list[dict[str, Any]]:
        out = []
        for i in range(len(self.text)):
            entries = None
            if self.logprobs[i]:
                entries = token_entries(
                    self.engine.tokenizer, self.tokens[i], self.logprobs[i], self.top_logprobs[i], self.k
                )
            finish = finish_names.get(self.finish[i], self.finish[i])
            if self.chat:
                message = {"role": "assistant", "content": self.text[i]}
                out.append(
                    {"index": i, "message": message, "logprobs": chat_logprobs(entries), "finish_reason": finish}
                )
            else:
                text = (self.echo[i] if self.echo else "") + self.text[i]
                if entries is not None and self.echo:
                    entries = self._prompt_entries(i) + entries
                out.append(
                    {"index": i, "text": text, "logprobs": completion_logprobs(entries), "finish_reason": finish}
                )
        return out


def usage(submission: Submission, completion_tokens: list[int]) -> dict[str, int]:
    """OpenAI counts a prompt once however many choices it has."""
    prompts: dict[tuple[int, ...], int] = {}
    for s in submission.streams:
        prompts.setdefault(tuple(s.prompt_token_ids), len(s.prompt_token_ids))
    prompt = sum(prompts.values()) if len(prompts) > 1 else next(iter(prompts.values()))
    done = sum(completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def token_entries(tokenizer, token_ids, logprobs, tops, k: int) -> list[tuple]:
    """(text, logprob, alternatives) per token; alternatives: the k likeliest (text, logprob),
    most likely first, or None when none were asked for."""
    out = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        alternatives = None
        if k and i < len(tops) and tops[i] is not None:
            best = sorted(tops[i].items(), key=lambda item: -item[1])[:k]
            alternatives = [(tokenizer.decode([a]), v) for a, v in best]
        out.append((tokenizer.decode([t]), lp, alternatives))
    return out


def chat_logprobs(entries: list[tuple] | None) -> dict[str, Any] | None:
    if entries is None:
        return None

    def item(text, lp):
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**item(text, lp), "top_logprobs": [item(*a) for a in alts or ()]} for text, lp, alts in entries]
    }


def completion_logprobs(entries: list[tuple] | None, offset: int = 0) -> dict[str, Any] | None:
    if entries is None:
        return None
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    tops = [None if alts is None else dict(alts) for _, _, alts in entries]
    return {
        "tokens": [t for t, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": tops if any(t is not None for t in tops) else None,
        "text_offset": offsets,
    }


def chat_chunk(rid, created, model, index, text=None, role=None, logprobs=None, finish=None, usage_field=False):
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
        delta["content"] = ""
    elif text:
        delta["content"] = text
    choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    if usage_field:
        chunk["usage"] = None
    return chunk


def completion_chunk(rid, created, model, index, text=None, role=None, logprobs=None, finish=None, usage_field=False):
    choice = {"index": index, "text": text or "", "logprobs": completion_logprobs(logprobs), "finish_reason": finish}
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if usage_field:
        chunk["usage"] = None
    return chunk
