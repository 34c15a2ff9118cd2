"""The runtime core: Context, Engine (background thread), negotiation, response cache, fusion.

Must not touch: framework tensors, the launcher, a transport's private state.
"""
