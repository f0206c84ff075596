// openai-node and the Vercel AI SDK through holdfast (issue 14).
//
// Usage: node responses_resume.mjs MODE, HOLDFAST_URL set to holdfast's address (no /v1).
//   models   -- client.models.list(): the ids
//   retrieve -- responses.create({stream: true}), read through sequence_number 10, abort, then
//               responses.retrieve(id, {stream: true, starting_after: 10}) to the end
//   helper   -- the same, resumed with responses.stream({response_id, starting_after: 10})
//   aisdk    -- the Vercel AI SDK's streamText with the default provider call (the Responses
//               API), aborted by a 1 s timeout against a slower provider, then called again as
//               an application retries: each call's text, error, whether its abort signal fired
//               (and why) and its duration
//   aisdk-failed -- the Vercel AI SDK's generateText with maxRetries 1 against a request that
//               fails: the error's name, and the status of each try it made
// Prints one JSON object.
import OpenAI from 'openai';

const url = process.env.HOLDFAST_URL;
const mode = process.argv[2];
const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'unused', maxRetries: 0 });
const row = (e) => ({
  type: e.type,
  sequence_number: e.sequence_number ?? null,
  delta: e.type === 'response.output_text.delta' ? e.delta : null,
});
const textOf = (r) =>
  (r.output ?? [])
    .filter((i) => i.type === 'message')
    .flatMap((i) => i.content)
    .filter((p) => p.type === 'output_text')
    .map((p) => p.text)
    .join('');

async function start(until) {
  const stream = await client.responses.create({
    model: 'gpt-4o-mini',
    input: 'resume me through holdfast',
    stream: true,
  });
  const before = [];
  let id = null;
  for await (const event of stream) {
    before.push(row(event));
    if (event.type === 'response.created') id = event.response.id;
    if (event.sequence_number >= until) break; // leaving the loop aborts the connection
  }
  return { id, before };
}

const out = {};
if (mode === 'models') {
  const ids = [];
  for await (const model of client.models.list()) ids.push(model.id);
  out.ids = ids;
} else if (mode === 'retrieve' || mode === 'helper') {
  const { id, before } = await start(10);
  const after = [];
  if (mode === 'retrieve') {
    const stream = await client.responses.retrieve(id, { stream: true, starting_after: 10 });
    for await (const event of stream) after.push(row(event));
  } else {
    const stream = client.responses.stream({ response_id: id, starting_after: 10 });
    for await (const event of stream) after.push(row(event));
    out.helper_final_text = textOf(await stream.finalResponse());
  }
  const final = await client.responses.retrieve(id);
  Object.assign(out, { id, before, after, status: final.status, final_text: textOf(final) });
} else if (mode === 'aisdk') {
  const { streamText } = await import('ai');
  const { createOpenAI } = await import('@ai-sdk/openai');
  const provider = createOpenAI({ baseURL: `${url}/v1`, apiKey: 'unused' });
  // Each call's text, the error the stream reported (onError or a throw), whether its abort
  // signal fired and why (`TimeoutError` for the timeout), and how long it took.
  const run = async (timeoutMs) => {
    const signal = timeoutMs ? AbortSignal.timeout(timeoutMs) : undefined;
    const started = performance.now();
    let error = null;
    const result = streamText({
      model: provider('gpt-4o-mini'),
      prompt: 'the AI SDK through holdfast',
      abortSignal: signal,
      onError: ({ error: e }) => {
        error = String(e?.name ?? e);
      },
    });
    let text = '';
    try {
      for await (const part of result.textStream) text += part;
    } catch (e) {
      error = String(e?.name ?? e);
    }
    return {
      text,
      error,
      aborted: signal?.aborted ?? false,
      abort_reason: signal?.reason?.name ?? null,
      elapsed_ms: Math.round(performance.now() - started),
    };
  };
  out.first = await run(1000);
  out.second = await run(null);
} else if (mode === 'aisdk-failed') {
  const { generateText } = await import('ai');
  const { createOpenAI } = await import('@ai-sdk/openai');
  const provider = createOpenAI({ baseURL: `${url}/v1`, apiKey: 'unused' });
  try {
    await generateText({ model: provider('gpt-4o-mini'), prompt: 'fails', maxRetries: 1 });
    out.error = null;
  } catch (e) {
    out.error = e?.name ?? String(e);
    // A RetryError lists each try's error; a single failure is its own.
    out.statuses = (e?.errors ?? [e]).map((x) => x?.statusCode ?? null);
  }
} else {
  throw new Error(`unknown mode ${mode}`);
}
console.log(JSON.stringify(out));
