"""Primitives the privacy layers share: clipping of an update (clipping) and secure
aggregation's masks, shares and graph (secagg)."""
