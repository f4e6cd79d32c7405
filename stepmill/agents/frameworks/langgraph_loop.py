"""A calculator agent built with LangGraph (`pip install langgraph langchain-openai`): the graph of its
tool-calling agent, a model node and LangGraph's ToolNode in a loop until the model answers without a call.

The model is LangChain's ChatOpenAI (chat completions on an `openai` client) at --base-url (OPENAI_BASE_URL,
which stepmill's runner sets from [route] base_url); the client's httpx takes HTTPS_PROXY (the run's tags)
and SSL_CERT_FILE. Nothing is traced unless LANGSMITH_TRACING is set (the runner passes it only when
[isolation] pass_env names it).

    echo "What is 17 * 23?" | python langgraph_loop.py --model qwen
"""

from __future__ import annotations

import sys

from shared import INSTRUCTIONS, calculator, run, sampling


def answer(args) -> str:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    tools = [tool(calculator)]
    model = ChatOpenAI(model=args.model, base_url=args.base_url, api_key=args.api_key, max_retries=1,
                       **sampling(args)).bind_tools(tools)

    def call_model(state: MessagesState) -> dict:
        return {"messages": [model.invoke([SystemMessage(INSTRUCTIONS), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)  # a tool call goes to "tools", an answer ends
    graph.add_edge("tools", "model")
    # Each turn is two steps of the graph (the model, then the tools).
    result = graph.compile().invoke({"messages": [HumanMessage(args.task)]}, {"recursion_limit": 2 * args.max_turns})
    return result["messages"][-1].content


if __name__ == "__main__":
    sys.exit(run("LangGraph", "langgraph langchain-openai", answer))
