// The ToMeSD and CA-ToMe nodes have an INT input named "seed" (where each cell's destination sits), so
// both front ends give it a "control after generate" widget that defaults to "randomize": a comparison
// would then change after every run. New nodes start at "fixed"; a loaded workflow keeps its own value
// (configure() restores the saved widget values after this hook).
import { app } from "../../../scripts/app.js";
import { SEEDED_NODES } from "./toma_nodes.js";

app.registerExtension({
  name: "comfyuitomatokenmerging.fixed_seed",
  nodeCreated(node) {
    if (!SEEDED_NODES.has(node.comfyClass)) return;
    const control = node.widgets?.find((w) => w.name === "control_after_generate");
    if (control) control.value = "fixed";
  },
});
