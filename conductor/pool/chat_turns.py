"""Our message list -> the (system, alternating turns) shape Anthropic and Gemini require."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from conductor.pool.base import Message

TurnRole = Literal["user", "assistant"]


@dataclass(frozen=True)
class Turn:
    role: TurnRole
    text: str
    last: int = -1
    """The index (in the message list) of the last message merged into this turn."""


@dataclass(frozen=True)
class Conversation:
    system: str | None
    turns: list[Turn]
    system_last: int = -1
    """The index of the last system message (-1: none)."""

    def ending_at(self, index: int, messages: list[Message]) -> int | None:
        """Where the prefix ``messages[:index + 1]`` ends in this conversation: -1 if it is exactly the
        system text, the number of a turn if it ends exactly with that turn, None if it ends inside the
        system text or a turn (merged with what follows, or a system message comes later) or is blank."""
        q = index
        while q >= 0 and not messages[q].content.strip():
            q -= 1  # blank messages were left out: the prefix ends where the last one with text does
        if q < 0:
            return None
        if messages[q].role == "system":
            only_system = all(m.role == "system" or not m.content.strip() for m in messages[:q + 1])
            return -1 if only_system and self.system_last == q else None
        if self.system_last > q:
            return None
        for number, turn in enumerate(self.turns):
            if turn.last == q:
                return number
        return None


def to_conversation(messages: list[Message]) -> Conversation:
    """System messages are pulled out (joined in order); consecutive same-role turns are merged,
    because both APIs reject two user (or two assistant) turns in a row. Blank messages are left out
    (an earlier step that answered nothing): both APIs reject a turn with empty text."""
    system_parts: list[str] = []
    system_last = -1
    turns: list[Turn] = []
    for index, message in enumerate(messages):
        if not message.content.strip():
            continue
        if message.role == "system":
            system_parts.append(message.content)
            system_last = index
            continue
        role: TurnRole = "user" if message.role == "user" else "assistant"
        if turns and turns[-1].role == role:
            turns[-1] = Turn(role, f"{turns[-1].text}\n\n{message.content}", index)
        else:
            turns.append(Turn(role, message.content, index))
    return Conversation(system="\n\n".join(system_parts) if system_parts else None, turns=turns,
                        system_last=system_last)


def merge_system(messages: list[Message]) -> list[dict[str, str]]:
    """Every system message's text in one system message first, the other turns in order: templates that
    keep only the first system message (llama-cpp-python's ``chatml``: a chat's own system prompt after
    the worker's was lost) see them all."""
    system = "\n\n".join(m.content for m in messages if m.role == "system")
    rest = [m.as_dict() for m in messages if m.role != "system"]
    return [{"role": "system", "content": system}, *rest] if system else rest


def fold_system(messages: list[Message]) -> list[dict[str, str]]:
    """System text prepended to the first user turn, for chat templates that drop ``system`` messages
    (Gemma's template; llama-cpp-python's ``gemma`` chat format discards them silently)."""
    system = "\n\n".join(m.content for m in messages if m.role == "system")
    rest = [m.as_dict() for m in messages if m.role != "system"]
    if not system:
        return rest
    for turn in rest:
        if turn["role"] == "user":
            turn["content"] = f"{system}\n\n{turn['content']}"
            return rest
    return [{"role": "user", "content": system}, *rest]
