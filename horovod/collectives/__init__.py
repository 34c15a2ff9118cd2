"""Collective algorithms written once against the Transport contract."""
