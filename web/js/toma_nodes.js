// The pack's node types as the front-end extensions of this folder know them; the one list they import
// (tests/test_front_end.py checks it against the node classes the server registers).
export const MERGE_NODES = new Set(["ToMAPatchModel", "ToMAPatchModelAdvanced", "ToMeSDPatchModel", "CAToMePatchModel",
  "DiToPatchModel", "ToMAWanVideoWrapper"]);
// The merge nodes with a "seed" input (where each stride's destination sits).
export const SEEDED_NODES = new Set(["ToMeSDPatchModel", "CAToMePatchModel", "DiToPatchModel"]);
