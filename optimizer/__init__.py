"""Offloaded ZeRO-3 optimizer adapter (subgroups staged through a TierStore).

This package is part of the fixed layout; its optimizer lands with its own issue.
"""
