// What the TypeScript example agents share: their command line, their instructions, the calculator (the
// same tool as stepmill/agents/tool_loop.py's: `calculator(expression)`, arithmetic only) and where their
// packages are found. They import nothing of stepmill.

import { existsSync, readFileSync, realpathSync } from "node:fs";
import { createRequire } from "node:module";
import { delimiter, dirname, join } from "node:path";
import { parseArgs } from "node:util";

export const INSTRUCTIONS = "Solve the task. Use the calculator for arithmetic. End with the answer in \\boxed{}.";
export const CALCULATOR = "Evaluate an arithmetic expression (+ - * / ** and parentheses).";

// The node_modules folders that may hold the framework: NODE_PATH's, those whose .bin is on PATH (where
// `npm exec` and an install's bin folder put them), and the one holding the node that runs this.
function packageFolders() {
  const fromPath = (process.env.PATH || "").split(delimiter).filter((folder) => folder.endsWith(join("node_modules", ".bin")))
    .map((folder) => dirname(folder));
  const folders = [...(process.env.NODE_PATH || "").split(delimiter).filter(Boolean), ...fromPath];
  for (let folder = dirname(realpathSync(process.execPath)); folder !== dirname(folder); folder = dirname(folder)) {
    if (folder.endsWith("node_modules")) folders.push(folder);
  }
  return folders;
}

// A package of the framework (this file sits in stepmill's folder, not beside the framework's install).
export function load(name) {
  const top = name.startsWith("@") ? name.split("/").slice(0, 2).join("/") : name.split("/")[0];
  const folder = packageFolders().find((candidate) => existsSync(join(candidate, top, "package.json")));
  if (folder === undefined) {
    throw new Error(`${top} is not installed where this node (${process.execPath}) looks: npm install ${top}, and put ` +
      "its node_modules/.bin on PATH (or name its node_modules in NODE_PATH)");
  }
  return createRequire(join(dirname(folder), "_"))(name);
}

// The command line every example takes; the task comes on standard input (or as the last argument).
export function args(framework) {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: { model: { type: "string", default: process.env.STEPMILL_MODEL || "gpt-4o-mini" },
      // The runner sets OPENAI_BASE_URL from [route] base_url; calls go through HTTPS_PROXY (the run's tags).
      "base-url": { type: "string", default: process.env.OPENAI_BASE_URL || "https://api.openai.com/v1" },
      "max-turns": { type: "string", default: "6" }, "max-tokens": { type: "string" } },
  });
  const task = (positionals.length ? positionals.join(" ") : readFileSync(0, "utf8")).trim();
  const seed = process.env.STEPMILL_SEED ? Number(process.env.STEPMILL_SEED) : undefined;
  const maxTokens = values["max-tokens"] ? Number(values["max-tokens"]) : undefined;
  return { framework, task, model: values.model, baseURL: values["base-url"], maxTurns: Number(values["max-turns"]),
    maxTokens, seed, apiKey: process.env.OPENAI_API_KEY || "sk-local" };
}

// Arithmetic only: numbers, + - * / ** and parentheses, parsed here (nothing is evaluated as code); an
// error comes back as text, so the model sees it and can try again.
export function calculate(expression) {
  try {
    const tokens = String(expression).match(/\d+\.?\d*(?:e[+-]?\d+)?|\*\*|[-+*/()]|\S/gi) || [];
    let at = 0;
    const peek = () => tokens[at];
    const take = (want) => (peek() === want ? (at++, true) : false);
    const atom = () => {
      if (take("(")) { const value = sum(); if (!take(")")) throw new Error("a ( is not closed"); return value; }
      if (take("-")) return -power();
      if (take("+")) return power();
      const token = tokens[at++];
      if (token === undefined || !/^\d/.test(token)) throw new Error("only arithmetic is allowed");
      return Number(token);
    };
    const power = () => { const base = atom(); return take("**") ? base ** power() : base; };
    const product = () => {
      let value = power();
      for (;;) { if (take("*")) value *= power(); else if (take("/")) value /= power(); else return value; }
    };
    const sum = () => {
      let value = product();
      for (;;) { if (take("+")) value += product(); else if (take("-")) value -= product(); else return value; }
    };
    const value = sum();
    if (at !== tokens.length) throw new Error("only arithmetic is allowed");
    if (!Number.isFinite(value)) throw new Error("division by zero");
    return String(value);
  } catch (error) {
    return `error: ${error.message}`;
  }
}
