"""The Block Kit a turn is shown with: the approval prompt and its buttons, and a prompt once answered.

Buttons carry ``action_id`` ``june_input:yes`` / ``june_input:no`` (the only ids the gateway
answers; :data:`ACTION_PREFIX`) and a JSON ``value`` that routes the click: the turn, the input
and the answer (``true`` / ``false``), and the session. Slack signs the click that carries it back.
"""

from __future__ import annotations

import json
from typing import Any

from ...engine.types import InputRequest

__all__ = ["ACTION_PREFIX", "answered_blocks", "button_value", "prompt_blocks"]

ACTION_PREFIX = "june_input:"
_MAX_SECTION = 3000  # Slack's limit on a section's text
_MAX_BLOCKS = 50  # Slack's limit on a message's blocks
_CUT = "\n… _(cut: the rest is longer than one Slack message holds)_"


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": text[:_MAX_SECTION] or " "}}


def _pieces(text: str, size: int) -> list[str]:
    """``text`` in pieces of at most ``size`` characters, cut at a line break (else a space) where there is one."""
    out = []
    while len(text) > size:
        cut = text.rfind("\n", 0, size + 1)
        if cut <= 0:
            cut = text.rfind(" ", 0, size + 1)
        if cut <= 0:
            cut = size
        out.append(text[:cut])
        text = text[cut:].lstrip("\n")
    return [*out, text] if text else out


def _sections(text: str, room: int) -> list[dict[str, Any]]:
    """``text`` as consecutive sections (one holds 3,000 characters), at most ``room`` of them; past that, cut."""
    pieces = _pieces(text, _MAX_SECTION)
    if len(pieces) > room:
        pieces = pieces[: room - 1] + [_pieces(pieces[room - 1], _MAX_SECTION - len(_CUT))[0] + _CUT]
    return [_section(p) for p in pieces]


def button_value(turn_id: str, input_id: str, answer: bool, session: str) -> str:
    return json.dumps({"turn_id": turn_id, "input_id": input_id, "input": answer, "session": session})


def prompt_blocks(request: InputRequest, *, turn_id: str, session: str, confirm: bool = False) -> list[dict[str, Any]]:
    """The prompt and its Approve / Deny buttons; with ``confirm``, each asks again in a dialog first."""
    approve: dict[str, Any] = {
        "type": "button",
        "action_id": f"{ACTION_PREFIX}yes",
        "text": {"type": "plain_text", "text": "Approve"},
        "value": button_value(turn_id, request.id, True, session),
    }
    deny: dict[str, Any] = {
        "type": "button",
        "action_id": f"{ACTION_PREFIX}no",
        "text": {"type": "plain_text", "text": "Deny"},
        "value": button_value(turn_id, request.id, False, session),
    }
    if confirm:
        approve["confirm"] = {
            "title": {"type": "plain_text", "text": "Confirm approval"},
            "text": {"type": "mrkdwn", "text": request.prompt[:300] or "Approve?"},
            "confirm": {"type": "plain_text", "text": "Approve"},
            "deny": {"type": "plain_text", "text": "Cancel"},
        }
        deny["confirm"] = {
            "title": {"type": "plain_text", "text": "Confirm denial"},
            "text": {"type": "mrkdwn", "text": request.prompt[:300] or "Deny?"},
            "confirm": {"type": "plain_text", "text": "Deny"},
            "deny": {"type": "plain_text", "text": "Cancel"},
            "style": "danger",
        }
    else:
        approve["style"] = "primary"
    return [_section(request.prompt), {"type": "actions", "block_id": f"june_input:{request.id}"[:255],
                                       "elements": [approve, deny]}]  # fmt: skip


def answered_blocks(prompt: str, body: str) -> list[dict[str, Any]]:
    """The prompt once answered: no buttons, and what the turn did next under it (over as many sections as it
    takes: Slack shows a message's blocks, not its text, and one section holds 3,000 characters)."""
    blocks = [_section(prompt), {"type": "context", "elements": [{"type": "mrkdwn", "text": "Answered."}]}]
    if body:
        blocks.extend(_sections(body, _MAX_BLOCKS - len(blocks)))
    return blocks
