// A WHATWG EventSource (the `eventsource` package) reading holdfast's log stream
// `GET /requests/{id}` (SPEC RD-2..RD-6).
//
// Usage: node eventsource.mjs BASE [QUERY], optionally with HOLDFAST_DROP_AFTER_EVENTS=N
//   Prints `ready` once loaded, then reads one line from stdin: the request id. It opens
//   `BASE/requests/{id}{QUERY}` (QUERY e.g. `?last_event_id=3`) and follows it as a browser would:
//   every event, the server's close after `end`, the reconnect with `Last-Event-ID`, and — on 204
//   — the final error after which it must stay closed. With HOLDFAST_DROP_AFTER_EVENTS=N the
//   first connection breaks like a dropped network link: after N complete events and part of the
//   next one, its body errors; EventSource must reconnect with `Last-Event-ID: N`.
//   It then waits QUIET_MS more to catch any further reconnect and prints one JSON object:
//     events:   [{type, last_event_id, data, at_ms}] in arrival order (`message`, `end`, `reset`)
//     fetches:  [{last_event_id, accept, status, at_ms}] every HTTP request EventSource made
//     errors:   [{ready_state, code, message, at_ms}] every `error` event
//     opens:    number of `open` events
//     ready_state: at the end (2 = CLOSED)
//     open_record: the JSON record (`GET /requests/{id}`) fetched at the first `open`
//     timed_out: true when it did not settle within LIMIT_MS
//     dropped_at_ms: when the simulated drop happened (HOLDFAST_DROP_AFTER_EVENTS only)
import { createInterface } from 'node:readline';

import { EventSource } from 'eventsource';

const QUIET_MS = 1500; // > holdfast's `retry: 1000`
const LIMIT_MS = 20000;

const [base, query = ''] = process.argv.slice(2);
const dropAfter = process.env.HOLDFAST_DROP_AFTER_EVENTS
  ? Number(process.env.HOLDFAST_DROP_AFTER_EVENTS)
  : null;
console.log('ready');
const lines = createInterface({ input: process.stdin });
const id = (await lines[Symbol.asyncIterator]().next()).value.trim();
lines.close();

const start = Date.now();
const at = () => Date.now() - start;
const out = { events: [], fetches: [], errors: [], opens: 0, open_record: null, timed_out: false };

/** The fetch EventSource uses, recording each request's Last-Event-ID and answer status. */
async function recordingFetch(input, init) {
  const entry = {
    last_event_id: new Headers(init?.headers).get('last-event-id'),
    accept: new Headers(init?.headers).get('accept'),
    status: null,
    at_ms: at(),
  };
  out.fetches.push(entry);
  const response = await fetch(input, init);
  entry.status = response.status;
  if (dropAfter !== null && out.fetches.length === 1 && response.status === 200) {
    return dropMidEvent(response, dropAfter);
  }
  return response;
}

/** Where to cut `text`: a few bytes into the data of event N+1, or null while not there yet. */
function cutPoint(text, n) {
  const idLine = /(^|\n)id: /g;
  let count = 0;
  for (let m = idLine.exec(text); m; m = idLine.exec(text)) {
    count += 1;
    if (count === n + 1) {
      const data = text.indexOf('data: ', m.index);
      return data === -1 || data + 8 > text.length ? null : data + 8;
    }
  }
  return null;
}

/** `response` whose body breaks part-way into event N+1, like a connection cut mid-frame. */
function dropMidEvent(response, n) {
  const upstream = response.body.getReader();
  const decoder = new TextDecoder();
  const encoder = new TextEncoder();
  let seen = '';
  let sent = 0;
  const body = new ReadableStream({
    async pull(controller) {
      const { done, value } = await upstream.read();
      if (done) {
        controller.close();
        return;
      }
      seen += decoder.decode(value, { stream: true });
      const cut = cutPoint(seen, n);
      if (cut === null) {
        controller.enqueue(encoder.encode(seen.slice(sent)));
        sent = seen.length;
        return;
      }
      controller.enqueue(encoder.encode(seen.slice(sent, cut)));
      out.dropped_at_ms = at();
      await upstream.cancel();
      controller.error(new Error('simulated network drop'));
    },
  });
  return new Response(body, { status: response.status, headers: response.headers });
}

const source = new EventSource(`${base}/requests/${id}${query}`, { fetch: recordingFetch });

let limit;
const settled = new Promise((resolve) => {
  const onEvent = (event) => {
    out.events.push({
      type: event.type,
      last_event_id: event.lastEventId,
      data: event.data,
      at_ms: at(),
    });
  };
  source.addEventListener('message', onEvent);
  source.addEventListener('end', onEvent);
  source.addEventListener('reset', onEvent);
  source.addEventListener('open', async () => {
    out.opens += 1;
    if (out.opens === 1) {
      const r = await fetch(`${base}/requests/${id}`);
      out.open_record = await r.json();
    }
  });
  source.addEventListener('error', (event) => {
    out.errors.push({
      ready_state: source.readyState,
      code: event.code ?? null,
      message: event.message ?? null,
      at_ms: at(),
    });
    if (source.readyState === EventSource.CLOSED) {
      resolve();
    }
  });
  limit = setTimeout(() => {
    out.timed_out = true;
    resolve();
  }, LIMIT_MS);
});

await settled;
clearTimeout(limit);
// A browser that was told 204 must not come back: watch for any further request.
await new Promise((r) => setTimeout(r, QUIET_MS));
out.ready_state = source.readyState;
source.close();
console.log(JSON.stringify(out));
