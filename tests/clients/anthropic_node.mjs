// Anthropic's official Node SDK (@anthropic-ai/sdk) and the Vercel AI SDK's Anthropic provider
// (@ai-sdk/anthropic) through holdfast (SPEC RS-2..RS-5, LC-7, ID-1). Only `baseURL` points them
// at holdfast; `maxRetries: 0` keeps every send visible.
//
// Usage: node anthropic_node.mjs MODE, with HOLDFAST_URL set to holdfast's address (no /v1).
//   create        -- the same messages.create twice (.withResponse()); print both answers' text,
//                    usage and headers
//   stream        -- messages.create({stream: true}) read to its end, then the same request with
//                    the messages.stream() helper (text events, finalMessage()), then without
//                    stream; print event types, texts, final messages and headers
//   broken        -- messages.create({stream: true}) and messages.stream() against a provider
//                    stream that does not finish; print what each raised and what arrived first
//   aisdk         -- `ai`'s generateText twice, then streamText twice, with @ai-sdk/anthropic;
//                    print texts, finish reasons, usage and headers
//   aisdk-broken  -- streamText against a provider stream that does not finish; print what the
//                    caller saw (text, finish reason, the error onError got or a throw)
// Every mode prints one JSON object on stdout. `bodies`, `idempotency_keys` and
// `anthropic_versions` are what each request of the @anthropic-ai/sdk client carried.
import Anthropic from '@anthropic-ai/sdk';

const url = process.env.HOLDFAST_URL;
const mode = process.argv[2];
const model = 'claude-sonnet-4-5';

/** Every fetch the Anthropic client makes: its body, its Idempotency-Key and anthropic-version
 *  headers. */
const fetches = [];
async function recordingFetch(input, init) {
  const headers = new Headers(init?.headers);
  fetches.push({
    body: typeof init?.body === 'string' ? init.body : null,
    idempotency_key: headers.get('idempotency-key'),
    anthropic_version: headers.get('anthropic-version'),
  });
  return fetch(input, init);
}

const client = new Anthropic({ baseURL: url, apiKey: 'unused', maxRetries: 0, fetch: recordingFetch });

/** The holdfast headers of a response (RS-5); `request-id` is Anthropic's own request id. */
function holdfast(headers) {
  const get = (name) => (typeof headers.get === 'function' ? headers.get(name) : headers[name]) ?? null;
  return {
    request_id: get('holdfast-request-id'),
    replayed: get('idempotent-replayed'),
    upstream_request_id: get('request-id'),
  };
}

/** An error as the caller sees it. */
function described(e) {
  return {
    class: e?.constructor?.name ?? typeof e,
    api_error: e instanceof Anthropic.APIError,
    status: e?.status ?? null,
    type: e?.error?.error?.type ?? e?.type ?? null,
    message: String(e?.message ?? e),
  };
}

const textOf = (message) =>
  message.content
    .filter((b) => b.type === 'text')
    .map((b) => b.text)
    .join('');

const params = (content) => ({
  model,
  max_tokens: 64,
  messages: [{ role: 'user', content }],
});

/** messages.create({stream: true}) read to its end: event types, text, and what it raised. */
async function rawStream(content) {
  const out = { types: [], text: '', error: null };
  try {
    const { data: stream, response } = await client.messages
      .create({ ...params(content), stream: true })
      .withResponse();
    Object.assign(out, holdfast(response.headers));
    for await (const event of stream) {
      out.types.push(event.type);
      if (event.type === 'content_block_delta' && event.delta.type === 'text_delta') {
        out.text += event.delta.text;
      }
    }
  } catch (e) {
    out.error = described(e);
  }
  return out;
}

/** The messages.stream() helper: each `text` event, the lifecycle events in order, and
 *  finalMessage() (or what it rejected with). */
async function helperStream(content) {
  const out = { deltas: [], snapshots_grow: true, lifecycle: [], final: null, error: null };
  const stream = client.messages.stream(params(content));
  let last = '';
  stream.on('connect', () => out.lifecycle.push('connect'));
  stream.on('text', (delta, snapshot) => {
    out.deltas.push(delta);
    out.snapshots_grow &&= snapshot === last + delta;
    last = snapshot;
  });
  stream.on('message', () => out.lifecycle.push('message'));
  stream.on('finalMessage', () => out.lifecycle.push('finalMessage'));
  stream.on('error', () => out.lifecycle.push('error'));
  stream.on('end', () => out.lifecycle.push('end'));
  try {
    const message = await stream.finalMessage();
    out.final = {
      id: message.id,
      text: textOf(message),
      stop_reason: message.stop_reason,
      usage: message.usage,
    };
  } catch (e) {
    out.error = described(e);
  }
  if (stream.response) Object.assign(out, holdfast(stream.response.headers));
  out.sdk_request_id = stream.request_id ?? null;
  return out;
}

const out = { mode };

if (mode === 'create') {
  out.calls = [];
  for (let i = 0; i < 2; i++) {
    const { data, response } = await client.messages
      .create(params('hello from the anthropic node sdk'))
      .withResponse();
    out.calls.push({
      ...holdfast(response.headers),
      status: response.status,
      sdk_request_id: data._request_id ?? null,
      id: data.id,
      type: data.type,
      role: data.role,
      model: data.model,
      text: textOf(data),
      stop_reason: data.stop_reason,
      usage: data.usage,
    });
  }
} else if (mode === 'stream') {
  const content = 'stream through holdfast from node';
  out.raw = await rawStream(content);
  out.helper = await helperStream(content);
  const { data, response } = await client.messages.create(params(content)).withResponse();
  out.non_stream = { ...holdfast(response.headers), text: textOf(data), usage: data.usage };
} else if (mode === 'broken') {
  // Two contents, so the two sends are two requests whatever became of the first.
  out.raw = await rawStream('a stream that will not finish (raw events)');
  out.helper = await helperStream('a stream that will not finish (helper)');
} else if (mode === 'aisdk' || mode === 'aisdk-broken') {
  const { generateText, streamText } = await import('ai');
  const { createAnthropic } = await import('@ai-sdk/anthropic');
  const provider = createAnthropic({ baseURL: `${url}/v1`, apiKey: 'unused' });
  const prompt = 'the AI SDK through holdfast to anthropic';
  const stream = async () => {
    let error = null;
    let thrown = null;
    const result = streamText({
      model: provider(model),
      prompt,
      maxRetries: 0,
      onError: ({ error: e }) => {
        error = described(e);
      },
    });
    const deltas = [];
    const row = { deltas, error: null, thrown: null };
    try {
      for await (const delta of result.textStream) deltas.push(delta);
      row.text = await result.text;
      row.finish_reason = await result.finishReason;
      row.usage = await result.usage;
      Object.assign(row, holdfast((await result.response).headers ?? {}));
    } catch (e) {
      thrown = described(e);
    }
    row.error = error;
    row.thrown = thrown;
    return row;
  };
  if (mode === 'aisdk') {
    out.generate = [];
    for (let i = 0; i < 2; i++) {
      const result = await generateText({ model: provider(model), prompt, maxRetries: 0 });
      out.generate.push({
        text: result.text,
        finish_reason: result.finishReason,
        usage: result.usage,
        ...holdfast(result.response.headers ?? {}),
      });
    }
    out.streams = [await stream(), await stream()];
  } else {
    out.stream = await stream();
  }
} else {
  throw new Error(`unknown mode ${mode}`);
}

out.bodies = fetches.map((f) => f.body);
out.idempotency_keys = fetches.map((f) => f.idempotency_key);
out.anthropic_versions = fetches.map((f) => f.anthropic_version);
console.log(JSON.stringify(out));
