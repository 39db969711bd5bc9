"""Streamed responses (spec §5.3): server-sent-event lines → chunk times, usage, finish reason.

Only lines starting with exactly `data: ` count; `[DONE]` ends the stream. Every other data
line is a chunk, timed when it is read, even if its payload is not JSON: the usage-only chunk
after the last token and the chat role-only chunk therefore count, as in BLIS.
"""

from __future__ import annotations

import dataclasses
import json

DATA_PREFIX = b"data: "
DONE = b"[DONE]"


@dataclasses.dataclass
class StreamState:
    chunk_times_us: list[int] = dataclasses.field(default_factory=list)
    usage: dict | None = None
    finish_reason: str = ""
    done: bool = False

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_times_us)

    def feed(self, line: bytes, now_us: int) -> None:
        """One line of the body (with or without its line end)."""
        if line.endswith(b"\n"):
            line = line[:-1]
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line.startswith(DATA_PREFIX):
            return  # blank separators, event:/id: fields, comments, `data:` without the space
        payload = line[len(DATA_PREFIX):]
        if payload == DONE:
            self.done = True
            return
        self.chunk_times_us.append(now_us)
        try:
            obj = json.loads(payload)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            reason = choices[0].get("finish_reason")
            if isinstance(reason, str) and reason:
                self.finish_reason = reason


def usage_tokens(usage: dict | None) -> tuple[int, int]:
    """(completion_tokens, prompt_tokens) of a usage object: JSON numbers truncated, else 0."""
    def number(key: str) -> int:
        v = (usage or {}).get(key)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0
    return number("completion_tokens"), number("prompt_tokens")
