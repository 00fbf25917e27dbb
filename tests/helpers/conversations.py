"""The conversation the chat tests render: two exchanges, and a system message to put before them."""

from __future__ import annotations

from typing import Any

#: Two user/assistant exchanges with short answers, so that rendered text stays readable.
TWO_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Reverse: one two"},
    {"role": "assistant", "content": "two one"},
]
SYSTEM_BRIEF: dict[str, Any] = {"role": "system", "content": "Be brief."}
