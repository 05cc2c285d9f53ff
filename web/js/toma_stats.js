// Live stats of the token merge nodes: after each sampling run the server sends a
// "comfyui_toma.stats" websocket message {node, text, lines, summary} (nodes/live_stats.py);
// the lines are drawn under the node that patched the model. No polling: nothing is drawn
// for a node until one of its runs ended.
// This file is served at /extensions/<pack>/js/; the "../../../scripts/*.js" imports resolve in the
// old bundled front end and, through its shims, in the current comfyui-frontend-package.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

const EVENT = "comfyui_toma.stats";
const NODE_TYPES = new Set(["ToMAPatchModel", "ToMAPatchModelAdvanced", "ToMeSDPatchModel", "CAToMePatchModel"]);
const FONT_SIZE = 12;
const LINE_HEIGHT = 15;
const PAD = 4;

function drawStats(ctx, node, lines) {
  ctx.save();
  ctx.font = `${FONT_SIZE}px sans-serif`;
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  const width = Math.max(node.size[0], ...lines.map((line) => ctx.measureText(line).width + 2 * PAD));
  const top = node.size[1] + PAD + 2; // just under the node body (size excludes the title bar)
  ctx.fillStyle = "rgba(0, 0, 0, 0.65)";
  ctx.fillRect(0, top, width, lines.length * LINE_HEIGHT + 2 * PAD);
  ctx.fillStyle = "#a6e3a1";
  lines.forEach((line, i) => ctx.fillText(line, PAD, top + PAD + i * LINE_HEIGHT));
  ctx.restore();
}

function findNode(id) {
  const graph = app.graph;
  if (!graph) return null;
  return graph.getNodeById(id) ?? graph.getNodeById(Number(id)) ?? null;
}

app.registerExtension({
  name: "comfyui_toma.stats",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_TYPES.has(nodeData.name)) return;
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const result = onDrawForeground?.apply(this, arguments);
      if (this.tomaStats && !this.flags?.collapsed) drawStats(ctx, this, this.tomaStats);
      return result;
    };
  },

  setup() {
    api.addEventListener(EVENT, ({ detail }) => {
      const node = findNode(detail?.node);
      if (!node || !NODE_TYPES.has(node.type ?? node.comfyClass)) return;
      node.tomaStats = detail.lines ?? String(detail.text ?? "").split("\n");
      node.setDirtyCanvas?.(true, false);
      app.graph.setDirtyCanvas?.(true, false);
    });
  },
});
