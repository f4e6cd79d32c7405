// A calculator agent built with Vercel's AI SDK (`npm install ai @ai-sdk/openai-compatible`, Node 22 or later),
// run by its own ToolLoopAgent: model, tool call, tool result, until the model answers without a call.
//
// The model is an OpenAI-compatible chat model (chat completions) at --base-url (OPENAI_BASE_URL, which
// stepmill's runner sets from [route] base_url). The SDK calls it with Node's fetch, which goes through
// HTTPS_PROXY (the run's tags) where NODE_USE_ENV_PROXY=1 (the runner sets it; Node 22.21 and later honour
// it) and trusts NODE_EXTRA_CA_CERTS.
//
//     echo "What is 17 * 23?" | node ai_sdk_loop.mjs --model qwen

import { CALCULATOR, INSTRUCTIONS, args, calculate, load } from "./shared.mjs";

const options = args("Vercel's AI SDK");
const { ToolLoopAgent, isStepCount, jsonSchema, tool } = load("ai");
const { createOpenAICompatible } = load("@ai-sdk/openai-compatible");

const provider = createOpenAICompatible({ name: "stepmill", baseURL: options.baseURL, apiKey: options.apiKey });
const calculator = tool({
  description: CALCULATOR,
  inputSchema: jsonSchema({ type: "object", properties: { expression: { type: "string" } }, required: ["expression"] }),
  execute: async ({ expression }) => calculate(expression),
});
const agent = new ToolLoopAgent({
  model: provider.chatModel(options.model), instructions: INSTRUCTIONS, tools: { calculator },
  stopWhen: isStepCount(options.maxTurns), maxOutputTokens: options.maxTokens, seed: options.seed, maxRetries: 1,
});
const result = await agent.generate({ prompt: options.task });
console.log(result.text);
