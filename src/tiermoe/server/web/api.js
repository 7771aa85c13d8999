// Requests to this server: the API key (kept in sessionStorage, for this tab only) goes with every one,
// and a 401 asks for the key again. Server-sent events are read from fetch() bodies, because
// EventSource cannot send an Authorization header.

const KEY_NAME = 'tiermoe.apiKey';
let keyWaiters = [];

export function apiKey() {
  return sessionStorage.getItem(KEY_NAME) || '';
}

export function setApiKey(key) {
  sessionStorage.setItem(KEY_NAME, key);
  const waiting = keyWaiters;
  keyWaiters = [];
  waiting.forEach((resolve) => resolve());
}

/** Resolves once a (new) key was entered; the page shows the key dialog meanwhile. */
export function keyNeeded(refused) {
  document.dispatchEvent(new CustomEvent('tiermoe:key-needed', { detail: { refused } }));
  return new Promise((resolve) => keyWaiters.push(resolve));
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

/** fetch() with the key; waits for a key and retries when the server answers 401. */
export async function apiFetch(path, options = {}) {
  for (;;) {
    const headers = new Headers(options.headers || {});
    const key = apiKey();
    if (key) headers.set('Authorization', `Bearer ${key}`);
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    await keyNeeded(Boolean(key));
  }
}

/** The OpenAI error message of a failed response, or its status line. */
export async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

/** Calls onEvent(eventName, dataText) for each server-sent event of a fetch() response body. */
export async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, '');
      let event = 'message';
      const data = [];
      for (const line of block.split(/\r?\n/)) {
        if (line.startsWith('event:')) event = line.slice(6).trim();
        else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
      }
      if (data.length) onEvent(event, data.join('\n'));
    }
  }
}
