"""The runtime core: Context, Engine (background thread), negotiation, response cache, fusion."""
