"""A turn typed with ``june-produce turn`` is an inbound message from the person at the shell, not a proactive one.

Its inbound event is ``{"source": "cli", "kind": "message", "user": {"id": <login name or
--user>, "attested": true}}``; ``--proactive-by`` keeps the proactive form. An attested speaker is
the default answerer of an input request that names none (the ``form`` agent's shipping form):
the CLI's user may answer it, nobody else.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from tests.integration.conftest import Stack

from .cli_kit import OnTerminal, run_cli


def new_session() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


def started(stack: Stack, agent: str, session: str) -> dict[str, Any]:
    return next(e for e in stack.events(agent, session) if e["type"] == "turn.started")


def test_a_cli_turn_is_an_inbound_message_of_its_user(gw_stack: Stack) -> None:
    session = new_session()
    ran = run_cli(gw_stack, "turn", "ops", session, "hello", "--timeout", "30", tty=True, user="ann")
    assert ran.code == 0, ran.out + ran.err
    assert " started (cli from ann)" in ran.out and "proactive" not in ran.out
    trigger = started(gw_stack, "ops", session)["trigger"]
    assert trigger["kind"] == "inbound"
    event = trigger["event"]
    assert (event["source"], event["kind"], event["user"]) == ("cli", "message", {"id": "ann", "attested": True})
    other = new_session()
    assert run_cli(gw_stack, "turn", "ops", other, "hello", "--user", "op-bea", "--json").code == 0
    assert started(gw_stack, "ops", other)["trigger"]["event"]["user"] == {"id": "op-bea", "attested": True}


def test_following_a_session_shows_what_the_person_typed_as_well_as_the_agents_reply(gw_stack: Stack) -> None:
    # Given a turn typed at the shell, and finished
    session = new_session()
    assert run_cli(gw_stack, "turn", "ops", session, "hello from ann", "--json", "--timeout", "30").code == 0
    assert started(gw_stack, "ops", session)["trigger"]["event"]["text"] == "hello from ann"
    # When someone follows the session on a terminal
    turn_id = started(gw_stack, "ops", session)["turn_id"]
    ran = run_cli(gw_stack, "follow", "ops", session, "--turn", turn_id, "--timeout", "30", tty=True)
    # Then they see both sides: what ann typed, then the agent's reply
    assert ran.code == 0, ran.out + ran.err
    lines = ran.out.splitlines()
    said = lines.index("› hello from ann")
    assert lines[said - 1].endswith("started (cli from ann)")
    assert "ok: hello from ann" in lines[said + 1 :]


def test_proactive_by_keeps_the_proactive_form(gw_stack: Stack) -> None:
    session = new_session()
    ran = run_cli(gw_stack, "turn", "ops", session, "digest", "--proactive-by", "cron:daily", "--json")
    assert ran.code == 0, ran.err
    assert started(gw_stack, "ops", session)["trigger"] == {"kind": "proactive", "by": "cron:daily"}
    refused = run_cli(gw_stack, "turn", "ops", new_session(), "x", "--proactive-by", "cron:daily", "--user", "ann")
    assert refused.code == 2 and "--user names the speaker of the default event" in refused.err


def test_the_cli_user_is_the_default_answerer_of_its_turns_requests(gw_stack: Stack) -> None:
    session = new_session()
    parked = run_cli(gw_stack, "turn", "form", session, "ship it", "--json", "--timeout", "30", user="ann")
    assert parked.code == 3, parked.err
    request = [json.loads(line) for line in parked.out.splitlines()][-1]["request"]
    assert request["answerers"] == {"user": "ann"}
    turn_id = started(gw_stack, "form", session)["turn_id"]
    assert f"answer with: june-produce resume form {session} {turn_id} shipping VALUE --by ann" in parked.err
    answer = json.dumps({"address": "1 Main St"})
    refused = run_cli(gw_stack, "resume", "form", session, turn_id, "shipping", answer, "--by", "bob", "--json")
    assert refused.code == 1 and json.loads(refused.out)["status"] == "forbidden"
    ok = run_cli(gw_stack, "resume", "form", session, turn_id, "shipping", answer, "--by", "ann", "--json", "--follow")
    assert ok.code == 0, ok.out + ok.err
    assert json.loads(ok.out.splitlines()[-1])["type"] == "turn.completed"


def test_ctrl_c_while_following_a_turn_says_in_one_line_that_it_goes_on_and_how_to_follow_it(gw_stack: Stack) -> None:
    # Given june-produce turn showing a turn that is still running (its tool holds until released)
    session, key = new_session(), uuid.uuid4().hex[:8]
    cli = OnTerminal(gw_stack, "turn", "ops", session, f"slow {key}")
    cli.wait_for("→ hold")
    # When the person presses Ctrl-C
    ran = cli.interrupt()
    # Then it exits 130 with one line saying the turn goes on, and the command that follows it
    turn_id = started(gw_stack, "ops", session)["turn_id"]
    last = ran.out.strip().splitlines()[-1]
    follow = f"june-produce follow ops {session} --turn {turn_id}"
    assert last == f"june-produce: stopped following; turn {turn_id} goes on without you: {follow}", ran.out
    assert ran.code == 130 and "Traceback" not in ran.out
    # and the turn does go on: released, it completes, and that command shows its end
    gw_stack.redis.set(f"it:hold:{key}:release", "1")
    assert gw_stack.wait_terminal("ops", session, turn_id)["type"] == "turn.completed"
    shown = run_cli(gw_stack, *follow.split()[1:], "--timeout", "30", tty=True)
    assert shown.code == 0 and "✓ completed" in shown.out
