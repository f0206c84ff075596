// holdfast web page (docs/ui.md). Plain JavaScript, no library, no build step.
//
// The page reads the HTTP API (docs/api.md) with the key its user typed, kept in this tab's
// sessionStorage and sent as `Authorization: Bearer KEY`; an EventSource cannot send headers,
// so the live view passes it as `?key=` on the event stream, the one place the API accepts it.
//
// Everything read from the log -- prompts, answers, errors, models, headers -- is untrusted text.
// It reaches the page only as text nodes (`h()` below, `textContent`, `createTextNode`): this
// file never sets innerHTML or outerHTML, never calls insertAdjacentHTML or document.write, and
// builds links only from request ids. The Content-Security-Policy (no inline script or style,
// this origin only) is the second line of defence.
'use strict';

const KEY_STORAGE = 'holdfast.key';
const POLL_MS = 2000;
const PAGE_SIZE = 50;
const MAX_EVENT_LINES = 300;

const $ = (id) => document.getElementById(id);

/** An element with text children: strings become text nodes, never markup. */
function h(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === 'class') node.className = value;
    else if (name === 'href') node.setAttribute('href', value);
    else if (name === 'title' || name === 'colspan' || name.startsWith('data-')) {
      node.setAttribute(name, String(value));
    } else if (name.startsWith('on')) node.addEventListener(name.slice(2), value);
    else throw new Error(`h(): unknown property ${name}`);
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const detailHref = (id) => `#/r/${encodeURIComponent(id)}`;

// ---------------------------------------------------------------------------------------------
// The API
// ---------------------------------------------------------------------------------------------

const session = { key: sessionStorage.getItem(KEY_STORAGE) || '' };

class Unauthorized extends Error {}

/** An answer to a read sent with a key that has since been forgotten or replaced: dropped. */
class Stale extends Error {}

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, method = 'GET') {
  const key = session.key;
  const headers = { accept: 'application/json' };
  if (key) headers.authorization = `Bearer ${key}`;
  const response = await fetch(path, { method, headers, cache: 'no-store', credentials: 'omit' });
  if (session.key !== key) throw new Stale('the key changed');
  if (response.status === 401) throw new Unauthorized('the key was refused');
  const text = await response.text();
  if (session.key !== key) throw new Stale('the key changed');
  let body = null;
  try {
    body = JSON.parse(text);
  } catch {
    body = null;
  }
  if (!response.ok) {
    const message = body && body.error && body.error.message;
    throw new ApiError(response.status, message || `${response.status} ${response.statusText}`);
  }
  return body;
}

// ---------------------------------------------------------------------------------------------
// Formatting
// ---------------------------------------------------------------------------------------------

const dash = '\u2014';

function fmtTime(iso) {
  if (!iso) return dash;
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? iso : d.toLocaleString(undefined, { dateStyle: 'short', timeStyle: 'medium' });
}

function fmtDuration(fromIso, toIso) {
  if (!fromIso || !toIso) return dash;
  const ms = new Date(toIso) - new Date(fromIso);
  if (!Number.isFinite(ms)) return dash;
  return ms < 1000 ? `${ms} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function fmtUsd(value) {
  if (value === null || value === undefined) return dash;
  return `$${value.toLocaleString('en-US', { maximumSignificantDigits: 6 })}`;
}

const fmtCount = (value) => (value === null || value === undefined ? dash : String(value));

/** Input and output tokens added up; null when the provider reported neither. */
function tokenSum(usage) {
  if (!usage) return null;
  const { input_tokens: i, output_tokens: o } = usage;
  return i === null && o === null ? null : (i || 0) + (o || 0);
}

function fmtInOut(usage) {
  if (!usage) return dash;
  return `${fmtCount(usage.input_tokens)} / ${fmtCount(usage.output_tokens)}`;
}

function statusBadge(status) {
  return h('span', { class: `status status-${status}`, 'data-status': status }, status);
}

/** A definition list of [term, value] pairs; a value may be a Node. */
function defs(pairs) {
  return h('dl', null, pairs.flatMap(([term, value]) => [h('dt', null, term), h('dd', null, value)]));
}

/**
 * An identifier shown in a card (a model, an id, a URL), or free text that may hold one (an
 * error message): a long token in it may break at any character, and only there, where it
 * would run out of its card (`.token` in app.css). A text node, never markup.
 */
function token(value) {
  return value === null || value === undefined ? dash : h('span', { class: 'token' }, value);
}

function card(title, pairs, wide) {
  return h('div', { class: wide ? 'card wide' : 'card', 'data-card': title }, h('h3', null, title), defs(pairs));
}

// ---------------------------------------------------------------------------------------------
// Views
// ---------------------------------------------------------------------------------------------

const view = { name: 'list', id: null, record: null, cursors: [], nextCursor: null, replaysOf: null };
let polling = false;

function show(name) {
  for (const id of ['login', 'list', 'detail']) $(id).hidden = id !== name;
  $('totals').hidden = name === 'login';
  $('forget').hidden = name === 'login' || !session.key;
}

function banner(message) {
  $('banner').hidden = !message;
  $('banner').textContent = message || '';
}

/** Forgets everything read with the previous key and shows the key prompt. */
function needKey(message) {
  stopLive();
  $('rows').replaceChildren();
  $('totals-list').replaceChildren();
  $('cards').replaceChildren();
  $('detail-title').textContent = '';
  clearBodies();
  view.record = null;
  banner('');
  $('login-error').hidden = !message;
  $('login-error').textContent = message || '';
  show('login');
  $('key').focus();
}

/** Reads what the current view shows; a read that finishes after the view changed is dropped. */
async function refresh() {
  try {
    await refreshTotals();
    if (view.name === 'detail') await refreshDetail();
    else await Promise.all([refreshList(), refreshCharts()]);
    banner('');
    show(view.name);
  } catch (e) {
    if (e instanceof Stale) return;
    if (e instanceof Unauthorized) {
      const refused = session.key !== '';
      if (refused) forgetKey();
      needKey(refused ? 'That key was refused.' : '');
    } else {
      banner(`holdfast did not answer: ${e.message}`);
    }
  }
}

function route() {
  const match = /^#\/r\/([^/?#]+)$/.exec(location.hash);
  stopLive();
  clearBodies();
  if (match) {
    view.replaysOf = null;
    $('replays').hidden = true;
    view.name = 'detail';
    view.id = decodeURIComponent(match[1]);
    view.record = null;
    $('cards').replaceChildren();
    $('detail-title').textContent = `Request ${view.id}`;
  } else {
    view.name = 'list';
  }
  return refresh();
}

// --- totals ----------------------------------------------------------------------------------

async function refreshTotals() {
  const usage = await api('/usage');
  const t = usage.totals;
  const items = [
    ['requests', 'requests', fmtCount(t.requests), t.requests],
    ['upstream_calls', 'upstream calls', fmtCount(t.upstream_calls), t.upstream_calls],
    ['saved_calls', 'calls saved', fmtCount(t.saved_calls), t.saved_calls],
    ['saved_tokens', 'tokens saved', fmtCount(tokenSum(t.saved_tokens) ?? 0), tokenSum(t.saved_tokens) ?? 0],
    ['cost_usd', 'cost', fmtUsd(t.cost_usd), t.cost_usd],
    ['saved_cost_usd', 'cost saved', fmtUsd(t.saved_cost_usd), t.saved_cost_usd],
  ];
  $('totals-list').replaceChildren(
    ...items.map(([name, label, text, value]) =>
      h('div', { 'data-total': name, 'data-value': JSON.stringify(value) }, h('dt', null, label), h('dd', null, text)),
    ),
  );
}

// --- charts: GET /usage?bucket= (EX-10) ------------------------------------------------------
// Inline SVG built with DOM calls: every colour and size is an attribute (the CSP allows no
// inline style), every label a text node.

const SVG_NS = 'http://www.w3.org/2000/svg';
const PALETTE = ['#1f5fbf', '#1b7f3b', '#b25e09', '#8e3fb5', '#b42318', '#0f7b8a', '#6b7280', '#c2410c'];
const CHARTS = [
  // Upstream calls, as the header names them: the provider calls paid for, beside those saved.
  ['calls', 'upstream calls', (l) => l.upstream_calls, fmtCount],
  ['saved', 'saved calls', (l) => l.saved_calls, fmtCount],
  ['tokens', 'tokens in + out', (l) => tokenSum(l.usage) ?? 0, fmtCount],
  ['cost', 'cost', (l) => l.cost_usd ?? 0, fmtUsd],
];

/** An SVG element: attributes set as attributes, children as text nodes. */
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function swatch(colour) {
  return svg('svg', { viewBox: '0 0 10 10', 'aria-hidden': 'true' }, svg('rect', { width: 10, height: 10, fill: colour }));
}

function bucketLabel(t, bucket) {
  const d = new Date(t);
  return bucket === 'hour'
    ? d.toLocaleString(undefined, { month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit' })
    : d.toLocaleDateString(undefined, { month: 'short', day: 'numeric' });
}

async function refreshCharts() {
  const days = Number($('c-window').value);
  const bucket = $('c-bucket').value;
  const by = $('c-by').value;
  const step = bucket === 'hour' ? 3600e3 : 86400e3;
  const now = Date.now();
  const first = Math.floor((now - days * 86400e3) / step) * step;
  const query = new URLSearchParams({ bucket, group_by: by, since: new Date(first).toISOString() });
  const usage = await api(`/usage?${query}`);
  if (view.name !== 'list') return;
  const starts = [];
  for (let t = first; t <= now; t += step) starts.push(t);
  const byStart = new Map(usage.buckets.map((b) => [Date.parse(b.start), b.groups]));
  const keys = [...new Set(usage.buckets.flatMap((b) => b.groups.map((g) => g.key)))].sort();
  const colour = (key) => PALETTE[keys.indexOf(key) % PALETTE.length];
  const ctx = { starts, byStart, colour, bucket };
  $('chart-grid').replaceChildren(...CHARTS.map(([name, title, value, fmt]) => chart(ctx, name, title, value, fmt)));
  $('chart-legend').replaceChildren(
    ...keys.map((key) => h('li', { 'data-key': key }, swatch(colour(key)), key || `(no ${by})`)),
  );
  $('charts').setAttribute('data-buckets', String(usage.buckets.length));
}

/** One stacked bar chart: a bar per bucket, a segment per group. */
function chart({ starts, byStart, colour, bucket }, name, title, value, fmt) {
  const [W, H, top] = [300, 100, 4];
  const totals = starts.map((t) => (byStart.get(t) || []).reduce((sum, g) => sum + value(g), 0));
  const max = Math.max(0, ...totals);
  const total = totals.reduce((a, b) => a + b, 0);
  const bar = W / starts.length;
  const plot = svg('svg', {
    viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: 'none', role: 'img', 'aria-label': `${title} per ${bucket}`,
  });
  plot.append(svg('line', { x1: 0, x2: W, y1: H - 0.5, y2: H - 0.5, stroke: '#d9dee7', 'stroke-width': 1 }));
  starts.forEach((t, i) => {
    let y = H;
    for (const g of byStart.get(t) || []) {
      const v = value(g);
      if (!v || !max) continue;
      const height = (v / max) * (H - top);
      y -= height;
      plot.append(
        svg(
          'rect',
          {
            x: i * bar + bar * 0.1, y, width: Math.max(bar * 0.8, 0.5), height, fill: colour(g.key),
            'data-key': g.key, 'data-value': v, 'data-start': new Date(t).toISOString(),
          },
          svg('title', null, `${g.key || dash} ${bucketLabel(t, bucket)}: ${fmt(v)}`),
        ),
      );
    }
  });
  const rows = starts
    .map((t, i) => [t, totals[i]])
    .filter(([, v]) => v)
    .map(([t, v]) => h('tr', null, h('td', null, bucketLabel(t, bucket)), h('td', { class: 'num' }, fmt(v))));
  return h(
    'div',
    { class: 'chart', 'data-chart': name, 'data-total': JSON.stringify(total), 'data-bars': String(plot.querySelectorAll('rect').length) },
    h('h3', null, `${title} `, h('span', { class: 'total' }, fmt(total))),
    plot,
    h('div', { class: 'muted total' }, `${bucketLabel(starts[0], bucket)} \u2013 ${bucketLabel(starts[starts.length - 1], bucket)}`),
    h('details', null, h('summary', null, 'numbers'), h('table', null, h('tbody', null, rows))),
  );
}

// --- the list --------------------------------------------------------------------------------

function listQuery() {
  const form = $('filters').elements;
  const query = new URLSearchParams();
  for (const name of ['status', 'route', 'model', 'backend', 'callback', 'q']) {
    const value = form[name].value.trim();
    if (value) query.set(name, value);
  }
  for (const name of ['since', 'until']) {
    const value = form[name].value;
    if (!value) continue;
    const time = new Date(value);
    if (!Number.isNaN(time.getTime())) query.set(name, time.toISOString());
  }
  if (form.replayed.checked) query.set('replayed', 'true');
  const cursor = view.cursors[view.cursors.length - 1];
  if (cursor) query.set('cursor', cursor);
  query.set('limit', String(PAGE_SIZE));
  return query;
}

async function refreshList() {
  const query = listQuery().toString();
  const page = await api(`/requests?${query}`);
  if (view.name !== 'list' || listQuery().toString() !== query) return;
  view.nextCursor = page.next_cursor;
  $('rows').replaceChildren(...page.data.map(row));
  const n = page.data.length;
  $('list-status').textContent = n === 0 ? 'No requests match.' : `${n} request${n === 1 ? '' : 's'}${view.nextCursor ? ' on this page' : ''}`;
  $('older').hidden = !view.nextCursor;
  $('newest').hidden = view.cursors.length === 0;
}

function row(r) {
  const open = () => {
    location.hash = detailHref(r.id);
  };
  return h(
    'tr',
    { 'data-id': r.id, 'data-status': r.status, onclick: open },
    h('td', null, fmtTime(r.created_at)),
    h('td', { class: 'status-cell' }, statusBadge(r.status), r.error ? h('span', { class: 'error-type' }, r.error.type) : null),
    h('td', null, r.route),
    h('td', null, r.model ?? dash),
    h('td', null, r.backend),
    h('td', { class: 'num' }, r.recoveries ? `${r.attempts} (${r.recoveries} recovered)` : String(r.attempts)),
    h('td', { class: 'num' }, fmtInOut(r.usage)),
    h('td', { class: 'num' }, fmtUsd(r.cost_usd)),
    h('td', { class: 'num' }, String(r.deliveries.total)),
    h('td', { class: 'id' }, h('a', { href: detailHref(r.id), title: r.id }, `${r.id.slice(0, 8)}\u2026${r.id.slice(-8)}`)),
  );
}

// --- the detail ------------------------------------------------------------------------------

async function refreshDetail() {
  const id = view.id;
  let record;
  try {
    record = await api(`/requests/${encodeURIComponent(id)}`);
  } catch (e) {
    if (view.name !== 'detail' || view.id !== id) return;
    if (e instanceof ApiError && e.status === 404) {
      view.record = null;
      $('detail-body').hidden = true;
      $('detail-error').hidden = false;
      $('detail-error').textContent = `No request ${view.id} is visible with this key.`;
      return;
    }
    throw e;
  }
  if (view.name === 'detail' && view.id === id) renderDetail(record);
}

function renderDetail(r) {
  view.record = r;
  $('detail-error').hidden = true;
  $('detail-body').hidden = false;
  $('detail-title').replaceChildren(`Request ${r.id} `, statusBadge(r.status));
  const running = r.status === 'pending' || r.status === 'running';
  $('cancel').hidden = !running;
  $('watch').hidden = !r.stream || live.id === r.id;

  const cards = [
    card('Request', [
      ['status', statusBadge(r.status)],
      ['route', r.route],
      ['model', token(r.model)],
      ['backend', r.backend],
      ['stream', r.stream ? 'yes' : 'no'],
      ['attempts', String(r.attempts)],
      ['recoveries', String(r.recoveries)],
      ['next retry', r.next_retry_at ? fmtTime(r.next_retry_at) : dash],
      // The stored answer's status, else the one the failure came with (a stream that broke
      // after its 200), as the Error card shows it.
      ['provider status', r.response ? String(r.response.status) : r.error?.status ? String(r.error.status) : dash],
      ['provider request id', token(r.upstream_request_id)],
      ['stored events', String(r.last_seq)],
      ...(r.replay_of ? [['replay of', h('a', { href: detailHref(r.replay_of), class: 'token' }, r.replay_of)]] : []),
    ]),
    card('Timings', [
      ['submitted', fmtTime(r.created_at)],
      ['updated', fmtTime(r.updated_at)],
      ['finished', fmtTime(r.finished_at)],
      ['took', fmtDuration(r.created_at, r.finished_at)],
    ]),
    card('Usage and cost', [
      ['input tokens', fmtCount(r.usage.input_tokens)],
      ['output tokens', fmtCount(r.usage.output_tokens)],
      ['cached input', fmtCount(r.usage.cached_input_tokens)],
      ['cache writes', fmtCount(r.usage.cache_write_tokens)],
      ['1-hour cache writes', fmtCount(r.usage.cache_write_1h_tokens)],
      ['reasoning', fmtCount(r.usage.reasoning_tokens)],
      ['cost', fmtUsd(r.cost_usd)],
      ...(r.usage_by_attempt || []).map((a) => [`attempt ${a.attempt}`, `${fmtInOut(a)} tokens`]),
    ]),
    card('Deliveries and savings', [
      ['deliveries', String(r.deliveries.total)],
      ['attached', String(r.deliveries.attached)],
      ['replayed', String(r.deliveries.replayed)],
      ['log readers', String(r.deliveries.log_reads)],
      ['calls saved', String(r.saved_calls)],
      ['tokens saved', fmtInOut(r.saved_tokens)],
      ['cost saved', fmtUsd(r.saved_cost_usd)],
    ]),
  ];
  if (r.callback) {
    // Every value is text (the URL and the receiver's answer are the caller's and a stranger's).
    // The last error is free text that may hold a long URL: a token, so it breaks inside its
    // card rather than widening it.
    cards.push(
      card(
        'Callback',
        [
          ['state', r.callback.state],
          ['url', token(r.callback.url)],
          ['tries', String(r.callback.attempts)],
          ['last status', r.callback.last_status == null ? dash : String(r.callback.last_status)],
          ['last error', token(r.callback.last_error)],
          ['next try', r.callback.next_try_at ? fmtTime(r.callback.next_try_at) : dash],
          ['delivered', r.callback.delivered_at ? fmtTime(r.callback.delivered_at) : dash],
        ],
        true,
      ),
    );
  }
  if (r.error) {
    // The message is free text (the provider's own may quote a long URL): a token, as above.
    cards.unshift(
      card(
        'Error',
        [
          ['type', r.error.type],
          ['message', token(r.error.message)],
          ...(r.error.status ? [['provider status', String(r.error.status)]] : []),
        ],
        true,
      ),
    );
  }
  $('cards').replaceChildren(...cards);
  if (view.replaysOf !== r.id) {
    view.replaysOf = r.id;
    refreshReplays(r).catch((e) => {
      if (!(e instanceof Stale)) banner(`could not read the replays: ${e.message}`);
    });
  }
}

/** The record's replays (EX-8) beside it: model, status, tokens, cost and answer of each. */
async function refreshReplays(r) {
  $('replays').hidden = true;
  const page = await api(`/requests?replay_of=${encodeURIComponent(r.id)}&limit=10`);
  if (!view.record || view.record.id !== r.id || page.data.length === 0) return;
  const all = [r, ...page.data.slice().reverse()];
  const full = await Promise.all(all.map((x) => api(`/requests/${encodeURIComponent(x.id)}?include=body`)));
  if (!view.record || view.record.id !== r.id) return;
  const line = (name, cell, cls) => h('tr', null, h('th', null, name), ...full.map((x) => h('td', { class: cls }, cell(x))));
  $('replay-table').tBodies[0].replaceChildren(
    line('', (x) => (x.id === r.id ? 'this request' : h('a', { href: detailHref(x.id), 'data-replay': x.id }, `replay ${x.id.slice(-8)}`))),
    line('model', (x) => x.model ?? dash),
    line('backend', (x) => x.backend),
    line('status', (x) => statusBadge(x.status)),
    line('tokens in / out', (x) => fmtInOut(x.usage)),
    line('cost', (x) => fmtUsd(x.cost_usd)),
    line('answer', (x) => x.answer_text ?? dash, 'answer'),
  );
  $('replays').setAttribute('data-replays', String(page.data.length));
  $('replays').hidden = false;
}

async function cancelRequest() {
  if (!view.record) return;
  $('cancel').disabled = true;
  try {
    renderDetail(await api(`/requests/${encodeURIComponent(view.record.id)}/cancel`, 'POST'));
  } catch (e) {
    if (e instanceof Stale) return;
    if (e instanceof Unauthorized) needKey('That key was refused.');
    else banner(`cancel failed: ${e.message}`);
  } finally {
    $('cancel').disabled = false;
  }
}

// --- the prompt and the answer, on demand ------------------------------------------------------

function clearBodies() {
  $('bodies').hidden = true;
  for (const id of ['prompt', 'answer', 'request-json', 'answer-json']) $(id).replaceChildren();
  $('sent-headers').tBodies[0].replaceChildren();
  $('show-body').textContent = 'Show prompt and answer';
}

async function toggleBodies() {
  if (!$('bodies').hidden) {
    clearBodies();
    return;
  }
  if (!view.record) return;
  let full;
  try {
    full = await api(`/requests/${encodeURIComponent(view.record.id)}?include=body`);
  } catch (e) {
    if (e instanceof Stale) return;
    if (e instanceof Unauthorized) needKey('That key was refused.');
    else banner(`could not read the bodies: ${e.message}`);
    return;
  }
  const body = full.request && full.request.body;
  $('prompt').textContent = readable(() => promptText(full.route, body)) || '(no text found in the request body)';
  // The server's text of the answer (its tool calls included, decision 96); this page's own
  // reading for a route without text (embeddings).
  const said = typeof full.answer_text === 'string' ? full.answer_text : readable(() => answerText(full.route, full.answer, full.stream));
  $('answer').textContent = said || '(no answer text stored)';
  $('request-json').textContent = JSON.stringify(body, null, 2);
  $('answer-json').textContent = JSON.stringify(full.answer, null, 2);
  const headers = (full.request && full.request.headers) || [];
  $('sent-headers').tBodies[0].replaceChildren(
    ...(headers.length ? headers.map(([n, v]) => h('tr', null, h('th', null, n), h('td', null, v))) : [h('tr', null, h('td', null, 'none'))]),
  );
  $('bodies').hidden = false;
  $('show-body').textContent = 'Hide prompt and answer';
}

/**
 * `read()`, or '' when a stored body is not the shape it reads: a client's body is stored as it
 * came, and one holding a `null` message or a `role` that cannot be made text (`{"toString": 1}`)
 * would otherwise throw here and leave the bodies, JSON included, unshown.
 */
function readable(read) {
  try {
    return read();
  } catch {
    return '';
  }
}

/** The text parts of a message `content` (a string, or an array of typed parts). */
function contentText(content) {
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) return '';
  return content
    .map((part) => (typeof part === 'string' ? part : part && (part.text ?? part.input_text ?? '')))
    .filter((t) => typeof t === 'string' && t)
    .join('\n');
}

function promptText(route, body) {
  if (!body || typeof body !== 'object') return typeof body === 'string' ? body : '';
  const lines = [];
  if (body.system) lines.push(`system: ${contentText(body.system)}`);
  if (body.instructions) lines.push(`instructions: ${body.instructions}`);
  if (Array.isArray(body.messages)) {
    for (const m of body.messages) lines.push(`${m.role ?? '?'}: ${contentText(m.content)}`);
  }
  if (body.prompt !== undefined) lines.push(contentText(Array.isArray(body.prompt) ? body.prompt : String(body.prompt)));
  if (body.input !== undefined) {
    if (typeof body.input === 'string') lines.push(body.input);
    else if (Array.isArray(body.input)) {
      for (const item of body.input) {
        if (typeof item === 'string') lines.push(item);
        else if (item && item.content !== undefined) lines.push(`${item.role ?? '?'}: ${contentText(item.content)}`);
      }
    }
  }
  if (route && route.startsWith('gemini.')) {
    // Google's members, under their JSON or their proto field names (decision 84).
    const system = body.systemInstruction ?? body.system_instruction;
    if (system) lines.push(`system: ${geminiPartsText(system.parts)}`);
    const contents = Array.isArray(body.contents) ? body.contents : body.contents ? [body.contents] : [];
    for (const c of contents) {
      if (typeof c === 'string') lines.push(`user: ${c}`);
      else if (c && typeof c === 'object') lines.push(`${typeof c.role === 'string' ? c.role : 'user'}: ${geminiPartsText(c.parts)}`);
    }
  }
  return lines.join('\n');
}

/** The text of Gemini `parts`, thoughts left out (what the SDKs' `.text` gives). */
function geminiPartsText(parts) {
  if (!Array.isArray(parts)) return '';
  return parts
    .filter((p) => p && p.thought !== true && typeof p.text === 'string')
    .map((p) => p.text)
    .join('');
}

function answerText(route, answer, stream) {
  if (answer === null || answer === undefined) return '';
  if (stream) return answer.text ?? '';
  if (typeof answer !== 'object') return String(answer);
  if (Array.isArray(answer.choices)) {
    return answer.choices.map((c) => (c.message ? contentText(c.message.content) : c.text ?? '')).join('\n');
  }
  if (Array.isArray(answer.content)) return contentText(answer.content);
  if (typeof answer.output_text === 'string') return answer.output_text;
  if (Array.isArray(answer.output)) {
    return answer.output.map((item) => contentText(item.content ?? [])).filter(Boolean).join('\n');
  }
  if (Array.isArray(answer.data)) return `(${answer.data.length} embedding${answer.data.length === 1 ? '' : 's'})`;
  if (Array.isArray(answer.candidates)) {
    const candidate = answer.candidates[0];
    return geminiPartsText(candidate && candidate.content && candidate.content.parts);
  }
  return '';
}

// ---------------------------------------------------------------------------------------------
// The live view: GET /requests/{id} as an event stream (docs/api.md, RD-2..RD-6)
// ---------------------------------------------------------------------------------------------

// An EventSource delivers named events only to listeners of that name: the providers' names.
const EVENT_NAMES = [
  'message_start', 'content_block_start', 'content_block_delta', 'content_block_stop',
  'message_delta', 'message_stop', 'ping',
  'response.created', 'response.in_progress', 'response.output_item.added',
  'response.output_item.done', 'response.content_part.added', 'response.content_part.done',
  'response.output_text.delta', 'response.output_text.done', 'response.completed',
  'response.incomplete', 'response.failed', 'response.refusal.delta', 'response.refusal.done',
  'response.function_call_arguments.delta', 'response.function_call_arguments.done',
  'response.custom_tool_call_input.delta', 'response.custom_tool_call_input.done',
];

const live = {
  id: null, route: null, source: null, last: null, events: 0, opens: 0, ended: false, timer: null,
  // The tool calls the stream has made so far, by the provider's index: `{name, args}`, shown
  // after the text as the server's `answer_text` shows them (decision 96).
  calls: new Map(),
};

/**
 * What an event adds to the tool calls, `[key, name, args]` for each call it starts or
 * continues (a name or arguments it does not carry are ''), by the provider's rules: chat's
 * `delta.tool_calls`, a Messages `tool_use` block and its `input_json_delta`s, a Responses
 * `function_call` item and its argument deltas, a Gemini `functionCall` part (whole).
 */
function eventCalls(route, name, data) {
  if (!data || typeof data !== 'object') return [];
  const kind = name === 'message' ? data.type : name;
  const str = (v) => (typeof v === 'string' ? v : '');
  if (route === 'anthropic.messages') {
    const block = data.content_block;
    if (kind === 'content_block_start' && block && (block.type === 'tool_use' || block.type === 'server_tool_use')) {
      return [[data.index, str(block.name), '']];
    }
    const delta = data.delta;
    if (kind === 'content_block_delta' && delta && delta.type === 'input_json_delta') return [[data.index, '', str(delta.partial_json)]];
    return [];
  }
  if (route === 'openai.responses') {
    const item = data.item;
    if (kind === 'response.output_item.added' && item && (item.type === 'function_call' || item.type === 'custom_tool_call')) {
      return [[data.output_index, str(item.name), str(item.arguments ?? item.input)]];
    }
    if (kind === 'response.function_call_arguments.delta' || kind === 'response.custom_tool_call_input.delta') {
      return [[data.output_index, '', str(data.delta)]];
    }
    return [];
  }
  if (route.startsWith('gemini.')) {
    const candidate = Array.isArray(data.candidates) ? data.candidates[0] : null;
    const parts = candidate && candidate.content && Array.isArray(candidate.content.parts) ? candidate.content.parts : [];
    // Each part is a whole call: a key of its own, after the calls before it.
    return parts
      .filter((p) => p && p.functionCall && typeof p.functionCall === 'object')
      .map((p, i) => [`${live.events}.${i}`, str(p.functionCall.name), JSON.stringify(p.functionCall.args ?? {})]);
  }
  const choice = Array.isArray(data.choices) ? data.choices[0] : null;
  const calls = choice && choice.delta && Array.isArray(choice.delta.tool_calls) ? choice.delta.tool_calls : [];
  return calls
    .filter((c) => c && typeof c === 'object')
    .map((c) => {
      const fn = c.function || c.custom || {};
      return [c.index ?? 0, str(fn.name), str(fn.arguments ?? fn.input)];
    });
}

/** The tool calls so far as text, one `[tool call] NAME(ARGUMENTS)` line each. */
function callsText(text) {
  const lines = [...live.calls.values()].map((c) => `[tool call] ${c.name || '?'}(${c.args})`);
  if (!lines.length) return '';
  return (text ? '\n' : '') + lines.join('\n');
}

/** The live text: the answer's text, then its tool calls, as text nodes only. */
function liveText(piece, calls) {
  const box = $('live-text');
  if (box.childNodes.length !== 2) box.replaceChildren(document.createTextNode(''), document.createTextNode(''));
  const [said, called] = box.childNodes;
  if (piece) said.appendData(piece);
  for (const [key, name, args] of calls) {
    const call = live.calls.get(key) || { name: '', args: '' };
    call.name ||= name;
    call.args += args;
    live.calls.set(key, call);
  }
  if (piece || calls.length) called.data = callsText(said.data);
}

/** The text an event adds to the answer (the same rules as the server's `?include=body`). */
function eventText(route, name, data) {
  if (!data || typeof data !== 'object') return '';
  const kind = name === 'message' ? data.type : name;
  if (route === 'anthropic.messages') {
    return data.type === 'content_block_delta' && data.delta && data.delta.type === 'text_delta' ? data.delta.text ?? '' : '';
  }
  if (route === 'openai.responses') return kind === 'response.output_text.delta' ? data.delta ?? '' : '';
  if (route.startsWith('gemini.')) {
    const candidate = Array.isArray(data.candidates) ? data.candidates[0] : null;
    const parts = candidate && candidate.content && Array.isArray(candidate.content.parts) ? candidate.content.parts : [];
    return parts.filter((p) => p.thought !== true).map((p) => p.text ?? '').join('');
  }
  const choice = Array.isArray(data.choices) ? data.choices[0] : null;
  if (!choice) return '';
  if (route === 'openai.completions') return choice.text ?? '';
  return (choice.delta && choice.delta.content) ?? '';
}

function liveState(text) {
  $('live-state').textContent = text;
  $('live').setAttribute('data-state', text.split(/[ :(]/)[0]);
}

function liveCounts() {
  $('live-counts').textContent = `${live.events} events, last seq ${live.last ?? dash}, connections ${live.opens}`;
  $('live').setAttribute('data-events', String(live.events));
  $('live').setAttribute('data-opens', String(live.opens));
}

function liveNote(text) {
  $('live-notes').append(h('li', null, text));
}

function eventLine(seq, name, data) {
  const list = $('live-events');
  list.append(h('li', null, `${seq} ${name}: ${data}`));
  while (list.childElementCount > MAX_EVENT_LINES) list.firstElementChild.remove();
}

function startLive() {
  const r = view.record;
  if (!r) return;
  stopLive();
  Object.assign(live, { id: r.id, route: r.route, last: null, events: 0, opens: 0, ended: false, calls: new Map() });
  $('live-text').replaceChildren();
  $('live-events').replaceChildren();
  $('live-notes').replaceChildren();
  $('live').hidden = false;
  $('watch').hidden = true;
  liveCounts();
  connectLive();
}

function connectLive() {
  live.timer = null;
  const query = new URLSearchParams();
  if (session.key) query.set('key', session.key);
  // The browser resumes with Last-Event-ID by itself; a new EventSource starts from here.
  if (live.last !== null) query.set('last_event_id', String(live.last));
  const qs = query.toString();
  const source = new EventSource(`/requests/${encodeURIComponent(live.id)}${qs ? `?${qs}` : ''}`);
  live.source = source;
  liveState(live.opens === 0 ? 'connecting' : 'reconnecting');
  source.onopen = () => {
    live.opens += 1;
    liveState(live.opens === 1 ? 'connected' : `reconnected (resumed after seq ${live.last ?? 0})`);
    liveCounts();
  };
  source.onmessage = onChunk;
  for (const name of EVENT_NAMES) source.addEventListener(name, onChunk);
  // A provider's `error` event shares its name with the EventSource's own connection errors.
  source.addEventListener('error', (event) => {
    if (event instanceof MessageEvent) onChunk(event);
  });
  source.addEventListener('reset', onReset);
  source.addEventListener('end', onEnd);
  source.onerror = (event) => {
    if (event instanceof MessageEvent || live.ended || live.source !== source) return;
    if (source.readyState === EventSource.CLOSED) {
      // The browser gave up (an error status, a 204, the server gone): decide ourselves.
      source.close();
      liveState('disconnected');
      afterClose(source);
    } else {
      liveState('reconnecting');
    }
  };
}

async function afterClose(source) {
  try {
    const r = await api(`/requests/${encodeURIComponent(live.id)}`);
    if (live.source !== source) return;
    const terminal = r.status === 'succeeded' || r.status === 'failed';
    if (terminal && live.last !== null && live.last >= r.last_seq) {
      finishLive(r.status);
      return;
    }
  } catch (e) {
    if (live.source !== source || e instanceof Stale) return;
    if (e instanceof Unauthorized) {
      needKey('That key was refused.');
      return;
    }
    if (e instanceof ApiError && e.status === 404) {
      liveState('gone (no such request for this key)');
      live.ended = true;
      return;
    }
  }
  if (live.source === source) live.timer = setTimeout(connectLive, POLL_MS);
}

function seqOf(event) {
  const seq = Number.parseInt(event.lastEventId, 10);
  if (Number.isFinite(seq)) live.last = seq;
  return event.lastEventId;
}

function onChunk(event) {
  const seq = seqOf(event);
  live.events += 1;
  let data = null;
  try {
    data = JSON.parse(event.data);
  } catch {
    data = null;
  }
  liveText(eventText(live.route, event.type, data), eventCalls(live.route, event.type, data));
  eventLine(seq, event.type, event.data);
  liveCounts();
}

function onReset(event) {
  const seq = seqOf(event);
  $('live-text').replaceChildren();
  live.calls = new Map();
  liveNote(`attempt ${event.data} started over at seq ${seq}: the text so far belonged to an abandoned attempt`);
  eventLine(seq, 'reset', event.data);
  liveCounts();
}

function onEnd(event) {
  const seq = seqOf(event);
  eventLine(seq, 'end', event.data);
  let end = null;
  try {
    end = JSON.parse(event.data);
  } catch {
    end = null;
  }
  if (end && end.error) liveNote(`${end.error.type}: ${end.error.message}`);
  finishLive(end ? end.status : 'finished');
  refresh();
}

function finishLive(status) {
  live.ended = true;
  if (live.source) live.source.close();
  liveState(`ended: ${status}`);
  liveCounts();
}

function stopLive() {
  if (live.source) live.source.close();
  if (live.timer) clearTimeout(live.timer);
  Object.assign(live, { id: null, source: null, timer: null, ended: true });
  $('live').hidden = true;
}

// ---------------------------------------------------------------------------------------------
// Wiring
// ---------------------------------------------------------------------------------------------

function forgetKey() {
  session.key = '';
  sessionStorage.removeItem(KEY_STORAGE);
}

function applyFilters() {
  view.cursors = [];
  refresh();
}

function start() {
  $('login-form').addEventListener('submit', (e) => {
    e.preventDefault();
    const key = $('key').value.trim();
    $('key').value = '';
    if (!key) return;
    session.key = key;
    sessionStorage.setItem(KEY_STORAGE, key);
    refresh();
  });
  $('forget').addEventListener('click', () => {
    forgetKey();
    needKey('');
    refresh();
  });
  const filters = $('filters');
  filters.addEventListener('submit', (e) => {
    e.preventDefault();
    applyFilters();
  });
  filters.addEventListener('change', applyFilters);
  filters.addEventListener('reset', () => setTimeout(applyFilters, 0));
  $('older').addEventListener('click', () => {
    if (view.nextCursor) view.cursors.push(view.nextCursor);
    refresh();
  });
  $('newest').addEventListener('click', applyFilters);
  $('chart-form').addEventListener('change', () => refreshCharts().catch((e) => {
    if (!(e instanceof Stale)) banner(`could not read the usage: ${e.message}`);
  }));
  $('cancel').addEventListener('click', cancelRequest);
  $('watch').addEventListener('click', startLive);
  $('show-body').addEventListener('click', toggleBodies);
  window.addEventListener('hashchange', route);
  setInterval(async () => {
    if (polling || !$('login').hidden) return;
    if (view.name === 'list' && !$('f-live').checked) return;
    polling = true;
    try {
      const settled = view.record && (view.record.status === 'succeeded' || view.record.status === 'failed');
      if (view.name === 'detail' && settled) await refreshTotals().catch(() => {});
      else await refresh();
    } finally {
      polling = false;
    }
  }, POLL_MS);
  route();
}

start();
