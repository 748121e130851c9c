"""DeepSpeed ZeRO-3 integration (all DeepSpeed seams live in this package).

This package is part of the fixed layout; the integration lands with its own issue.
"""
