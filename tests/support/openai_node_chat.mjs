// The openai Node SDK (the official `openai` npm package) streams one chat completion from
// tether and prints what it read as one line of JSON: {"text", "chunks"}, or where the SDK
// raised its own error, {"error": {"class", "message", "status"}}. Anything else it throws
// ends the script with its stack and a non-zero status.
//
//   node openai_node_chat.mjs PORT BODY
//
// PORT: tether's, on loopback. BODY: the chat completion request as JSON (streamed; members
// the SDK does not know, such as the fake engine's `fake`, go to the server as they are).
// The package is loaded from the node_modules directory $TESTS_NODE_MODULES names: an ES
// module's `import` ignores NODE_PATH, a require rooted there does not need it.
import { createRequire } from "node:module";
import { resolve } from "node:path";

const [port, body] = process.argv.slice(2);
const OpenAI = createRequire(resolve(process.env.TESTS_NODE_MODULES) + "/")("openai");

// No retry (a test sees the first answer), and a bound below the test's own.
const client = new OpenAI({
  baseURL: `http://127.0.0.1:${port}/v1`,
  apiKey: "x",
  maxRetries: 0,
  timeout: 20_000,
});

let result;
try {
  const stream = await client.chat.completions.create(JSON.parse(body));
  let text = "";
  let chunks = 0;
  for await (const chunk of stream) {
    // As strict as the Python SDK's test: a chunk without a choice is a failure, not text.
    text += chunk.choices[0].delta.content ?? "";
    chunks += 1;
  }
  result = { text, chunks };
} catch (error) {
  if (!(error instanceof OpenAI.OpenAIError)) {
    throw error;
  }
  result = {
    error: { class: error.constructor.name, message: error.message, status: error.status ?? null },
  };
}
process.stdout.write(JSON.stringify(result) + "\n");
