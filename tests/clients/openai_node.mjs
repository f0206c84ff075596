// openai-node (the official OpenAI Node SDK) through holdfast (SPEC RS-2, RS-3, RS-5, ID-1).
//
// Usage: node openai_node.mjs MODE, with HOLDFAST_URL set to holdfast's address (no /v1).
//   create    -- the same chat completion twice (.withResponse()); print both answers' headers
//   stream    -- a chat completion, then the same request with stream: true twice; print texts
//   timeout   -- timeout: 1000 and maxRetries: 5 against a slow provider; print what the SDK saw
//   broken    -- stream: true while the provider drops mid-stream; print the error class and text
//   abort     -- stream: true, abandon it after 3 content chunks, send it again and read it
//                all; then the same request without stream: true; print texts and headers
//   responses -- the Responses API: create, then stream: true twice (named events), then the
//                responses.stream() helper; print texts, event types and headers
//   identity  -- one chat completion with `temperature: 1` (HOLDFAST_TEMPERATURE unset or "1";
//                "none" leaves it out), keys in a different order than openai-python sends them
// Every mode prints one JSON object on stdout. `bodies` are the raw request bodies the SDK sent.
import OpenAI from 'openai';

const url = process.env.HOLDFAST_URL;
const mode = process.argv[2];

/** Every fetch the SDK makes: its body, and whether it ended in a timeout (abort). */
const fetches = [];
async function recordingFetch(input, init) {
  const entry = {
    body: typeof init?.body === 'string' ? init.body : null,
    idempotency_key: new Headers(init?.headers).get('idempotency-key'),
    outcome: 'pending',
  };
  fetches.push(entry);
  try {
    const response = await fetch(input, init);
    entry.outcome = response.status;
    return response;
  } catch (e) {
    entry.outcome = e?.name === 'AbortError' ? 'timeout' : `error: ${e}`;
    throw e;
  }
}

function client(options = {}) {
  return new OpenAI({
    baseURL: `${url}/v1`,
    apiKey: 'unused',
    maxRetries: 0,
    fetch: recordingFetch,
    ...options,
  });
}

/** The holdfast headers of a response (RS-5). */
function holdfast(response) {
  return {
    status: response.status,
    request_id: response.headers.get('holdfast-request-id'),
    replayed: response.headers.get('idempotent-replayed'),
    upstream_request_id: response.headers.get('x-request-id'),
  };
}

const messages = [{ role: 'user', content: 'hello from openai-node' }];
const out = { mode };

if (mode === 'create') {
  const openai = client();
  out.calls = [];
  for (let i = 0; i < 2; i++) {
    const { data, response } = await openai.chat.completions
      .create({ model: 'gpt-4o-mini', messages })
      .withResponse();
    out.calls.push({ ...holdfast(response), content: data.choices[0].message.content });
  }
} else if (mode === 'stream') {
  const openai = client();
  const completion = await openai.chat.completions.create({ model: 'gpt-4o-mini', messages });
  out.non_stream = completion.choices[0].message.content;
  out.streams = [];
  for (let i = 0; i < 2; i++) {
    const { data: stream, response } = await openai.chat.completions
      .create({ model: 'gpt-4o-mini', messages, stream: true })
      .withResponse();
    let text = '';
    let chunks = 0;
    for await (const chunk of stream) {
      chunks++;
      text += chunk.choices[0]?.delta?.content ?? '';
    }
    out.streams.push({ ...holdfast(response), text, chunks });
  }
} else if (mode === 'timeout') {
  const openai = client({ timeout: 1000, maxRetries: 5 });
  const started = Date.now();
  const { data, response } = await openai.chat.completions
    .create({ model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'a slow answer, please' }] })
    .withResponse();
  out.elapsed_ms = Date.now() - started;
  out.content = data.choices[0].message.content;
  out.response = holdfast(response);
  out.attempts = fetches.length;
  out.timeouts = fetches.filter((f) => f.outcome === 'timeout').length;
} else if (mode === 'broken') {
  const openai = client();
  let text = '';
  try {
    const stream = await openai.chat.completions.create({ model: 'gpt-4o-mini', messages, stream: true });
    for await (const chunk of stream) {
      text += chunk.choices[0]?.delta?.content ?? '';
    }
  } catch (e) {
    out.raised = e.constructor.name;
    out.message = String(e.message);
  }
  out.text = text;
} else if (mode === 'abort') {
  const openai = client();
  out.streams = [];
  for (const limit of [3, Infinity]) {
    const { data: stream, response } = await openai.chat.completions
      .create({ model: 'gpt-4o-mini', messages, stream: true })
      .withResponse();
    let text = '';
    let pieces = 0;
    for await (const chunk of stream) {
      const piece = chunk.choices[0]?.delta?.content;
      if (piece) {
        text += piece;
        pieces++;
      }
      if (pieces >= limit) {
        break; // leaving the loop aborts the HTTP request, as a closed browser tab would
      }
    }
    out.streams.push({ ...holdfast(response), text });
  }
  const completion = await openai.chat.completions.create({ model: 'gpt-4o-mini', messages });
  out.non_stream = completion.choices[0].message.content;
} else if (mode === 'responses') {
  const openai = client();
  const input = 'hello from openai-node';
  const response = await openai.responses.create({ model: 'gpt-4o-mini', input });
  out.non_stream = response.output_text;
  out.streams = [];
  for (let i = 0; i < 2; i++) {
    const { data: stream, response: http } = await openai.responses
      .create({ model: 'gpt-4o-mini', input, stream: true })
      .withResponse();
    let text = '';
    const types = [];
    for await (const event of stream) {
      types.push(event.type);
      if (event.type === 'response.output_text.delta') {
        text += event.delta;
      }
    }
    out.streams.push({ ...holdfast(http), text, types });
  }
  const helper = openai.responses.stream({ model: 'gpt-4o-mini', input });
  const final = await helper.finalResponse();
  out.helper = final.output_text;
} else if (mode === 'identity') {
  const openai = client();
  // Keys deliberately in another order than openai-python's body (messages, model, temperature).
  const temperature = process.env.HOLDFAST_TEMPERATURE ?? '1';
  const params =
    temperature === 'none'
      ? { model: 'gpt-4o-mini', messages: [{ content: 'same logical request', role: 'user' }] }
      : {
          temperature: Number(temperature),
          model: 'gpt-4o-mini',
          messages: [{ content: 'same logical request', role: 'user' }],
        };
  const { data, response } = await openai.chat.completions.create(params).withResponse();
  out.response = holdfast(response);
  out.content = data.choices[0].message.content;
} else {
  throw new Error(`unknown mode ${mode}`);
}

out.bodies = fetches.map((f) => f.body);
out.outcomes = fetches.map((f) => f.outcome);
out.idempotency_keys = fetches.map((f) => f.idempotency_key);
console.log(JSON.stringify(out));
