// The live dashboard: tiles and uPlot time series fed by /v1/stats/stream (one `stats` event a second,
// a `heat` event when the per-layer expert counts change), read with fetch so the API key goes along.
import uPlot from './vendor/uplot/uPlot.esm.js';
import { apiFetch, errorMessage, readEvents } from './api.js';
import { HeatMap } from './heatmap.js';

const $ = (id) => document.getElementById(id);
const WINDOW = 300; // points kept per chart (5 minutes at one a second)
const COLOURS = ['#5aa9ff', '#5fd38d', '#ff6b6b', '#ffb454', '#c792ea'];

const fmt = {
  num: (v, digits = 1) => (v === null || v === undefined ? '–' : Number(v).toFixed(digits)),
  ms: (v) => (v === null || v === undefined ? '–' : `${(v * 1000).toFixed(0)} ms`),
  pct: (v) => (v === null || v === undefined ? '–' : `${(v * 100).toFixed(0)} %`),
  // uPlot's default tick labels keep 3 decimals: a KV usage of 0.0004 would read 0 on every tick
  share: (v) => String(Number(v.toPrecision(2))),
  bytes: (v) => {
    if (v === null || v === undefined) return '–';
    const units = ['B', 'KB', 'MB', 'GB'];
    let i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
  },
};
const sum = (obj) => (obj ? Object.values(obj).reduce((a, b) => a + (b || 0), 0) : null);

// Tiles: label, value from a stats event, a sub-line.
const TILES = [
  ['tok/s', (s) => fmt.num(s.tok_s), (s) => `prompt ${fmt.num(s.prompt_tok_s, 0)} tok/s`],
  ['time to first token', (s) => fmt.ms(s.ttft_p50_s), (s) => `p50 · p90 ${fmt.ms(s.ttft_p90_s)}`],
  ['queue', (s) => `${s.running ?? '–'} / ${s.waiting ?? '–'}`, () => 'running / waiting'],
  ['KV cache', (s) => fmt.pct(s.kv_usage), () => 'pages in use'],
  ['expert hits / token', (s) => fmt.num(sum(s.hits_per_token || s.hits_per_token_total), 1), (s) => {
    const hits = s.hits_per_token || s.hits_per_token_total;
    if (!hits) return 'no decode tokens yet, or no expert tiers';
    const split = ['slots', 'host', 'disk'].map((t) => `${t} ${fmt.num(hits[t], 1)}`).join(' · ');
    return s.hits_per_token ? split : `since start: ${split}`;
  }],
  ['bytes moved / token', (s) => fmt.bytes(s.bytes_per_token && s.bytes_per_token.moved),
    (s) => (s.bytes_per_token ? `disk ${fmt.bytes(s.bytes_per_token.disk)} · CPU lane `
      + `${fmt.bytes(s.bytes_per_token.cpu_lane)}` : 'no decode tokens this second')],
  ['CPU lane busy', (s) => fmt.pct(s.cpu_lane_busy), (s) => (s.cpu_lane_busy === null ? 'no CPU lane (exact mode)'
    : 'share of the interval')],
  ['fraction of floor', (s) => fmt.pct(s.floor_fraction), (s) => (s.floor_fraction === null
    ? 'the engine reports no floor' : 'decode rate × floor time')],
  ['requests', (s) => `${s.requests ?? '–'}`, (s) => `${s.errors ?? 0} errors`],
];

// Charts: title, series [label, value from a stats event], y-axis formatter.
const CHARTS = [
  ['Tokens per second', [['generated', (s) => s.tok_s], ['prompt', (s) => s.prompt_tok_s]]],
  ['Latency (s)', [['TTFT p50', (s) => s.ttft_p50_s], ['TTFT p90', (s) => s.ttft_p90_s],
    ['inter-token p50', (s) => s.itl_p50_s]]],
  ['Expert hits per decode token, by tier', ['slots', 'host', 'disk']
    .map((t) => [t, (s) => (s.hits_per_token ? s.hits_per_token[t] : null)])],
  ['Bytes per decode token, by lane', [['moved to the compute device', (s) => s.bytes_per_token?.moved ?? null],
    ['read from disk', (s) => s.bytes_per_token?.disk ?? null],
    ['CPU lane (RAM)', (s) => s.bytes_per_token?.cpu_lane ?? null]], (u, ticks) => ticks.map(fmt.bytes)],
  ['Shares (0–1)', [['KV usage', (s) => s.kv_usage], ['CPU lane busy', (s) => s.cpu_lane_busy],
    ['fraction of floor', (s) => s.floor_fraction]], (u, ticks) => ticks.map(fmt.share)],
  ['Queue', [['running', (s) => s.running], ['waiting', (s) => s.waiting]]],
];

class Dashboard {
  constructor() {
    this.tiles = TILES.map(([label]) => {
      const tile = document.createElement('div');
      tile.className = 'tile';
      tile.innerHTML = '<div class="label"></div><div class="value">–</div><div class="sub">&nbsp;</div>';
      tile.querySelector('.label').textContent = label;
      $('tiles').append(tile);
      return tile;
    });
    this.times = [];
    this.charts = CHARTS.map(([title, series, yFormat]) => this.makeChart(title, series, yFormat));
    this.heat = new HeatMap($('heat'), $('heat-tip'), $('heat-note'));
    $('heat-mode').addEventListener('change', (e) => this.heat.setMode(e.target.value));
    new ResizeObserver(() => this.resize()).observe($('charts'));
  }

  makeChart(title, series, yFormat) {
    const box = document.createElement('div');
    box.className = 'chart';
    const heading = document.createElement('h3');
    heading.textContent = title;
    box.append(heading);
    $('charts').append(box);
    const opts = {
      width: 400, height: 180,
      series: [{}, ...series.map(([label], i) => ({ label, stroke: COLOURS[i], width: 1.5, spanGaps: false }))],
      axes: [{ stroke: '#9aa3b2', grid: { stroke: '#2a2f3a' } },
        { stroke: '#9aa3b2', grid: { stroke: '#2a2f3a' }, size: 60, ...(yFormat ? { values: yFormat } : {}) }],
      scales: { x: { time: true } },
      legend: { live: true },
    };
    const columns = series.map(() => []);
    const plot = new uPlot(opts, [this.times, ...columns], box);
    return { box, plot, series, columns };
  }

  resize() {
    for (const chart of this.charts) {
      const width = Math.max(200, chart.box.clientWidth - 16);
      if (Math.abs(chart.plot.width - width) > 2) chart.plot.setSize({ width, height: 180 });
    }
  }

  onStats(s) {
    TILES.forEach(([, value, sub], i) => {
      this.tiles[i].querySelector('.value').textContent = value(s);
      this.tiles[i].querySelector('.sub').textContent = sub(s);
    });
    if (s.dt === null) return; // the first snapshot of a stream has no rates yet
    this.times.push(s.t);
    if (this.times.length > WINDOW) this.times.shift();
    for (const chart of this.charts) {
      chart.series.forEach(([, pick], i) => {
        const column = chart.columns[i];
        const v = pick(s);
        column.push(v === undefined ? null : v);
        if (column.length > WINDOW) column.shift();
      });
      chart.plot.setData([this.times, ...chart.columns]);
    }
  }
}

let dashboard = null;

/** Connects to the stats stream for good: reconnects after errors, asks for the key on 401. */
export async function runDashboard(status) {
  dashboard = dashboard || new Dashboard();
  let backoff = 1000;
  for (;;) {
    try {
      const response = await apiFetch('/v1/stats/stream', { headers: { Accept: 'text/event-stream' } });
      if (!response.ok) throw new Error(await errorMessage(response));
      status('live');
      backoff = 1000;
      await readEvents(response, (event, data) => {
        if (event === 'stats') dashboard.onStats(JSON.parse(data));
        else if (event === 'heat') dashboard.heat.update(JSON.parse(data));
      });
      status('reconnecting');
    } catch (err) {
      status('down', err.message);
    }
    await new Promise((resolve) => setTimeout(resolve, backoff));
    backoff = Math.min(10000, backoff * 2);
  }
}

export function resizeDashboard() {
  if (dashboard) dashboard.resize();
}
