// Live stats of the token merge nodes. After each sampling run the server sends the lines twice
// (nodes/live_stats.py): as the node's progress text, which current front ends render themselves in the
// classic canvas and in Nodes 2.0, and as a "comfyui_toma.stats" message {node, prompt_id, text, lines,
// summary}.
// From that message this extension
// - keeps the progress text on the node after the prompt ends (front ends that clear it then get it back,
//   from their own "progress_text" event, until the next prompt);
// - grows a classic node so that its progress text fits;
// - shows the lines itself where the front end shows no progress text: drawn inside the node below its
//   widgets on a canvas (the March-2024 front end; links run behind nodes, so none crosses the text),
//   appended to the node's body in a DOM-rendered node that does not render progress text.
// No polling: nothing is shown for a node until one of its runs ended.
// This file is served at /extensions/<pack>/js/; the "../../../scripts/*.js" imports resolve in the
// old bundled front end and, through its shims, in the current comfyui-frontend-package.
import { app } from "../../../scripts/app.js";
import { MERGE_NODES } from "./toma_nodes.js";
import { api } from "../../../scripts/api.js";

const EVENT = "comfyui_toma.stats";
const PROGRESS_TEXT_WIDGET = "$$node-text-preview"; // where current front ends show a node's progress text
const PROGRESS_TEXT_LINE_HEIGHT = 16; // their text-xs lines
const PROGRESS_TEXT_MIN_HEIGHT = 58; // the height they reserve for it, padding included
const PROGRESS_TEXT_PADDING = 48; // node margins and the widget's own padding, both sides
const PROGRESS_TEXT_WIDTH_SLACK = 1.2; // their font runs wider than the canvas's sans-serif
const FONT_SIZE = 12;
const LINE_HEIGHT = 15;
const PAD = 4;
const DOM_STATS_CLASS = "comfyui-toma-stats";
const DOM_CHECK_DELAY_MS = 300; // a DOM-rendered node shows new widget content within a few frames

const measureContext = document.createElement("canvas").getContext("2d");

function textWidth(text, font) {
  measureContext.font = font;
  return measureContext.measureText(text).width;
}

function findNode(id) {
  const graph = app.graph;
  if (!graph) return null;
  return graph.getNodeById(id) ?? graph.getNodeById(Number(id)) ?? null;
}

function progressTextShown(node) {
  return Boolean(node.widgets?.some((widget) => widget.name === PROGRESS_TEXT_WIDGET));
}

function domNode(node) {
  return document.querySelector(`.lg-node[data-node-id="${node.id}"]`);
}

// Canvas fallback: the lines get a block of their own at the bottom of the node body.
function blockHeight(lines) {
  return lines.length * LINE_HEIGHT + 2 * PAD;
}

function reserveBlock(node, lines) {
  const previous = node.tomaStatsBlock ?? 0;
  const block = blockHeight(lines);
  const widest = Math.max(...lines.map((line) => textWidth(line, `${FONT_SIZE}px sans-serif`)));
  const width = Math.max(node.size[0], widest + 4 * PAD);
  const height = Math.max(node.size[1] - previous, node.computeSize()[1]) + block;
  node.tomaStatsBlock = block;
  node.setSize ? node.setSize([width, height]) : (node.size = [width, height]);
}

function drawStats(ctx, node, lines) {
  const top = node.size[1] - node.tomaStatsBlock; // node-local; size excludes the title bar
  ctx.save();
  ctx.fillStyle = "rgba(0, 0, 0, 0.5)";
  ctx.fillRect(PAD, top, node.size[0] - 2 * PAD, node.tomaStatsBlock - PAD);
  ctx.font = `${FONT_SIZE}px sans-serif`;
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  ctx.fillStyle = "#a6e3a1";
  lines.forEach((line, i) => ctx.fillText(line, 2 * PAD, top + PAD + i * LINE_HEIGHT));
  ctx.restore();
}

// Classic canvas of a current front end: its progress text widget keeps a fixed minimum height, so the
// node grows by the rows the lines wrap to at its width (it does not widen into its neighbours).
function fitProgressText(node, lines) {
  const rowWidth = Math.max(1, node.size[0] - PROGRESS_TEXT_PADDING);
  const rows = lines.reduce((sum, line) => sum + Math.ceil(
    (PROGRESS_TEXT_WIDTH_SLACK * textWidth(line, `${FONT_SIZE}px sans-serif`)) / rowWidth), 0);
  const extra = Math.max(0, (rows + 1) * PROGRESS_TEXT_LINE_HEIGHT - PROGRESS_TEXT_MIN_HEIGHT);
  const height = node.computeSize()[1] + extra;
  if (height > node.size[1]) node.setSize([node.size[0], height]);
}

// A DOM-rendered node that did not render the progress text gets the lines appended to its body.
function showInDom(node, lines) {
  const element = domNode(node);
  if (!element || lines.every((line) => element.textContent.includes(line))) return;
  const body = element.querySelector(`[data-testid="node-body-${node.id}"]`) ?? element;
  let box = body.querySelector(`.${DOM_STATS_CLASS}`);
  if (!box) {
    box = document.createElement("div");
    box.className = DOM_STATS_CLASS;
    Object.assign(box.style, { padding: "4px 12px", fontSize: `${FONT_SIZE}px`, lineHeight: "1.3",
                               color: "#a6e3a1", whiteSpace: "pre-wrap" });
    body.appendChild(box);
  }
  box.textContent = lines.join("\n");
}

function showStats(node, lines, text) {
  node.tomaStats = lines;
  node.tomaProgressText = text;
  if (progressTextShown(node)) {
    node.tomaStatsNative = true;
    if (!domNode(node)) fitProgressText(node, lines);
  } else if (!domNode(node)) {
    reserveBlock(node, lines);
  }
  if (domNode(node)) setTimeout(() => showInDom(node, lines), DOM_CHECK_DELAY_MS);
  node.setDirtyCanvas?.(true, true);
  app.graph.setDirtyCanvas?.(true, true);
}

// Front ends that clear progress text when a prompt ends: show the last stats again, through the front
// end's own event, once its handlers of the end of the prompt have run.
function restoreProgressText() {
  setTimeout(() => {
    for (const node of app.graph?._nodes ?? []) {
      if (node.tomaStatsNative && !progressTextShown(node)) {
        api.dispatchCustomEvent("progress_text", { nodeId: String(node.id), text: node.tomaProgressText });
        if (domNode(node)) setTimeout(() => showInDom(node, node.tomaStats), DOM_CHECK_DELAY_MS);
      }
    }
  }, 0);
}

app.registerExtension({
  name: "comfyuitomatokenmerging.stats",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!MERGE_NODES.has(nodeData.name)) return;
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const result = onDrawForeground?.apply(this, arguments);
      if (this.tomaStats && this.tomaStatsBlock && !this.tomaStatsNative && !this.flags?.collapsed) {
        drawStats(ctx, this, this.tomaStats);
      }
      return result;
    };
  },

  setup() {
    api.addEventListener(EVENT, ({ detail }) => {
      const node = findNode(detail?.node);
      if (!node || !MERGE_NODES.has(node.type ?? node.comfyClass)) return;
      const lines = detail.lines ?? String(detail.text ?? "").split("\n");
      showStats(node, lines, lines.join("  \n")); // as nodes/live_stats.progress_text
    });
    for (const ending of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(ending, restoreProgressText);
    }
  },
});
