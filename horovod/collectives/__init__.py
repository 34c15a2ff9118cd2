"""Collective algorithms written once against the Transport contract.

Must not touch: the engine, negotiation or framework tensors: algorithms see a transport and
arrays.
"""
