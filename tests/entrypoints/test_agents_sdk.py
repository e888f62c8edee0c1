"""The OpenAI Agents SDK, unchanged, against the default server (no tool flags): an agent with one
function tool runs to its final output through the Responses API and through Chat Completions. The
first turn forces a call (`tool_choice="required"`); after the tool's result the SDK sends the next
turn with `auto` (its `reset_tool_choice`), which the server must answer and the SDK must read.

SmolLM2-135M, given a tool, calls it again at every `auto` turn (greedy, in any prompt wording tried),
so the run ends through the SDK's `tool_use_behavior` hook once the `auto` turn's call has run: the
final output is that call's result."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import SubprocessServer

agents = pytest.importorskip("agents")


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    """The default server as the other end-to-end tests start it, with room for a few agent turns (the
    SDK's tool schema and the turns' history outgrow the shared server's 512 tokens)."""
    pytest.importorskip("pagedrs._core")
    server = SubprocessServer(
        tmp_path_factory.mktemp("agents"), ["--served-model-name", "smollm2", "--max-model-len", "2048"]
    )
    server.start()
    yield server
    server.kill()


def run_agent(server: SubprocessServer, api: str) -> tuple[Any, list[str]]:
    from openai import AsyncOpenAI

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny and 24 C in {city}."

    client = AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key or "none", max_retries=0)

    def finish_after_auto_turn(ctx: Any, results: list[Any]) -> Any:
        # the first call came from the forced turn; a second one came from an `auto` turn
        done = len(calls) >= 2
        return agents.ToolsToFinalOutputResult(is_final_output=done, final_output=results[-1].output)

    model_cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        tool_use_behavior=finish_after_auto_turn,
        model=model_cls(model="smollm2", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48),
    )

    async def go() -> Any:
        return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=6)

    return asyncio.run(go()), calls


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agent_runs_to_its_final_answer(agent_server: SubprocessServer, api: str) -> None:
    agents.set_tracing_disabled(True)  # no trace upload: the test machine has no network
    result, calls = run_agent(agent_server, api)
    assert len(calls) == 2 and all(isinstance(c, str) and c for c in calls), calls
    assert result.final_output.startswith("It is sunny and 24 C in")
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"] * 2, kinds
    assert len(result.raw_responses) == 2  # the forced turn and the `auto` one
