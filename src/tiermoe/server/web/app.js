// Entry point: tabs, the API-key dialog, then the chat view and the live dashboard.
import { setApiKey } from './api.js';
import { initChat, loadModels } from './chat.js';
import { resizeDashboard, runDashboard } from './dashboard.js';

const $ = (id) => document.getElementById(id);

function showView(name) {
  for (const tab of document.querySelectorAll('.tab')) tab.classList.toggle('active', tab.dataset.view === name);
  for (const view of document.querySelectorAll('.view')) view.hidden = view.id !== name;
  if (name === 'dashboard') resizeDashboard();
}

function setStatus(state, detail) {
  const conn = $('conn');
  conn.className = `conn ${state === 'live' ? 'live' : state === 'down' ? 'down' : ''}`;
  conn.textContent = state === 'live' ? 'live' : state === 'down' ? 'offline' : 'reconnecting…';
  conn.title = detail || 'live stats stream';
}

function initKeyDialog() {
  const dialog = $('key-dialog');
  document.addEventListener('tiermoe:key-needed', (event) => {
    $('key-error').hidden = !event.detail.refused;
    if (!dialog.open) dialog.showModal();
    $('key-input').focus();
  });
  $('key-form').addEventListener('submit', (event) => {
    event.preventDefault();
    const key = $('key-input').value.trim();
    if (!key) return;
    dialog.close();
    setApiKey(key);
  });
  dialog.addEventListener('cancel', (event) => event.preventDefault()); // nothing works without the key
}

async function main() {
  for (const tab of document.querySelectorAll('.tab')) tab.addEventListener('click', () => showView(tab.dataset.view));
  initKeyDialog();
  initChat();
  try {
    await loadModels(); // asks for the key first when the server wants one
  } catch (err) {
    setStatus('down', err.message);
  }
  runDashboard(setStatus);
}

main();
