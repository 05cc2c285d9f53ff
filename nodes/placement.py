"""Where merging applies (the Advanced node's ``scope``): one value per interception point, read by the
adapters; what "auto" means per family; the log line when a family cannot honour a placement.

- "attention": the self-attention runs on merged tokens: queries, keys and values come from them and the
  output is unmerged (the paper's placement on UNets; on Flux-layout double blocks, the joint attention).
- "keys/values": queries stay at full resolution, keys and values come from merged tokens; the output
  has every token, so nothing is unmerged (UNets).
- "queries": queries come from merged tokens, keys and values from every token; the output is unmerged
  (ComfyUI ToMe's placement, with ToMA's weights) (UNets).
- "block": the whole transformer block (self-attention, cross-attention, feed-forward) runs on merged
  tokens and its update is unmerged.
Where keys are merged ("attention", "keys/values"), ``proportional`` attention weighs each merged key
by the tokens it stands for (toma_core.attention).
"""
import logging

log = logging.getLogger("ComfyUI-ToMA")

AUTO = "auto"
ATTENTION = "attention"
KEYS_VALUES = "keys/values"
QUERIES = "queries"
BLOCK = "block"
SCOPES = (AUTO, ATTENTION, BLOCK, KEYS_VALUES, QUERIES)

UNET_PLACEMENTS = (ATTENTION, BLOCK, KEYS_VALUES, QUERIES)
UNET_AUTO = ATTENTION
# What "auto" means on DiTs. docs/benchmarks.md: at the speed a real-width Flux gets, whole blocks keep the
# trained proxy's pictures closer than the attention-only placement.
DIT_AUTO = BLOCK
KEYS_MERGED = (ATTENTION, KEYS_VALUES)  # where proportional attention applies


def check(scope: str) -> str:
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    return scope


def resolve(scope: str, family: str, honoured: tuple, auto: str) -> str:
    """The placement ``family`` uses for ``scope``: ``auto`` for "auto"; a placement the family does not
    honour falls back to ``auto`` with a log line naming both."""
    check(scope)
    if scope == AUTO:
        return auto
    if scope not in honoured:
        log.warning("ToMA: %s cannot merge with scope %s (it offers %s); it uses %s", family, scope,
                    ", ".join(honoured), auto)
        return auto
    return scope
