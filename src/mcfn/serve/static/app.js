// The page: streams a completion from /v1/completions and draws, at each refocus, the whole history as a strip of
// blocks coloured by what the working context holds of it (the layout string each refocus event carries: one
// character a block of K tokens, "0" raw tokens, "k" inside a gist of level k, "·" left out).
"use strict";

const $ = (id) => document.getElementById(id);
const COLOURS = { "0": "#1f6f8b", "1": "#5fa8c4", "2": "#a3d0e0", "3": "#cfe6ee", "4": "#e6f2f6", "·": "#e9e9ec" };
const COPY_COLOUR = "#d62828";
let run = null;
let rows = [];        // one per refocus: {layout, copies: Set of block indices}
let controller = null;

function legend(levels) {
  const names = { "0": "raw tokens", "·": "left out" };
  const keys = ["0", ...Array.from({ length: levels }, (_, i) => String(i + 1)), "·"];
  $("legend").innerHTML = keys.map((k) =>
    `<span style="--c:${COLOURS[k] || "#eee"}">${names[k] || "gist, level " + k}</span>`).join("") +
    `<span style="--c:${COPY_COLOUR}">copied from</span>`;
}

function draw() {
  const canvas = $("strip");
  const ctx = canvas.getContext("2d");
  const width = Math.max(1, ...rows.map((r) => r.layout.length));
  const shown = rows.slice(-60);
  const rowHeight = shown.length ? Math.max(3, Math.min(24, Math.floor(240 / shown.length))) : 24;
  canvas.width = Math.max(300, Math.min(4000, width));
  canvas.height = Math.max(24, rowHeight * shown.length);
  canvas.style.height = `${Math.min(260, Math.max(40, 28 * shown.length))}px`;  // rows stay legible when few
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  const cell = canvas.width / width;
  shown.forEach((row, y) => {
    for (let b = 0; b < row.layout.length; b++) {
      ctx.fillStyle = COLOURS[row.layout[b]] || "#ccc";
      ctx.fillRect(b * cell, y * rowHeight, Math.ceil(cell), rowHeight - 1);
    }
    ctx.fillStyle = COPY_COLOUR;
    const mark = Math.max(Math.ceil(cell), canvas.width / 200);  // a copy's source stays visible at any history
    for (const b of row.copies) ctx.fillRect(b * cell - mark / 2, y * rowHeight, mark, rowHeight - 1);
  });
}

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function figures(f) {
  if (f.tokens_per_s !== undefined) $("tps").textContent = Number(f.tokens_per_s).toFixed(1);
  if (f.refocuses_per_token !== undefined) $("rpt").textContent = Number(f.refocuses_per_token).toFixed(3);
  if (f.cache_kept !== undefined) $("kept").textContent = (100 * f.cache_kept).toFixed(0) + " %";
  if (f.history !== undefined) $("tokens").textContent = f.history.toLocaleString();
}

async function loadRun() {
  const response = await fetch("/v1/mcfn");
  run = await response.json();
  $("run").textContent = `${run.model}: W = ${run.W} entries, T = ${run.T}, ships ${run.shipped}`;
  $("block").textContent = run.K;
  $("max_tokens").max = run.max_tokens;
  $("context").innerHTML = `<option value="">shipped (${run.shipped})</option>` +
    run.contexts.map((c) => `<option value="${c}">${c}</option>`).join("");
  legend(run.L);
}

async function generate() {
  const prompt = $("prompt").value;
  rows = [];
  draw();
  $("generated").textContent = "";
  $("prompt-tail").textContent = prompt.slice(-600);
  ["tps", "rpt", "kept", "tokens"].forEach((id) => ($(id).textContent = "–"));
  const body = {
    prompt, stream: true,
    max_tokens: Number($("max_tokens").value),
    temperature: Number($("temperature").value),
  };
  if ($("context").value) body.context = $("context").value;
  controller = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  setStatus("reading the prompt…");
  const started = performance.now();
  let tokens = 0, refocuses = 0, firstToken = null;
  try {
    const response = await fetch("/v1/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      const error = await response.json();
      throw new Error(`${response.status}: ${error.error ? error.error.message : JSON.stringify(error)}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).replace(/^data: /, "");
        buffer = buffer.slice(cut + 2);
        if (line === "[DONE]") continue;
        const event = JSON.parse(line);
        if (event.error) throw new Error(event.error.message);
        const extra = event.mcfn || {};
        if (extra.refocus) {
          refocuses += 1;
          rows.push({ layout: extra.refocus.layout, copies: new Set() });
          figures({ cache_kept: extra.refocus.cache_kept, history: extra.refocus.history });
          setStatus(`refocus ${refocuses} at ${extra.refocus.history.toLocaleString()} tokens`);
          draw();
        }
        if (event.choices && event.choices.length && event.choices[0].text !== undefined) {
          const text = event.choices[0].text;
          if (text) {
            tokens += 1;
            if (firstToken === null) firstToken = performance.now();
            $("generated").textContent += text;
            const seconds = (performance.now() - firstToken) / 1000;
            if (seconds > 0) figures({ tokens_per_s: tokens / seconds, refocuses_per_token: refocuses / tokens });
          }
          if (extra.copy && extra.copy.length && rows.length && run) {
            extra.copy.forEach((p) => rows[rows.length - 1].copies.add(Math.floor(p / run.K)));
            draw();
          }
        }
        if (extra.figures) {
          figures(extra.figures);
          setStatus(`done in ${((performance.now() - started) / 1000).toFixed(1)} s: ${extra.figures.policy}`);
        }
      }
    }
  } catch (error) {
    if (error.name === "AbortError") setStatus("stopped");
    else setStatus(String(error.message || error), true);
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
}

$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", () => controller && controller.abort());
$("file").addEventListener("change", async (event) => {
  const file = event.target.files[0];
  if (file) $("prompt").value = await file.text();
});
loadRun().catch((error) => setStatus(`cannot read the run: ${error}`, true));
