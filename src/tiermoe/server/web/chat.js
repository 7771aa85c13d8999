// The chat view: streams from this server's own /v1/chat/completions (stream=true), reasoning shown
// folded, markdown and code rendered, Stop aborts the request (the server frees the sequence).
import { apiFetch, errorMessage, readEvents } from './api.js';
import { renderMarkdown } from './markdown.js';

const $ = (id) => document.getElementById(id);
let history = [];
let controller = null;

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function scrollDown() {
  const box = $('messages');
  box.scrollTop = box.scrollHeight;
}

function addUserMessage(text) {
  const msg = element('div', 'msg user');
  msg.append(element('div', 'role', 'you'), element('div', 'text', text));
  $('messages').append(msg);
  scrollDown();
}

/** An assistant bubble whose parts are filled as deltas arrive. */
function assistantBubble() {
  const msg = element('div', 'msg assistant');
  const details = element('details');
  const summary = element('summary', '', 'Reasoning');
  const reasoning = element('div', 'reasoning');
  details.append(summary, reasoning);
  details.hidden = true;
  const content = element('div', 'content');
  const meta = element('div', 'meta');
  msg.append(element('div', 'role', 'assistant'), details, content, meta);
  $('messages').append(msg);
  return { msg, details, summary, reasoning, content, meta };
}

export async function loadModels() {
  const response = await apiFetch('/v1/models');
  if (!response.ok) throw new Error(await errorMessage(response));
  const body = await response.json();
  const select = $('model');
  const current = select.value;
  select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
  if (current && body.data.some((m) => m.id === current)) select.value = current;
}

function requestBody() {
  const messages = [];
  const system = $('system').value.trim();
  if (system) messages.push({ role: 'system', content: system });
  messages.push(...history);
  const body = { model: $('model').value, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat($('temperature').value);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($('max-tokens').value, 10);
  if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

function setBusy(busy) {
  $('send').hidden = busy;
  $('stop').hidden = !busy;
  $('prompt').disabled = busy;
}

async function send(text) {
  history.push({ role: 'user', content: text });
  addUserMessage(text);
  const bubble = assistantBubble();
  const state = { content: '', reasoning: '', usage: null, finish: null, firstAt: null, pending: false, error: null };
  const started = performance.now();
  controller = new AbortController();
  setBusy(true);
  const redraw = (final) => {
    state.pending = false;
    if (state.reasoning) {
      bubble.details.hidden = false;
      bubble.reasoning.textContent = state.reasoning;
      bubble.summary.textContent = state.content || final ? 'Reasoning' : 'Reasoning…';
    }
    renderMarkdown(bubble.content, state.content, final);
    scrollDown();
  };
  const schedule = () => {
    if (!state.pending) {
      state.pending = true;
      requestAnimationFrame(() => redraw(false));
    }
  };
  try {
    const response = await apiFetch('/v1/chat/completions', {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (_event, data) => {
      if (data === '[DONE]') return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || 'stream error');
      if (chunk.usage) state.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if ((delta.content || delta.reasoning_content) && state.firstAt === null) state.firstAt = performance.now();
        if (delta.reasoning_content) state.reasoning += delta.reasoning_content;
        if (delta.content) state.content += delta.content;
        if (choice.finish_reason) state.finish = choice.finish_reason;
      }
      schedule();
    });
  } catch (err) {
    if (err.name === 'AbortError') state.finish = 'stopped';
    else state.error = err.message;
  } finally {
    controller = null;
    setBusy(false);
  }
  redraw(true);
  if (state.error) { // the failed turn leaves the history, so the next message starts clean
    history.pop();
    bubble.msg.classList.add('error');
    bubble.content.append(document.createElement('p'));
    bubble.content.lastChild.textContent = state.error;
  } else {
    history.push({ role: 'assistant', content: state.content });
  }
  bubble.meta.textContent = metaLine(state, started);
  $('prompt').focus();
}

function metaLine(state, started) {
  const parts = [];
  if (state.finish) parts.push(`finish: ${state.finish}`);
  if (state.firstAt !== null) parts.push(`first token ${((state.firstAt - started) / 1000).toFixed(2)} s`);
  if (state.usage) {
    const tokens = state.usage.completion_tokens;
    parts.push(`${state.usage.prompt_tokens} prompt + ${tokens} generated tokens`);
    const seconds = (performance.now() - (state.firstAt ?? started)) / 1000;
    if (tokens > 1 && seconds > 0) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tok/s`);
  }
  return parts.join(' · ');
}

export function initChat() {
  $('composer').addEventListener('submit', (event) => {
    event.preventDefault();
    const text = $('prompt').value.trim();
    if (!text || controller) return;
    $('prompt').value = '';
    send(text);
  });
  $('prompt').addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $('composer').requestSubmit();
    }
  });
  $('stop').addEventListener('click', () => controller && controller.abort());
  $('new-chat').addEventListener('click', () => {
    if (controller) controller.abort();
    history = [];
    $('messages').replaceChildren();
  });
}
