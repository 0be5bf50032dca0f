"""Serving: the JSON-lines and HTTP front ends, the asyncio engine, admission and what leaves the server."""
