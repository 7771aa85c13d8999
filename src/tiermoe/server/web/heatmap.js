// The per-layer expert heat map: one canvas pixel block per (MoE layer, expert). A dense grid of up to
// ~100 x 256 cells is one ImageData fill; uPlot draws series on axes and has no heat-map type in its
// distribution, so this one small renderer is drawn by hand.

const TIER_NAMES = ['GPU slot', 'host RAM', 'disk'];
const TIER_COLOURS = [[95, 211, 141], [90, 169, 255], [255, 107, 107]];

/** Count colour: dark blue -> yellow on a log scale (a few hot experts would wash out a linear one). */
function countColour(share) {
  const stops = [[15, 17, 21], [40, 60, 140], [180, 60, 140], [255, 200, 60], [255, 255, 220]];
  const x = Math.min(0.9999, Math.max(0, share)) * (stops.length - 1);
  const i = Math.floor(x);
  const f = x - i;
  return stops[i].map((c, k) => Math.round(c + (stops[i + 1][k] - c) * f));
}

export class HeatMap {
  constructor(canvas, tip, note) {
    this.canvas = canvas;
    this.tip = tip;
    this.note = note;
    this.data = null;
    this.mode = 'count';
    canvas.addEventListener('mousemove', (event) => this.hover(event));
    canvas.addEventListener('mouseleave', () => { this.tip.textContent = '\u00a0'; });
  }

  setMode(mode) {
    this.mode = mode;
    this.draw();
  }

  update(data) {
    if (!data.available) {
      this.data = null;
      this.note.textContent = data.reason || 'no per-expert counts';
      this.canvas.hidden = true;
      return;
    }
    this.data = data;
    this.canvas.hidden = false;
    const what = data.measure === 'uses' ? 'uses since start (store counters)'
      : 'recent picks (device cache, decayed)';
    this.note.textContent = `${data.layers.length} MoE layers × ${data.experts} experts · ${what}`;
    this.draw();
  }

  draw() {
    const d = this.data;
    if (!d || !d.layers.length || !d.experts) return;
    const rows = d.layers.length;
    const cols = d.experts;
    const canvas = this.canvas;
    canvas.width = cols;
    canvas.height = rows;
    canvas.style.height = `${Math.max(120, Math.min(600, rows * 6))}px`;
    const ctx = canvas.getContext('2d');
    const image = ctx.createImageData(cols, rows);
    let max = 0;
    for (const row of d.counts) for (const v of row) max = Math.max(max, v);
    const scale = Math.log1p(max) || 1;
    for (let r = 0; r < rows; r++) {
      for (let c = 0; c < cols; c++) {
        const v = d.counts[r][c];
        const known = v !== undefined;
        const rgb = !known ? [0, 0, 0] : this.mode === 'tier' ? TIER_COLOURS[d.tiers[r][c]]
          : countColour(Math.log1p(v) / scale);
        const at = (r * cols + c) * 4;
        image.data.set([...rgb, known ? 255 : 0], at);
      }
    }
    ctx.putImageData(image, 0, 0);
  }

  hover(event) {
    const d = this.data;
    if (!d) return;
    const box = this.canvas.getBoundingClientRect();
    const col = Math.floor(((event.clientX - box.left) / box.width) * d.experts);
    const row = Math.floor(((event.clientY - box.top) / box.height) * d.layers.length);
    const count = (d.counts[row] || [])[col];
    if (count === undefined) return;
    const unit = d.measure === 'uses' ? 'uses' : 'picks';
    const tier = TIER_NAMES[d.tiers[row][col]];
    this.tip.textContent = `layer ${d.layers[row]} · expert ${col} · ${count} ${unit} · in ${tier}`;
  }
}
