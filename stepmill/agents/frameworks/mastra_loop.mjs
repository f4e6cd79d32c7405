// A calculator agent built with Mastra (`npm install @mastra/core @ai-sdk/openai-compatible zod`, Node 22.13 or
// later), run by its own Agent: model, tool call, tool result, until the model answers without a call.
//
// Its model is an AI SDK OpenAI-compatible chat model (chat completions) at --base-url (OPENAI_BASE_URL, which
// stepmill's runner sets from [route] base_url). The calls go out with Node's fetch, which goes through
// HTTPS_PROXY (the run's tags) where NODE_USE_ENV_PROXY=1 (the runner sets it; Node 22.21 and later honour
// it) and trusts NODE_EXTRA_CA_CERTS. The agent has no memory or storage: each run is one conversation.
//
//     echo "What is 17 * 23?" | node mastra_loop.mjs --model qwen

import { CALCULATOR, INSTRUCTIONS, args, calculate, load } from "./shared.mjs";

const options = args("Mastra");
const { Agent } = load("@mastra/core/agent");
const { createTool } = load("@mastra/core/tools");
const { createOpenAICompatible } = load("@ai-sdk/openai-compatible");
const { z } = load("zod");

const provider = createOpenAICompatible({ name: "stepmill", baseURL: options.baseURL, apiKey: options.apiKey });
const calculator = createTool({
  id: "calculator", description: CALCULATOR, inputSchema: z.object({ expression: z.string() }),
  execute: async ({ expression }) => calculate(expression),
});
const agent = new Agent({
  id: "calculator-agent", name: "calculator agent", instructions: INSTRUCTIONS,
  model: provider.chatModel(options.model), tools: { calculator },
});
const result = await agent.generate(options.task, {
  maxSteps: options.maxTurns, modelSettings: { maxOutputTokens: options.maxTokens, seed: options.seed, maxRetries: 1 },
});
console.log(result.text);
