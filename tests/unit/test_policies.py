"""Per-source policies, identity, proactive turns and subagents (scenarios B, G, L, S6)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from june_worker import Agent, Runtime, ToolContext, tool
from june_worker.engine.agent import derive_policies
from june_worker.engine.model import ModelRequest
from june_worker.engine.store import INITIATOR_STEP, SessionRef, SurfacePolicy
from june_worker.engine.tools import NoTransactionHandle
from june_worker.engine.types import ToolMessage, TriggerMessage
from june_worker.errors import AgentDefinitionError
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import MemoryStore, SQLiteStore

from .kit import Recorder, runtime_with, transcript


def recording_model() -> ScriptedModel:
    return ScriptedModel(["ok"], record=True)


def event(source: str, **kw: Any) -> dict[str, Any]:
    return {"source": source, **kw}


async def test_s98_s99_overlay_chosen_by_the_events_source() -> None:
    model = recording_model()
    rt = runtime_with(
        MemoryStore(), model, instructions="BASE", policies={"slack": "ASSIST-MODE", "crisp": "CRISP-NOTE"}
    )
    s = rt.session("ops", "s1")
    for ev in (event("slack"), event("crisp"), event("web"), None):
        await s.turn("hi", event=ev)
    assert [r.system for r in model.requests] == ["BASE\n\nASSIST-MODE", "BASE\n\nCRISP-NOTE", "BASE", "BASE"]
    bare = recording_model()
    await runtime_with(MemoryStore(), bare, instructions="BASE").session("ops", "s1").turn("hi", event=event("slack"))
    assert bare.requests[0].system == "BASE"


async def test_s103_s104_s105_append_replace_and_bare_string_policies() -> None:
    model = recording_model()
    policies = {
        "web": SurfacePolicy(overlay="WEB OVERLAY"),
        "slack": SurfacePolicy(overlay="SLACK ONLY", mode="replace"),
        "crisp": SurfacePolicy(overlay="", mode="replace"),
        "email": "OLD STYLE",
    }
    rt = runtime_with(MemoryStore(), model, instructions="BASE", policies=policies)
    s = rt.session("ops", "s1")
    for ev in (event("web"), event("slack"), None, event("crisp"), event("email")):
        await s.turn("hi", event=ev)
    assert [r.system for r in model.requests] == ["BASE\n\nWEB OVERLAY", "SLACK ONLY", "BASE", "", "BASE\n\nOLD STYLE"]


async def test_s108_agent_instructions_reach_the_model_as_the_system_prompt() -> None:
    model = recording_model()
    rt = runtime_with(SQLiteStore(":memory:"), model, instructions="You are the ops assistant.")
    await rt.session("ops", "s1").turn("hi")
    assert model.requests[0].system == "You are the ops assistant."


async def test_deny_tools_hides_the_tool_and_a_hallucinated_call_fails_as_unknown() -> None:
    runs: list[str] = []

    @tool
    async def issue_refund(order_id: str) -> dict[str, bool]:
        """Refund."""
        runs.append(order_id)
        return {"refunded": True}

    @tool
    def faq() -> str:
        """FAQ."""
        return "see docs"

    script = [Reply("", calls=[{"id": "c1", "name": "issue_refund", "input": {"order_id": "42"}}]), Reply("done")]
    model = ScriptedModel(script, record=True)
    store = MemoryStore()
    policies = {"slack": SurfacePolicy(deny_tools=["issue_refund"])}
    rt = runtime_with(store, model, [issue_refund, faq], policies=policies)
    await rt.session("ops", "s1").turn("refund 42", event=event("slack"))
    assert [t.name for t in model.requests[0].tools] == ["faq"]
    assert runs == []
    result = [m for m in transcript(store) if isinstance(m, ToolMessage)][0]
    assert result.result == {"error": "unknown tool issue_refund"}


async def test_the_policy_saved_at_park_is_kept_by_the_resumed_turn() -> None:
    @tool
    async def ask(ctx: ToolContext) -> dict[str, Any]:
        """Ask."""
        return {"ok": await ctx.request_input(id="q", prompt="?", answerers={"user": "U1"})}

    model = ScriptedModel([Reply("", calls=[{"id": "c1", "name": "ask", "input": {}}]), Reply("after")], record=True)
    agent = Agent(name="ops", model=model, tools=[ask], instructions="BASE", policies={"slack": "PARKED OVERLAY"})
    store = MemoryStore()
    rt = Runtime([agent], store)
    s = rt.session("ops", "s1")
    await s.start("go", turn_id="t1", event=event("slack", user={"id": "U1", "attested": True}))
    await s.result("t1")
    # the agent's policy changes while the turn waits (a redeploy); the resumed turn keeps its own
    agent2 = Agent(name="ops", model=model, tools=[ask], instructions="BASE", policies={"slack": "NEW OVERLAY"})
    rt2 = Runtime([agent2], store)
    await rt2.session("ops", "s1").resume("t1", "q", True, by="U1")
    await rt2.session("ops", "s1").result("t1")
    assert [r.system for r in model.requests] == ["BASE\n\nPARKED OVERLAY", "BASE\n\nPARKED OVERLAY"]


async def test_s100_tools_requiring_a_principal_are_not_offered_to_anonymous_turns() -> None:
    @tool(requires_principal=True)
    def get_orders(ctx: ToolContext) -> list[str]:
        """The caller's orders."""
        return []

    @tool
    def faq() -> str:
        """FAQ."""
        return ""

    model = recording_model()
    rt = runtime_with(MemoryStore(), model, [get_orders, faq])
    s = rt.session("ops", "s1")
    await s.turn("hi", event=event("web"))
    await s.turn("hi", event=event("web", principal={"id": "owner@school.tw"}))
    assert [[t.name for t in r.tools] for r in model.requests] == [["faq"], ["get_orders", "faq"]]


def _probe_runtime(store: Any = None) -> tuple[Runtime, list[tuple[Any, Any]]]:
    seen: list[tuple[Any, Any]] = []

    @tool
    def probe(ctx: ToolContext) -> dict[str, bool]:
        """Record who is speaking."""
        seen.append((ctx.principal.id if ctx.principal else None, ctx.initiator.id if ctx.initiator else None))
        return {"ok": True}

    def script(req: ModelRequest) -> Reply:
        if isinstance(req.messages[-1], ToolMessage):
            return Reply("done")
        return Reply("", calls=[{"id": f"ip-{req.turn_id}", "name": "probe", "input": {}}])

    return runtime_with(store or MemoryStore(), ScriptedModel(script), [probe]), seen


async def test_s17_an_anonymous_opener_leaves_the_initiator_seat_empty() -> None:
    rt, seen = _probe_runtime()
    s = rt.session("ops", "s1")
    base = {"source": "slack", "kind": "message"}
    await s.turn("a", turn_id="t1", event=base)
    await s.turn("b", turn_id="t2", event={**base, "principal": {"id": "B"}})
    await s.turn("c", turn_id="t3", event={**base, "principal": {"id": "C"}})
    assert seen == [(None, None), ("B", "B"), ("C", "B")]


async def test_s19_the_opening_message_and_the_seat_claim_share_one_transaction() -> None:
    class Recording(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.transactions: list[list[str]] = []

        def commit(self, ref: SessionRef, commit: Any, *, fence: int | None = None) -> Any:
            if callable(commit):
                commit = commit(NoTransactionHandle("recording store"))
            self.transactions.append(
                [f"append:{m.role}" for _, m in commit.messages] + [f"put:{s.step_id}" for s in commit.steps]
            )
            return super().commit(ref, commit, fence=fence)

    store = Recording()
    rt, _ = _probe_runtime(store)
    await rt.session("ops", "s1").turn("a", turn_id="t1", event={"source": "slack", "principal": {"id": "A"}})
    opening = [t for t in store.transactions if "append:user" in t]
    assert opening == [["append:user", f"put:{INITIATOR_STEP}"]]


async def test_s57_a_proactive_turn_opens_with_an_attributed_trigger_message() -> None:
    store = MemoryStore()
    rt = runtime_with(store, ScriptedModel(["Daily summary: 3 open threads."]))
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    text = await s.turn(
        "Summarize today's open threads.", turn_id="t1", trigger={"kind": "proactive", "by": "cron:daily"}
    )
    assert text == "Daily summary: 3 open threads."
    assert transcript(store)[0] == TriggerMessage(turn_id="t1", text="Summarize today's open threads.", by="cron:daily")
    assert rec.events[0].trigger.model_dump() == {"kind": "proactive", "by": "cron:daily"}


async def test_s6_a_subagent_is_a_child_session_driven_from_a_tool() -> None:
    @tool
    async def ask_researcher(ctx: ToolContext, q: str) -> dict[str, str]:
        """Ask the researcher."""
        child = ctx.runtime.session("researcher", f"{ctx.session_id}:sub:{ctx.call.id}")
        return {"answer": await child.turn(q)}

    store = MemoryStore()
    ops_script = [
        Reply(
            "Let me research that.",
            calls=[{"id": "c1", "name": "ask_researcher", "input": {"q": "should I order widgets?"}}],
        ),
        Reply("Research says: widgets are trending; buy 3"),
    ]
    rt = Runtime(
        [
            Agent(name="researcher", model=ScriptedModel(["widgets are trending; buy 3"])),
            Agent(name="ops", model=ScriptedModel(ops_script), tools=[ask_researcher]),
        ],
        store,
    )
    assert await rt.session("ops", "s1").turn("go", turn_id="t1") == "Research says: widgets are trending; buy 3"
    step = store.load(SessionRef("ops", "s1")).steps["tool:1:c1"]
    assert step.data["result"] == {"answer": "widgets are trending; buy 3"}
    child = transcript(store, agent="researcher", session="s1:sub:c1")
    assert [m.text for m in child if m.role == "assistant"] == ["widgets are trending; buy 3"]


# --- assembly ---------------------------------------------------------------------------------------------


def test_s110_a_mode_without_a_variant_file_is_an_assembly_error(tmp_path: Path) -> None:
    (tmp_path / "instructions.md").write_text("BASE")
    (tmp_path / "agent.toml").write_text('name = "ops"\n[surfaces.slack]\nmode = "replace"\n')
    with pytest.raises(AgentDefinitionError, match=r"instructions\.slack\.md does not exist"):
        Agent.from_dir(tmp_path, model=ScriptedModel(["x"]))


def test_from_dir_reads_instructions_overlays_and_surfaces(tmp_path: Path) -> None:
    (tmp_path / "instructions.md").write_text("BASE\n")
    (tmp_path / "instructions.slack.md").write_text("SLACK ONLY\n")
    (tmp_path / "agent.toml").write_text(
        'name = "ops"\n[surfaces.slack]\nmode = "replace"\ndeny_tools = ["issue_refund"]\n'
    )
    agent = Agent.from_dir(tmp_path, model=ScriptedModel(["x"]), tools=[])
    policy = agent.policy_for(__import__("june_worker").engine.types.InboundEvent(source="slack"))
    assert agent.name == "ops" and agent.instructions == "BASE"
    assert policy is not None and (policy.overlay, policy.mode, policy.deny_tools) == (
        "SLACK ONLY",
        "replace",
        ["issue_refund"],
    )
    assert agent.system_prompt(policy) == "SLACK ONLY"


def test_s111_a_source_given_by_a_variant_file_and_by_the_policies_map_is_an_assembly_error(tmp_path: Path) -> None:
    # Given instructions.slack.md and a [policies] entry for slack in agent.toml
    (tmp_path / "instructions.md").write_text("BASE")
    (tmp_path / "instructions.slack.md").write_text("FROM THE FILE")
    (tmp_path / "agent.toml").write_text('name = "ops"\n[policies]\nslack = "FROM THE MAP"\n')
    # When the agent is assembled, Then it refuses, naming both places
    with pytest.raises(AgentDefinitionError) as raised:
        Agent.from_dir(tmp_path, model=ScriptedModel(["x"]), tools=[])
    message = str(raised.value)
    assert "instructions.slack.md" in message and "policies.slack" in message and str(tmp_path) in message


def test_s111_a_policies_entry_beside_a_surfaces_table_for_the_same_source_is_an_error() -> None:
    with pytest.raises(AgentDefinitionError, match=r"\[surfaces\.web\] in agent\.toml and by policies\.web"):
        derive_policies(variants={}, surfaces={"web": {"deny_tools": ["x"]}}, legacy={"web": "LEGACY"})


def test_s112_legacy_entries_pass_through_and_orphan_policies_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="june_worker.agent"):
        policies = derive_policies(variants={"slack": "OV"}, legacy={"crisp": "LEGACY"}, known_sources=["slack"])
    assert policies["slack"] == SurfacePolicy(source="slack", overlay="OV")
    assert policies["crisp"] == "LEGACY"
    assert [r.getMessage() for r in caplog.records] == [
        "policy for source 'crisp': no channel emits that source, so it never applies"
    ]


async def test_a_proactive_turn_is_delivered_to_its_target_by_the_agents_hook() -> None:
    delivered: list[dict[str, Any]] = []

    async def deliver(*, target: dict[str, Any], result: Any, events: list[Any], session: str) -> None:
        delivered.append({"target": target, "text": result.text, "types": [e.type for e in events], "session": session})

    rt = runtime_with(MemoryStore(), ScriptedModel(["Good morning."]), deliver=deliver)
    s = rt.session("ops", "slack:C-ops:daily")
    turn_id = await s.start(
        "Summarize today's open threads.",
        trigger={"kind": "proactive", "by": "cron:daily"},
        target={"channel": "C-ops"},
    )
    await s.result(turn_id)
    assert delivered == [
        {
            "target": {"channel": "C-ops"},
            "text": "Good morning.",
            "types": ["turn.started", "message.completed", "turn.completed"],
            "session": "slack:C-ops:daily",
        }
    ]


async def test_a_target_without_a_deliver_hook_is_an_error_not_a_silent_drop() -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel(["x"]))
    with pytest.raises(AgentDefinitionError, match="no deliver hook"):
        await rt.session("ops", "s1").start("x", trigger={"kind": "proactive", "by": "cron"}, target={"channel": "C"})
