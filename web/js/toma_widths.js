// Default width of the token merge nodes in a canvas: wide enough that each text widget shows its label
// next to its default value. The CA-ToMe checkpoints list is longer than the width a front end gives a
// new node, and a canvas text widget then drops (current front ends) or overprints (the March-2024 one)
// its label. Nodes 2.0 lays labels out on their own; there the width is left alone.
import { app } from "../../../scripts/app.js";
import { MERGE_NODES } from "./toma_nodes.js";

const WIDGET_FONT = "12px sans-serif"; // about the canvas widget font of both front ends
const WIDGET_CHROME = 100; // node and widget margins, arrows and the gap between label and value

const measureContext = document.createElement("canvas").getContext("2d");

function textWidth(text) {
  measureContext.font = WIDGET_FONT;
  return measureContext.measureText(text).width;
}

function widthForTextWidgets(node) {
  const texts = (node.widgets ?? []).filter((widget) => widget.type === "text" || widget.type === "string");
  return Math.max(0, ...texts.map((widget) =>
    textWidth(widget.label || widget.name) + textWidth(String(widget.value ?? "")) + WIDGET_CHROME));
}

app.registerExtension({
  name: "comfyuitomatokenmerging.widths",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!MERGE_NODES.has(nodeData.name)) return;
    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      const width = widthForTextWidgets(this);
      if (width > this.size[0]) this.setSize ? this.setSize([width, this.size[1]]) : (this.size[0] = width);
      return result;
    };
  },
});
